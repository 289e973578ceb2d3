"""[Note: shard inputs read ahead] (offload/shard_inputs.py): once every gradient of the
step is final, the streamed CPU Adam fetches the next shard's gradient and reads its bf16
master (the param, whole, for a shard in pieces) while the current shard updates; a step
begun during backward does not. The deferred update's pattern (every param write
announced, the stream reading its own params as their writer, each param kept in host
memory for the gather after it) gives the same bits as the update over host tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiers_util import cpu_settings

from tierzero.offload import AdamHyper, AdamStream, ShardSpec, TierManager
from tierzero.offload import state_codec as sc
from tierzero.offload.adam_kernel import adam_update
from tierzero.offload.bf16_master import master_key, shard_salt
from tierzero.swap import SwapStore

NUMELS = (3000, 2500, 0, 1800, 4100)
ORDER = [3, 0, 4, 2, 1]
CHUNK = 1024  # every shard in pieces: its param read whole
HYPER = AdamHyper(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)
STATE = "int8"


class Rig:
    """Param, gradient and int8 moments of NUMELS on NVMe; the host reference beside."""

    def __init__(self, tmp_path: Path) -> None:
        self.salts = [shard_salt(f"s{i}") for i in range(len(NUMELS))]
        self.keys = [{c: f"{c}/{i}" for c in ("grad", "param")} for i in range(len(NUMELS))]
        self.cuts = [[(lo, min(n, lo + CHUNK)) for lo in range(0, n, CHUNK)] or [(0, 0)]
                     for n in NUMELS]
        self.chunks = [[(lo, hi, {c: f"{c}/{i}@{lo}" for c in ("exp_avg", "exp_avg_sq")})
                        for lo, hi in cs] for i, cs in enumerate(self.cuts)]
        specs = [ShardSpec(self.keys[i][c], c, n, torch.bfloat16)  # type: ignore[arg-type]
                 for i, n in enumerate(NUMELS) if n for c in ("grad", "param")]
        specs += [ShardSpec(k[c], c, sc.moment_nbytes(hi - lo, STATE),  # type: ignore[arg-type]
                            torch.uint8)
                  for i, n in enumerate(NUMELS) if n for lo, hi, k in self.chunks[i]
                  for c in ("exp_avg", "exp_avg_sq")]
        homes = dict.fromkeys(("master", "exp_avg", "exp_avg_sq", "grad", "param"), "nvme")
        self.swap = SwapStore(tmp_path, block_size=1 << 16)
        self.mgr = TierManager(specs, cpu_settings(homes, device=1 << 20, host=16 << 20,
                                                   timeout=5.0), swap=self.swap)
        self.gen = torch.Generator().manual_seed(0)
        self.ref = [{"param": torch.randn(n, generator=self.gen).bfloat16(),
                     **{f"{c}@{lo}": torch.zeros(sc.moment_nbytes(hi - lo, STATE),
                                                 dtype=torch.uint8)
                        for lo, hi in cs for c in ("exp_avg", "exp_avg_sq")}}
                    for n, cs in zip(NUMELS, self.cuts, strict=True)]
        for i, n in enumerate(NUMELS):
            if n:
                self.mgr.place(self.keys[i]["param"], self.ref[i]["param"]).wait()
                self.mgr.place(self.keys[i]["grad"], torch.zeros(n, dtype=torch.bfloat16)).wait()
                for lo, _, k in self.chunks[i]:
                    for c in ("exp_avg", "exp_avg_sq"):
                        self.mgr.place(k[c], self.ref[i][f"{c}@{lo}"]).wait()

    def stream(self) -> AdamStream:
        return AdamStream(self.mgr, self.keys, NUMELS, order=ORDER, buffer_bytes=0,
                          shadow=None, chunks=self.chunks, state=STATE, master="bf16",
                          salts=self.salts, consume_grads=True)

    def new_grads(self, step: int) -> None:
        """Fresh gradients in the manager, and the reference's update with them."""
        for i, n in enumerate(NUMELS):
            if not n:
                continue
            g = torch.randn(n, generator=self.gen).bfloat16()
            self.mgr.fetch(self.keys[i]["grad"], "host", writable=True, discard=True
                           ).wait().copy_(g)
            self.mgr.release(self.keys[i]["grad"], "host")
            for lo, hi in self.cuts[i]:
                adam_update(self.ref[i]["param"][lo:hi], self.ref[i][f"exp_avg@{lo}"],
                            self.ref[i][f"exp_avg_sq@{lo}"], g[lo:hi], hyper=HYPER,
                            step=step, grad_scale=0.5, state=STATE, offset=lo,
                            master_key=master_key(step, self.salts[i]))

    def assert_params_equal(self) -> None:
        for i, n in enumerate(NUMELS):
            if n:
                got = self.mgr.fetch(self.keys[i]["param"], "host").wait().clone()
                self.mgr.release(self.keys[i]["param"], "host")
                assert torch.equal(got, self.ref[i]["param"]), i

    def close(self) -> None:
        self.mgr.close()
        self.swap.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.close()


def _logged(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """("read", shard) for each whole-param read, ("write", shard) for each param write."""
    log: list[tuple[str, int]] = []
    shard = {rig.keys[i]["param"]: i for i in range(len(NUMELS))}
    read_into, write_from = rig.mgr.read_into, rig.mgr.write_from

    def reading(key: str, out: torch.Tensor, **kw: bool) -> object:
        if key in shard:
            log.append(("read", shard[key]))
        return read_into(key, out, **kw)

    def writing(key: str, src: torch.Tensor, **kw: bool) -> object:
        if key in shard:
            log.append(("write", shard[key]))
        return write_from(key, src, **kw)

    monkeypatch.setattr(rig.mgr, "read_into", reading)
    monkeypatch.setattr(rig.mgr, "write_from", writing)
    return log


def test_the_next_shards_param_is_read_while_this_one_updates(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole step (every gradient final): shard k+1's param is read before shard k's new
    param is written, in the step's order; the bits are the reference's."""
    log = _logged(rig, monkeypatch)
    stream = rig.stream()
    try:
        rig.new_grads(1)
        stream.step(HYPER, 1, grad_scale=0.5)
        stream.flush()
        rig.mgr.synchronize()
        rig.mgr.audit()  # nothing held: the last read-ahead was used
    finally:
        stream.close()
    rig.assert_params_equal()
    order = [i for i in ORDER if NUMELS[i]]
    assert [i for op, i in log if op == "read"] == order
    for k, nxt in itertools.pairwise(order):
        assert log.index(("read", nxt)) < log.index(("write", k)), (k, nxt, log)


def test_a_step_begun_during_backward_reads_each_shard_in_its_turn(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """mark_final while backward runs: a later shard's gradient may still change, so
    nothing of it is read before its turn (its param is read after the shard before it
    is written)."""
    log = _logged(rig, monkeypatch)
    stream = rig.stream()
    order = [i for i in ORDER if NUMELS[i]]
    try:
        rig.new_grads(1)
        stream.begin(HYPER, 1, grad_scale=0.5)
        for i in ORDER:
            stream.mark_final([i])
        stream.finish()
        stream.flush()
    finally:
        stream.close()
    rig.assert_params_equal()
    for k, nxt in itertools.pairwise(order):
        assert log.index(("write", k)) < log.index(("read", nxt)), (k, nxt, log)


def test_announced_params_are_read_by_their_writer_and_kept_for_the_gather(rig: Rig) -> None:
    """The deferred update's pattern ([Note: deferred streamed step]): every param write
    announced (prefetch and other readers wait), the update paced one shard at a time with
    every gradient final, each announcement withdrawn once its shard's write is issued.
    The stream reads the params as their writer (no wait on its own announcement), the
    results are the reference's, and each new param is kept in host memory: reading it
    back touches no swap file."""
    stream = rig.stream()
    stream.keep_params(frozenset(range(len(NUMELS))))
    params = [rig.keys[i]["param"] for i in range(len(NUMELS)) if NUMELS[i]]
    try:
        for step in (1, 2):
            rig.new_grads(step)
            rig.mgr.expect_writes(params)
            stream.begin(HYPER, step, grad_scale=0.5, grads_final=True)
            for i in ORDER:
                stream.mark_final([i])
                if NUMELS[i]:
                    rig.mgr.expect_writes([rig.keys[i]["param"]], False)
            stream.finish()
            stream.wait_idle()
            before = rig.mgr.memory_report().moved["nvme_to_host"]
            rig.assert_params_equal()
            assert rig.mgr.memory_report().moved["nvme_to_host"] == before
        stream.flush()
    finally:
        stream.close()
    rig.mgr.synchronize()
    rig.mgr.audit()
