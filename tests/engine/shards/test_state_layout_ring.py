"""The CPU Adam ring's default size (StateLayout.ring_bytes, [Note: streamed optimizer
step] in offload/adam_stream.py): buffer_count buffers of the mean piece's fp32 state
whatever the state and master precision, so compressed pieces give the drive as many
bytes in flight as fp32 ones; an explicit buffer_bytes is taken as it is; the ring always
holds the largest piece."""

from __future__ import annotations

import pytest
import torch

from tierzero.engine.shards.state_layout import RingRequest, StateLayout
from tierzero.offload.host_ring import page_up
from tierzero.offload.stream_sizes import piece_bytes

CHUNK = 1 << 16
GROUPS = {"blk.0": 3 * CHUNK + 100, "blk.1": 5 * CHUNK, "root": 1000}


def layout(state: str, master: str, ring: RingRequest, chunk: int = CHUNK) -> StateLayout:
    out = StateLayout(streamed=True, chunk_numel=chunk, state_precision=state, coarse=False,
                      ring=ring, master_precision=master)
    for key, n in GROUPS.items():
        out.declare(key, n, torch.bfloat16, True)
    return out


@pytest.mark.parametrize(("state", "master"), [("int8", "fp32"), ("bf16", "fp32"),
                                               ("int8", "bf16"), ("fp32", "bf16")])
def test_compressed_state_gets_the_fp32_rings_bytes(state: str, master: str) -> None:
    ring = RingRequest(buffer_count=4, buffer_bytes=None)
    fp32 = layout("fp32", "fp32", ring).ring_bytes()
    assert layout(state, master, ring).ring_bytes() == fp32
    pieces = [min(CHUNK, n - lo) for n in GROUPS.values() for lo in range(0, n, CHUNK)]
    # the mean fp32 piece: master and two moments, 4 B each (plus a whole shard's param)
    mean = sum(piece_bytes(p, "fp32", 2 if p == 1000 else 0) for p in pieces) // len(pieces)
    assert fp32 == page_up(4 * mean)


def test_an_explicit_buffer_size_is_kept_and_the_largest_piece_always_fits() -> None:
    small = layout("int8", "bf16", RingRequest(buffer_count=2, buffer_bytes=3 << 20))
    assert small.ring_bytes() == 6 << 20
    tiny = layout("fp32", "fp32", RingRequest(buffer_count=1, buffer_bytes=4096))
    assert tiny.ring_bytes() == page_up(piece_bytes(CHUNK, "fp32"))


@pytest.mark.parametrize(("state", "master"), [("int8", "fp32"), ("int8", "bf16"),
                                               ("bf16", "fp32")])
def test_larger_compressed_pieces_keep_the_fp32_rings_bytes(state: str, master: str) -> None:
    """[Note: a moment piece is one request] in engine/shards/tier_config.py: int8 moments
    in pieces of four times the elements (bf16: twice) fill the ring sized by fp32's cut
    (RingRequest.piece_numel), not one four times the bytes; the largest piece still fits."""
    fp32 = layout("fp32", "fp32", RingRequest(4, None, CHUNK)).ring_bytes()
    big = 4 * CHUNK if state == "int8" else 2 * CHUNK
    assert layout(state, master, RingRequest(4, None, CHUNK), chunk=big).ring_bytes() == fp32
    # sized by its own pieces, the ring would grow with them
    assert layout(state, master, RingRequest(4, None), chunk=big).ring_bytes() > fp32
    one = layout(state, master, RingRequest(1, 4096, CHUNK), chunk=big)
    assert one.ring_bytes() >= piece_bytes(big, state, 0, 4 if master == "fp32" else 0)
