"""The CPU Adam ring's default size (StateLayout.ring_bytes, [Note: streamed optimizer
step] in offload/adam_stream.py, [Note: the ring's floor] in state_layout.py):
buffer_count buffers of the mean piece's fp32 state whatever the state and master
precision, so compressed pieces give the drive as many bytes in flight as fp32 ones; the
ring at least the largest group's streamed state (reads a unit ahead), up to
RING_FLOOR_BYTES; an explicit buffer_bytes is taken as it is; the ring always holds the
largest piece. StateLayout holds no tensor: these sizes are arithmetic, so the groups
may be model-sized."""

from __future__ import annotations

import pytest
import torch

from tierzero.engine.shards.state_layout import RING_FLOOR_BYTES, RingRequest, StateLayout
from tierzero.offload.host_ring import page_up
from tierzero.offload.stream_sizes import piece_bytes

# pieces of 1M elements (fp32 moments' one-request piece): four fp32 pieces (master and
# two moments, 12 MiB each) are below the floor, and so is a small model's unit
CHUNK = 1 << 20
GROUPS = {"blk.0": 90 * CHUNK + 100, "blk.1": 160 * CHUNK, "root": 1000}
SMALL_GROUPS = {"blk.0": 3 * CHUNK + 100, "blk.1": 5 * CHUNK, "root": 1000}
# pieces of 8M elements: four fp32 pieces (96 MiB each) above the floor
BIG_CHUNK = 8 << 20
BIG_GROUPS = {"blk.0": 90 * BIG_CHUNK + 100, "blk.1": 120 * BIG_CHUNK, "root": 1000}


def layout(state: str, master: str, ring: RingRequest, chunk: int = CHUNK,
           groups: dict[str, int] = GROUPS) -> StateLayout:
    out = StateLayout(streamed=True, chunk_numel=chunk, state_precision=state, coarse=False,
                      ring=ring, master_precision=master)
    for key, n in groups.items():
        out.declare(key, n, torch.bfloat16, True)
    return out


def pieces(n: int, chunk: int) -> list[tuple[int, bool]]:
    """(numel, shard in one piece) of every piece of a group of `n` elements."""
    return [(min(chunk, n - lo), n <= chunk) for lo in range(0, n, chunk)]


def ring_piece(numel: int, whole: bool, state: str, master: str) -> int:
    if master == "bf16":
        return piece_bytes(numel, state, 0, 2 if whole else 0)
    return piece_bytes(numel, state, 2 if whole else 0)


def mean_fp32_piece(groups: dict[str, int], chunk: int) -> int:
    each = [p for n in groups.values() for p in pieces(n, chunk)]
    return sum(ring_piece(k, w, "fp32", "fp32") for k, w in each) // len(each)


PRECISIONS = [("fp32", "fp32"), ("int8", "fp32"), ("bf16", "fp32"), ("int8", "bf16"),
              ("fp32", "bf16")]


@pytest.mark.parametrize(("state", "master"), PRECISIONS)
def test_the_default_ring_is_at_least_the_floor_at_the_users_scale(state: str,
                                                                   master: str) -> None:
    """Groups of 90M-160M elements: a unit's streamed state is above the floor at every
    precision, four mean pieces below it."""
    assert 4 * mean_fp32_piece(GROUPS, CHUNK) < RING_FLOOR_BYTES
    unit = sum(ring_piece(k, w, state, master) for k, w in pieces(GROUPS["blk.1"], CHUNK))
    assert unit > RING_FLOOR_BYTES
    for count in (1, 4, 8):  # buffer_count does not lower it
        ring = layout(state, master, RingRequest(buffer_count=count, buffer_bytes=None))
        assert ring.ring_bytes() == RING_FLOOR_BYTES


@pytest.mark.parametrize(("state", "master"), PRECISIONS)
def test_a_small_models_ring_holds_its_largest_unit(state: str, master: str) -> None:
    """Below the floor the largest group's streamed state sets the ring, at its precision:
    reads run a unit ahead, and host memory stays bounded by the unit."""
    ring = layout(state, master, RingRequest(1, None), CHUNK, SMALL_GROUPS)
    unit = max(sum(ring_piece(k, w, state, master) for k, w in pieces(n, CHUNK))
               for n in SMALL_GROUPS.values())
    assert mean_fp32_piece(SMALL_GROUPS, CHUNK) < unit < RING_FLOOR_BYTES
    assert ring.ring_bytes() == page_up(unit)
    # more buffers of the mean piece than a unit holds: the buffers set it
    many = layout(state, master, RingRequest(16, None), CHUNK, SMALL_GROUPS)
    assert many.ring_bytes() == page_up(16 * mean_fp32_piece(SMALL_GROUPS, CHUNK)) > unit


@pytest.mark.parametrize(("state", "master"), [("int8", "fp32"), ("bf16", "fp32"),
                                               ("int8", "bf16"), ("fp32", "bf16")])
def test_compressed_state_gets_the_fp32_rings_bytes(state: str, master: str) -> None:
    """Above the floor the mean fp32 piece sizes a buffer, at every precision."""
    ring = RingRequest(buffer_count=4, buffer_bytes=None)
    fp32 = layout("fp32", "fp32", ring, BIG_CHUNK, BIG_GROUPS).ring_bytes()
    assert layout(state, master, ring, BIG_CHUNK, BIG_GROUPS).ring_bytes() == fp32
    # the mean fp32 piece: master and two moments, 4 B each (plus a whole shard's param)
    mean = mean_fp32_piece(BIG_GROUPS, BIG_CHUNK)
    assert 4 * mean > RING_FLOOR_BYTES
    assert fp32 == page_up(4 * mean)


def test_an_explicit_buffer_size_is_kept_and_the_largest_piece_always_fits() -> None:
    small = layout("int8", "bf16", RingRequest(buffer_count=2, buffer_bytes=3 << 20))
    assert small.ring_bytes() == 6 << 20  # below the floor and a unit: asked for by name
    tiny = layout("fp32", "fp32", RingRequest(buffer_count=1, buffer_bytes=4096))
    assert tiny.ring_bytes() == page_up(piece_bytes(CHUNK, "fp32"))


@pytest.mark.parametrize(("state", "master"), [("int8", "fp32"), ("int8", "bf16"),
                                               ("bf16", "fp32")])
def test_larger_compressed_pieces_keep_the_fp32_rings_bytes(state: str, master: str) -> None:
    """[Note: a moment piece is one request] in engine/shards/tier_config.py: int8 moments
    in pieces of four times the elements (bf16: twice) fill the ring sized by fp32's cut
    (RingRequest.piece_numel), not one four times the bytes; the largest piece still fits."""
    fp32 = layout("fp32", "fp32", RingRequest(4, None, BIG_CHUNK), BIG_CHUNK,
                  BIG_GROUPS).ring_bytes()
    big = 4 * BIG_CHUNK if state == "int8" else 2 * BIG_CHUNK
    assert layout(state, master, RingRequest(4, None, BIG_CHUNK), big,
                  BIG_GROUPS).ring_bytes() == fp32
    # sized by its own pieces, the ring would grow with them
    assert layout(state, master, RingRequest(4, None), big, BIG_GROUPS).ring_bytes() > fp32
    one = layout(state, master, RingRequest(1, 4096, BIG_CHUNK), big, BIG_GROUPS)
    assert one.ring_bytes() >= piece_bytes(big, state, 0, 4 if master == "fp32" else 0)
