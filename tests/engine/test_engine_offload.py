"""Offload through the tier manager: parity with plain PyTorch AdamW for offload none / cpu /
nvme, world size 1 and 2, gradient accumulation 1 and 4, clipping on.

Tolerance: the same as the resident engine (engine_helpers.PARAM_ATOL = 1e-5 absolute on
parameters, LOSS_RTOL = 1e-6 relative on losses; reasons in test_engine_parity.py). The CPU
Adam kernel differs from torch's AdamW by about one ulp per update (sqrt/fma rounding, see
tests/offload/test_offload_adam_kernel.py), ~6e-8 relative on parameters of order 1, i.e. well
under 1e-6 absolute after 20 steps: measured here 2.4e-7 / 3.6e-7 (params) and 1.9e-7 /
3.0e-7 (losses) for gas 1 / 4, so the existing bounds hold with margin.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import pytest
import torch
from engine_dist import run_two_ranks
from engine_helpers import (
    DEVICE_BUDGET,
    RefResult,
    assert_match,
    engine_train,
    make_batches,
    make_config,
    make_model,
    offload_config,
    reference_train,
)

from tierzero import engine
from tierzero.engine.config.schema import (
    BudgetsConfig,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)
from tierzero.engine.step.offloaded_adam import OffloadedAdam

STEPS = 20
# Stand-in device tier budget: smaller than the model's param shards (~86 KB fp32),
# so device caches are evicted and re-fetched during a step.


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("gas", [1, 4])
def test_offload_world1_matches_pytorch(device: str, gas: int, tmp_path: Path) -> None:
    cfg = offload_config(make_config(gas=gas, clip=0.5), device, tmp_path)
    batches = make_batches(STEPS * gas)
    ref = reference_train(make_model(), cfg, [batches], STEPS)
    got = engine_train(cfg, batches, STEPS)
    assert_match(got.losses, got.params, ref.losses, ref.params)
    assert got.report is not None
    tiers = got.report["tiers"]
    assert isinstance(tiers, dict)
    step = got.report["optimizer_step"]
    assert isinstance(step, dict) and step["shards"] == 5  # the CPU Adam ran over 5 groups
    moved = tiers["moved"]
    if device == "nvme":
        # every step reads and writes the optimizer state through the swap file
        assert moved["nvme_to_host"] > 0 and moved["host_to_nvme"] > 0
        assert tiers["current"]["nvme"] > 0
    else:
        assert moved["nvme_to_host"] == 0 and tiers["current"]["host"] > 0
    # the device tier stayed within its budget although the params do not fit in it
    assert tiers["peak"]["device"] <= DEVICE_BUDGET


def test_offload_bf16_tracks_fp32(tmp_path: Path) -> None:
    """bf16 compute with the CPU Adam writing bf16 param in the same pass (shadow)."""
    batches = make_batches(STEPS)
    ref = reference_train(make_model(), make_config(clip=0.5), [batches], STEPS)
    cfg = offload_config(make_config(precision="bf16", clip=0.5), "nvme", tmp_path)
    got = engine_train(cfg, batches, STEPS)
    diff = (torch.tensor(got.losses) - torch.tensor(ref.losses)).abs().max()
    assert float(diff) < 0.03, (got.losses, ref.losses)  # as test_engine_parity's bound


def test_optimizer_offloaded_params_on_device(tmp_path: Path) -> None:
    """Mixed homes: param on the device, optimizer state on NVMe (and the reverse, params
    offloaded with a device Adam over pinned state)."""
    batches = make_batches(STEPS)
    base = make_config(clip=0.5)
    ref = reference_train(make_model(), base, [batches], STEPS)
    for params, opt in (("none", "nvme"), ("cpu", "none")):
        cfg = dataclasses.replace(base, offload=OffloadConfig(
            params=ParamOffloadConfig(device=params),  # type: ignore[arg-type]
            optimizer=OptimizerOffloadConfig(device=opt, path=str(tmp_path)),  # type: ignore[arg-type]
            budgets=BudgetsConfig(device_bytes=8 << 20)))
        got = engine_train(cfg, batches, STEPS)
        assert_match(got.losses, got.params, ref.losses, ref.params)


def test_offload_optimizer_is_torch_optimizer_with_schedulable_lr(tmp_path: Path) -> None:
    cfg = offload_config(make_config(), "cpu", tmp_path)
    eng, opt, _, sched = engine.initialize(device="cpu", model=make_model(), config=cfg)
    try:
        assert isinstance(opt, OffloadedAdam) and isinstance(opt, torch.optim.Optimizer)
        opt.param_groups[0]["lr"] = 0.0  # lr 0 and no weight decay effect: params unchanged
        before = {k: v.clone() for k, v in _gathered(eng).items()}
        ids, tg = make_batches(1)[0]
        eng.backward(eng(ids, tg))
        eng.step()
        after = _gathered(eng)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert sched is not None
    finally:
        eng.close()


def test_offload_rejects_foreign_optimizer(tmp_path: Path) -> None:
    cfg = offload_config(make_config(), "cpu", tmp_path)
    with pytest.raises(ValueError, match=r"optimizer=SGD .*offload.optimizer.device='cpu'"):
        engine.initialize(device="cpu", model=make_model(), config=cfg,
                          optimizer=torch.optim.SGD(make_model().parameters(), lr=0.1))


def _gathered(eng: engine.ZeroEngine) -> dict[str, torch.Tensor]:
    with engine.GatheredParameters(list(eng.module.parameters())):
        return {k: v.detach().clone() for k, v in eng.module.named_parameters()}


def _rank_run(rank: int, *, device: str, gas: int, root: str) -> RefResult:
    path = Path(root) / f"rank{rank}"
    path.mkdir(exist_ok=True)
    cfg = offload_config(make_config(gas=gas, clip=0.5), device, path)
    return engine_train(cfg, make_batches(STEPS * gas, seed=1 + rank), STEPS, world_mean=True)


@pytest.mark.multiproc
def test_offload_two_ranks_match_ddp_reference(tmp_path: Path) -> None:
    cases = [("cpu", 1), ("nvme", 4)]
    scenarios = {f"{d}-gas{g}": partial(_rank_run, device=d, gas=g, root=str(tmp_path))
                 for d, g in cases}
    results = run_two_ranks(tmp_path, scenarios)
    for d, g in cases:
        name = f"{d}-gas{g}"
        r0, r1 = results[0][name], results[1][name]
        assert r0.losses == r1.losses
        for k in r0.params:
            assert torch.equal(r0.params[k], r1.params[k]), (name, k)
        cfg = make_config(gas=g, clip=0.5)
        per_rank = [make_batches(STEPS * g, seed=1 + r) for r in range(2)]
        ref = reference_train(make_model(), cfg, per_rank, STEPS)
        assert_match(r0.losses, r0.params, ref.losses, ref.params)


def test_prefetch_follows_trace_and_reuse_distance_bounds_live(tmp_path: Path) -> None:
    """From the second step the tier manager gets the param order from the unit trace:
    every fetch follows it (no mismatch) and NVMe reads are issued ahead (a staging pool
    of two buffers cannot keep every param cached from the update that wrote it to its
    backward). Units reused soon stay gathered between forward and backward unless
    zero.max_live_bytes forbids it; the result is bitwise the same either way."""
    batches = make_batches(4)
    runs = {}
    for live in (2_000_000_000, 0):
        base = make_config(clip=0.5)
        cfg = offload_config(dataclasses.replace(
            base, zero=dataclasses.replace(base.zero, max_live_bytes=live)), "nvme", tmp_path)
        cfg = dataclasses.replace(cfg, offload=dataclasses.replace(
            cfg.offload, params=dataclasses.replace(cfg.offload.params, buffer_count=2)))
        model = make_model()
        eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
        for ids, tg in batches:
            eng.backward(eng(ids, tg))
            eng.step()
        rep = eng.memory_report()
        runs[live] = (rep, eng.scheduler.gathers, _gathered(eng))
        eng.close()
    (kept_rep, kept_gathers, kept_params), (rel_rep, rel_gathers, rel_params) = runs.values()
    for rep in (kept_rep, rel_rep):
        assert rep["tiers"]["order_mismatches"] == 0
        assert rep["tiers"]["prefetches"] > 0
    assert kept_rep["units_kept_for_backward"] > 0 and rel_rep["units_kept_for_backward"] == 0
    assert kept_gathers < rel_gathers
    assert all(torch.equal(kept_params[k], rel_params[k]) for k in kept_params)


def test_gather_time_counts_backward_regathers(tmp_path: Path) -> None:
    """scheduler.gather_s (the "wait" of `tierzero train`) counts every unit gather: with
    zero.max_live_bytes = 0 each unit is released after its forward and gathered again in
    backward, and that time is in it too, not only the forward's."""
    base = make_config(clip=0.5)
    cfg = offload_config(dataclasses.replace(
        base, zero=dataclasses.replace(base.zero, max_live_bytes=0)), "nvme", tmp_path)
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
    try:
        for ids, tg in make_batches(2):
            loss = eng(ids, tg)
            fwd_s, fwd_n = eng.scheduler.gather_s, eng.scheduler.gathers
            eng.backward(loss)
            assert eng.scheduler.gathers > fwd_n  # units gathered again for backward
            assert eng.scheduler.gather_s > fwd_s
            eng.step()
    finally:
        eng.close()


def test_step_during_backward_follows_the_recorded_order(tmp_path: Path) -> None:
    """With the optimizer step begun during backward (no clipping), the optimizer's reads
    of gradient shards the reduce just wrote are re-uses, not departures from the order:
    the tier manager sees no mismatch. Eight blocks: more params than the pool keeps
    cached after the step, so the next forward's gathers are read ahead."""
    cfg = offload_config(make_config(clip=0.0), "nvme", tmp_path)
    assert cfg.offload.optimizer.overlap_step
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(n_blocks=8), config=cfg)
    try:
        for ids, tg in make_batches(3):
            eng.backward(eng(ids, tg))
            eng.step()
        rep = eng.memory_report()
        assert rep["optimizer_step"] is not None and rep["tiers"]["prefetches"] > 0
        assert rep["tiers"]["order_mismatches"] == 0
    finally:
        eng.close()
