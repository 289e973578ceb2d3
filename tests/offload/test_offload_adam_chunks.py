"""offload.AdamStream with the optimizer state in pieces ([Note: optimizer state in chunks]):
for every piece size, gradient home and compute dtype the state after several steps equals,
bitwise, the in-place reference step over whole host tensors (tests/adam_reference.py: the
unchunked step); each state byte crosses NVMe once per direction per step; the host ring is
sized by the piece, not the shard; and a consumed gradient cached over its NVMe home is
dropped without a write.

Exactness: the same Adam kernel runs on the same fp32 inputs, piece by piece or whole
(Adam is elementwise), so the comparison is torch.equal, not a tolerance.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from adam_reference import HostShards
from tiers_util import cpu_settings

from tierzero.offload import (
    AdamHyper,
    AdamStream,
    ShardSpec,
    TierManager,
)
from tierzero.offload.host_ring import page_up
from tierzero.swap import SwapStore

NUMELS = (1000, 0, 4097, 33, 7000, 5)
ORDER = [4, 0, 2, 1, 5, 3]
STATE = ("master", "exp_avg", "exp_avg_sq")
HYPER = AdamHyper(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)


def pieces(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + chunk)) for lo in range(0, n, chunk)] if n > chunk else [(0, n)]


class ChunkRig:
    """A TierManager holding NUMELS' state in pieces of `chunk` elements on NVMe (gradient
    homed on `grad_home`), and the whole-tensor host reference."""

    def __init__(self, tmp_path: Path, chunk: int, grad_home: str,
                 p16: torch.dtype | None) -> None:
        self.chunk, self.p16 = chunk, p16
        self.whole = [{c: f"{c}/{i}" for c in ("grad", "param")} for i in range(len(NUMELS))]
        self.chunks = [[(lo, hi, {c: f"{c}/{i}@{lo}" for c in STATE})
                        for lo, hi in pieces(n, chunk)] for i, n in enumerate(NUMELS)]
        low = torch.float32 if p16 is None else p16
        specs = [ShardSpec(self.whole[i][c], c, n, torch.float32 if c == "grad" else low)
                 for i, n in enumerate(NUMELS) if n for c in ("grad", "param")]  # type: ignore[arg-type]
        specs += [ShardSpec(k[c], c, hi - lo, torch.float32)  # type: ignore[arg-type]
                  for i, n in enumerate(NUMELS) if n for lo, hi, k in self.chunks[i]
                  for c in STATE]
        homes = {"master": "nvme", "exp_avg": "nvme", "exp_avg_sq": "nvme",
                 "grad": grad_home, "param": "nvme"}
        self.ref = HostShards(NUMELS, param_dtype=p16)
        self.swap = SwapStore(tmp_path, block_size=1 << 16)
        self.mgr = TierManager(specs, cpu_settings(homes, device=1 << 20, host=16 << 20),
                               swap=self.swap)
        self.gen = torch.Generator().manual_seed(0)
        for i, n in enumerate(NUMELS):
            if not n:
                continue
            ref = self.ref.tensors[i]
            ref["master"].copy_(torch.randn(n, generator=self.gen))
            for c in ("grad", "param"):
                dtype = torch.float32 if c == "grad" else low
                self.mgr.place(self.whole[i][c], ref["master"].to(dtype)).wait()
            for lo, hi, k in self.chunks[i]:
                for c in STATE:
                    self.mgr.place(k[c], ref[c][lo:hi]).wait()

    def stream(self, ring: int) -> AdamStream:
        return AdamStream(self.mgr, self.whole, NUMELS, order=ORDER, buffer_bytes=ring,
                          shadow=self.p16, chunks=self.chunks, consume_grads=True)

    def new_grads(self) -> None:
        for i, n in enumerate(NUMELS):
            if n:
                g = torch.randn(n, generator=self.gen)
                self.ref.tensors[i]["grad"].copy_(g)
                key = self.whole[i]["grad"]
                self.mgr.fetch(key, "host", writable=True, discard=True).wait().copy_(g)
                self.mgr.release(key, "host")

    def read(self, key: str) -> torch.Tensor:
        t = self.mgr.fetch(key, "host").wait().clone()
        self.mgr.release(key, "host")
        return t

    def assert_equal(self) -> None:
        for i, n in enumerate(NUMELS):
            if not n:
                continue
            ref = self.ref.tensors[i]
            for lo, hi, k in self.chunks[i]:
                for c in STATE:
                    assert torch.equal(self.read(k[c]), ref[c][lo:hi]), (i, c, lo)
            want = ref["master"] if self.p16 is None else ref["param"]
            assert torch.equal(self.read(self.whole[i]["param"]), want), (i, "param")

    def nvme(self) -> tuple[int, int]:
        moved = self.mgr.memory_report().moved
        return moved["nvme_to_host"], moved["host_to_nvme"]

    def close(self) -> None:
        self.mgr.close()
        self.swap.close()


@pytest.mark.parametrize(("chunk", "grad_home", "p16"), [
    (1 << 20, "cpu", torch.bfloat16),  # every shard one piece: the unchunked stream
    (1000, "cpu", torch.bfloat16),  # a piece exactly a shard, and pieces of 4097 / 7000
    (333, "nvme", torch.bfloat16),  # many pieces, a short last one; gradient on NVMe
    (4096, "nvme", None),  # fp32 compute: param assembled from the master pieces
    (97, "cpu", None),  # fp32 with a gradient in host memory; pieces smaller than a page
])
def test_chunked_stream_matches_the_unchunked_step(tmp_path: Path, chunk: int, grad_home: str,
                                                   p16: torch.dtype | None) -> None:
    rig = ChunkRig(tmp_path, chunk, grad_home, p16)
    stream = rig.stream(0)
    try:
        low = 4 if p16 is None else 2
        counts = []
        for step in range(1, 4):
            rig.new_grads()
            rig.ref.step(hyper=HYPER, step=step, grad_scale=0.5)
            stream.step(HYPER, step, grad_scale=0.5)
            stream.wait_idle()
            counts.append(rig.nvme())
        # state read once and written once per step, param written once; a gradient on
        # NVMe is never written (filled in host memory, consumed, dropped) nor read
        state = 3 * 4 * sum(NUMELS)
        for (r0, w0), (r1, w1) in itertools.pairwise(counts):
            assert (r1 - r0, w1 - w0) == (state, state + low * sum(NUMELS))
        stream.flush()
        rig.mgr.synchronize()
        rig.mgr.audit()
        rig.assert_equal()
    finally:
        stream.close()
        rig.close()


def test_ring_is_sized_by_the_piece(tmp_path: Path) -> None:
    """With pieces of 512 elements the ring holds the largest piece's buffers, whatever the
    largest shard (7000 elements): 4 pages (the 33-element shard, one piece, with its
    param page), not 3 x 28 kB + its param; param of a shard in pieces is assembled in
    room for two of the largest such shard."""
    rig = ChunkRig(tmp_path, 512, "cpu", torch.bfloat16)
    try:
        stream = rig.stream(0)
        assert stream.buffer_bytes == 4 * page_up(1) + 2 * page_up(7000 * 2)
        stream.close()
        (tmp_path / "whole").mkdir()
        unchunked = ChunkRig(tmp_path / "whole", 1 << 20, "cpu", torch.bfloat16)
        try:
            whole = unchunked.stream(0)
            assert whole.buffer_bytes == 3 * page_up(7000 * 4) + page_up(7000 * 2)
            whole.close()
        finally:
            unchunked.close()
        report = rig.mgr.memory_report()
        assert report.outside_peak >= stream.buffer_bytes  # counted by the tier manager
    finally:
        rig.close()


def test_chunks_must_tile_the_shard(tmp_path: Path) -> None:
    rig = ChunkRig(tmp_path, 1000, "cpu", torch.bfloat16)
    try:
        bad = [list(c) for c in rig.chunks]
        bad[2] = [bad[2][0], bad[2][2]]  # a gap: [0, 1000) then [2000, 3000)
        with pytest.raises(ValueError, match="must tile"):
            AdamStream(rig.mgr, rig.whole, NUMELS, buffer_bytes=0, shadow=torch.bfloat16,
                       chunks=bad)
    finally:
        rig.close()
