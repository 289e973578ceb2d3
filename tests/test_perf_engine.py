"""The engine's optimizer step over NVMe ([Note: streamed optimizer step]): bytes moved per
step, counted by the tier manager (not timed), and the deferred write-back seen by the
next step's gathers.

Exactness: a run whose NVMe writes are slowed (so they are still in flight when the next
forward gathers) must give bit-identical losses and parameters to an undelayed run: the
same kernel on the same values, only the timing differs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path

import pytest
import torch
from engine_helpers import full_params, make_batches, make_config, make_model
from tiers_util import DelayIO

import engine
import swap
from engine.config import Config
from engine.config.schema import (
    BudgetsConfig,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)
from engine.engine import ZeroEngine
from engine.offload_step import OffloadedAdam


def nvme_config(params: str, path: Path, precision: str = "bf16") -> Config:
    return dataclasses.replace(make_config(precision=precision), offload=OffloadConfig(
        params=ParamOffloadConfig(device=params,  # type: ignore[arg-type]
                                  path=str(path) if params == "nvme" else None),
        optimizer=OptimizerOffloadConfig(device="nvme", path=str(path)),
        budgets=BudgetsConfig(device_bytes=64 << 20)))


def nvme_moved(eng: ZeroEngine) -> tuple[int, int]:
    """(read, written) NVMe bytes so far, once the optimizer's transfers have landed."""
    opt = eng.optimizer
    assert isinstance(opt, OffloadedAdam) and opt._stream is not None
    opt._stream.wait_idle()  # the next step's read-ahead included: counts are exact
    tiers = eng.memory_report()["tiers"]
    assert isinstance(tiers, dict)
    moved = tiers["moved"]
    return moved["nvme_to_host"], moved["host_to_nvme"]


@pytest.mark.parametrize(("params", "precision"),
                         [("none", "bf16"), ("nvme", "bf16"), ("nvme", "fp32")])
def test_state_crosses_nvme_once_per_step(params: str, precision: str,
                                          tmp_path: Path) -> None:
    """Each step reads master + moments once and writes them once (+ the new param16 when
    it is homed on NVMe); param16 is read by the gathers at most twice (forward, backward).
    The staged pipeline this replaced read the state about twice per step."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=nvme_config(params, tmp_path, precision))
    try:
        shards = eng.store.nbytes()
        state = shards["master"] + shards["exp_avg"] + shards["exp_avg_sq"]
        p16 = shards["param16"] if params == "nvme" else 0
        counts = []
        for ids, tg in make_batches(4):
            eng.backward(eng(ids, tg))
            eng.step()
            counts.append(nvme_moved(eng))
        for (r0, w0), (r1, w1) in itertools.pairwise(counts[1:]):
            assert w1 - w0 == state + p16
            assert state + p16 <= r1 - r0 <= state + 2 * p16, (r1 - r0, state, p16)
            if params == "none":
                assert r1 - r0 == state
    finally:
        eng.close()


def test_deferred_write_back_is_seen_by_the_next_gather(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    batches = make_batches(4)

    def run(delay: float, where: Path) -> tuple[list[float], dict[str, torch.Tensor], int]:
        real = swap.SwapStore
        monkeypatch.setattr(swap, "SwapStore", functools.partial(
            real, fileio=DelayIO(write_delay=delay)))
        model = make_model()
        eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                         config=nvme_config("nvme", where))
        monkeypatch.setattr(swap, "SwapStore", real)
        losses, deferred = [], 0
        try:
            opt = eng.optimizer
            assert isinstance(opt, OffloadedAdam) and opt._stream is not None
            for ids, tg in batches:
                loss = eng(ids, tg)
                eng.backward(loss)
                eng.step()
                deferred += opt._stream.writes_in_flight
                losses.append(float(loss.detach()))
            return losses, full_params(eng, model), deferred
        finally:
            eng.close()

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    slow_losses, slow_params, deferred = run(0.005, tmp_path / "a")
    assert deferred > 0  # the writes really were still in flight after step()
    fast_losses, fast_params, _ = run(0.0, tmp_path / "b")
    assert slow_losses == fast_losses
    for k, v in fast_params.items():
        assert torch.equal(slow_params[k], v), k
