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
from engine_dist import run_two_ranks
from engine_helpers import (
    RefResult,
    assert_match,
    engine_train,
    full_params,
    make_batches,
    make_config,
    make_model,
    reference_train,
    stream_of,
)
from tiers_util import DelayIO

from tierzero import engine, swap
from tierzero.engine.checkpoint.layout import CheckpointError
from tierzero.engine.config import Config
from tierzero.engine.config.schema import (
    BudgetsConfig,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.step.offloaded import OffloadedStep


def nvme_config(params: str, path: Path, precision: str = "bf16") -> Config:
    return dataclasses.replace(make_config(precision=precision), offload=OffloadConfig(
        params=ParamOffloadConfig(device=params,  # type: ignore[arg-type]
                                  path=str(path) if params == "nvme" else None),
        optimizer=OptimizerOffloadConfig(device="nvme", path=str(path)),
        budgets=BudgetsConfig(device_bytes=64 << 20)))


def nvme_moved(eng: ZeroEngine) -> tuple[int, int]:
    """(read, written) NVMe bytes so far, once the optimizer's transfers have landed."""
    opt = eng.step_driver
    assert isinstance(opt, OffloadedStep) and stream_of(opt) is not None
    stream_of(opt).wait_idle()  # the next step's read-ahead included: counts are exact
    tiers = eng.memory_report()["tiers"]
    assert isinstance(tiers, dict)
    moved = tiers["moved"]
    return moved["nvme_to_host"], moved["host_to_nvme"]


@pytest.mark.parametrize(("params", "precision"),
                         [("none", "bf16"), ("nvme", "bf16"), ("nvme", "fp32")])
def test_state_crosses_nvme_once_per_step(params: str, precision: str,
                                          tmp_path: Path) -> None:
    """Each step reads master + moments once and writes them once (+ the new param when
    it is homed on NVMe); param is read by the gathers at most twice (forward, backward),
    and at least once except the param the stream kept in host memory ([Note: param
    kept in host memory]). The staged pipeline this replaced read the state about twice
    per step."""
    # eight blocks: more params than the pool keeps after the step, so gathers read some
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(n_blocks=8),
                                     config=nvme_config(params, tmp_path, precision))
    try:
        shards = eng.store.nbytes()
        state = shards["master"] + shards["exp_avg"] + shards["exp_avg_sq"]
        p16 = shards["param"] if params == "nvme" else 0
        opt = eng.step_driver
        assert isinstance(opt, OffloadedStep) and stream_of(opt) is not None
        kept = sum(eng.store.numel(opt.optimizer.keys[i]) * eng.store.param_dtype(
            opt.optimizer.keys[i]).itemsize for i in stream_of(opt).kept)
        assert kept < p16 or params == "none"
        counts = []
        for ids, tg in make_batches(4):
            eng.backward(eng(ids, tg))
            eng.step()
            counts.append(nvme_moved(eng))
        for (r0, w0), (r1, w1) in itertools.pairwise(counts[1:]):
            assert w1 - w0 == state + p16
            assert state + p16 - kept <= r1 - r0 <= state + 2 * p16, (r1 - r0, state, p16)
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
            opt = eng.step_driver
            assert isinstance(opt, OffloadedStep) and stream_of(opt) is not None
            for ids, tg in batches:
                loss = eng(ids, tg)
                eng.backward(loss)
                eng.step()
                deferred += stream_of(opt).writes_in_flight
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


def overlap_config(path: Path, *, gas: int, overlap: bool) -> Config:
    """fp32, no clipping: the step may start during backward (overlap_step)."""
    base = make_config(gas=gas)
    opt = OptimizerOffloadConfig(device="nvme", path=str(path), overlap_step=overlap)
    return dataclasses.replace(base, offload=OffloadConfig(
        params=ParamOffloadConfig(device="nvme", path=str(path)), optimizer=opt,
        budgets=BudgetsConfig(device_bytes=64 << 20)))


@pytest.mark.parametrize("gas", [1, 4])
def test_step_during_backward_is_bit_identical_and_matches_pytorch(gas: int,
                                                                   tmp_path: Path) -> None:
    """Updating each unit as its gradient turns final changes when the kernel runs, not
    what it computes: bit-identical to the step after backward, and within the parity
    tolerance of plain PyTorch (engine_helpers.PARAM_ATOL, LOSS_RTOL)."""
    steps = 6
    batches = make_batches(steps * gas)
    ref = reference_train(make_model(), make_config(gas=gas), [batches], steps)
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    on = engine_train(overlap_config(tmp_path / "on", gas=gas, overlap=True), batches, steps)
    off = engine_train(overlap_config(tmp_path / "off", gas=gas, overlap=False), batches, steps)
    assert on.losses == off.losses
    for k, v in off.params.items():
        assert torch.equal(on.params[k], v), k
    assert_match(on.losses, on.params, ref.losses, ref.params)


def test_units_are_updated_inside_backward(tmp_path: Path) -> None:
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                       config=overlap_config(tmp_path, gas=1, overlap=True))
    opt = eng.step_driver
    try:
        assert isinstance(opt, OffloadedStep) and stream_of(opt) is not None
        seen: list[int] = []
        real = opt.groups_final

        def spy(keys: list[str]) -> None:
            real(keys)
            op = stream_of(opt)._open if stream_of(opt) is not None else None
            seen.append(op.pos if op is not None else -1)

        opt.groups_final = spy  # type: ignore[method-assign]
        ids, tg = make_batches(1)[0]
        eng.backward(eng(ids, tg))
        # every group was updated before backward returned, one unit after another
        assert opt.step_open and seen == sorted(seen) and seen[0] >= 1
        assert seen[-1] == len(eng._train_keys)
        eng.step()
        assert not opt.step_open and eng.global_steps == 1
    finally:
        eng.close()


@pytest.mark.parametrize("home", ["nvme", "cpu"])
def test_backward_failing_mid_step_skips_the_step_and_keeps_units_whole(
        home: str, tmp_path: Path) -> None:
    """A backward that raises after some units were updated: those keep their update (each
    whole: master, moments and param together), the others are untouched, the step of
    that boundary is skipped (never applied twice), no checkpoint saves that partial step,
    and training goes on. Optimizer state
    on NVMe (the stream) and in host memory (the in-place step on its worker thread)."""
    model = make_model()
    config = overlap_config(tmp_path, gas=1, overlap=True)
    if home == "cpu":
        config = dataclasses.replace(config, offload=OffloadConfig(
            params=ParamOffloadConfig(device="cpu"),
            optimizer=OptimizerOffloadConfig(device="cpu", overlap_step=True)))
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=config)
    opt = eng.step_driver
    try:
        before = full_params(eng, model)
        fail = {"on": True}

        def boom(*_: object) -> None:
            if fail["on"]:
                raise RuntimeError("injected backward failure")

        handle = model.blocks[0].register_full_backward_hook(boom)  # last block of backward
        ids, tg = make_batches(1)[0]
        with pytest.raises(RuntimeError, match="injected backward failure"):
            eng.backward(eng(ids, tg))
        assert isinstance(opt, OffloadedStep) and not opt.step_open
        eng.step()  # skipped: some units already took this step's update
        assert eng.skipped_steps == 1 and not opt.step_open
        # a partial step ([Note: a partial step]): no checkpoint of it until a load
        assert opt.partial_step is not None and "backward failed" in opt.partial_step
        with pytest.raises(CheckpointError, match="save_checkpoint refused: backward failed "
                           "after the optimizer step begun in it"):
            eng.save_checkpoint(tmp_path / "ck")
        after = full_params(eng, model)
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        # the blocks finished backward before the failure (the hook runs once block 0's
        # gradients exist); the root (embedding, norm, head) is reduced only at the end
        assert changed and all(k.startswith("blocks.") for k in changed), changed
        assert all(torch.equal(before[k], after[k]) for k in before
                   if not k.startswith("blocks.")), "the root was updated"
        store = eng.store
        assert store.manager is not None
        store.manager.synchronize()
        store.manager.audit()
        handle.remove()
        fail["on"] = False
        for ids, tg in make_batches(2):
            eng.backward(eng(ids, tg))
            eng.step()
        assert eng.global_steps == 2
    finally:
        eng.close()


def _overlap_rank(rank: int, *, root: str) -> RefResult:
    path = Path(root) / f"swap{rank}"
    path.mkdir(exist_ok=True)
    return engine_train(overlap_config(path, gas=2, overlap=True),
                        make_batches(6 * 2, seed=1 + rank), 6, world_mean=True)


@pytest.mark.multiproc
def test_step_during_backward_on_two_ranks_matches_ddp_reference(tmp_path: Path) -> None:
    """Two gloo ranks: each unit's reduce-scatter is waited for before its update starts;
    the ranks agree bitwise and match the DDP-equivalent reference (parity tolerances)."""
    results = run_two_ranks(tmp_path, {"o": functools.partial(_overlap_rank,
                                                              root=str(tmp_path))})
    r0, r1 = results[0]["o"], results[1]["o"]
    assert r0.losses == r1.losses
    for k in r0.params:
        assert torch.equal(r0.params[k], r1.params[k]), k
    per_rank = [make_batches(6 * 2, seed=1 + r) for r in range(2)]
    ref = reference_train(make_model(), make_config(gas=2), per_rank, 6)
    assert_match(r0.losses, r0.params, ref.losses, ref.params)
