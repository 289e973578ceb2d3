"""Clipping and fp16 loss scaling with the optimizer overlapped ([Note: deferred step]).

With offload.optimizer.overlap_step on and optimizer state in host memory, a step that
needs every gradient first (the global norm, the overflow check) measures the gradients
on the worker during backward and runs the update on it during the next forward. The
results must be those of clipping (or checking for overflow) before the step: bit for
bit the overlap-off run's, and plain PyTorch's (clip_grad_norm_, AdamW) within the
parity tolerances. Overlap is shown by slowing the worker (an injected sleep), never by
timing. Whatever reads or writes shards between steps waits for the deferred update.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from cli_helpers import read_metrics, write_config
from engine_dist import run_two_ranks
from engine_helpers import (
    FP16_OVERFLOW_STEP,
    RefResult,
    assert_match,
    assert_overlap_matches_off_and_pytorch,
    engine_train,
    fp16_overlap_runs,
    full_params,
    in_place_of,
    make_batches,
    make_config,
    make_model,
    reference_train,
)

from tierzero import engine
from tierzero.engine.cli import main
from tierzero.engine.config import Config
from tierzero.engine.config.schema import (
    LossScaleConfig,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
    PrecisionConfig,
)
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.step.in_place import InPlaceStep, OverlapClock
from tierzero.engine.step.offloaded import OffloadedStep
from tierzero.engine.unit import Unit


def cpu_config(*, overlap: bool, clip: float = 0.0, gas: int = 1, precision: str = "fp32",
               params: str = "cpu") -> Config:
    """Params and optimizer state in host memory (the in-place CPU Adam)."""
    cfg = dataclasses.replace(
        make_config(precision=precision, gas=gas, clip=clip), offload=OffloadConfig(
            params=ParamOffloadConfig(device=params),  # type: ignore[arg-type]
            optimizer=OptimizerOffloadConfig(device="cpu", overlap_step=overlap)))
    if precision == "fp16":  # dynamic scaling from 2**8, growth every 2 good steps
        ls = LossScaleConfig(initial_scale_power=8, growth_interval=2, hysteresis=1)
        cfg = dataclasses.replace(cfg, precision=PrecisionConfig(dtype="fp16", loss_scale=ls))
    return cfg


def in_place(eng: ZeroEngine) -> InPlaceStep:
    opt = eng.step_driver
    assert isinstance(opt, OffloadedStep) and in_place_of(opt) is not None
    return in_place_of(opt)


@pytest.fixture
def slow_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[ZeroEngine]:
    """An engine with clipping 1.0 and overlap on whose worker takes 100 ms more per
    group update: a deferred update is still running when step() returns."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=cpu_config(overlap=True, clip=1.0))
    step = in_place(eng)
    real = step.update

    def slow(key: str, *args: object) -> float:
        time.sleep(0.1)
        return real(key, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(step, "update", slow)
    try:
        yield eng
    finally:
        eng.close()


def _one_step(eng: ZeroEngine, seed: int = 1) -> None:
    ids, tg = make_batches(1, seed=seed)[0]
    eng.backward(eng(ids, tg))
    eng.step()


def _reference_after(steps: int) -> dict[str, torch.Tensor]:
    """The parameters after `steps` steps with the update run before step() returns."""
    return engine_train(cpu_config(overlap=False, clip=1.0), make_batches(steps, seed=1),
                        steps).params


@pytest.mark.parametrize(("clip", "gas", "params"),
                         [(1.0, 1, "cpu"), (0.5, 2, "cpu"), (1.0, 1, "none")])
def test_clipped_step_overlapped_is_bit_identical_and_matches_pytorch(
        clip: float, gas: int, params: str) -> None:
    assert_overlap_matches_off_and_pytorch(
        lambda overlap: cpu_config(overlap=overlap, clip=clip, gas=gas, params=params),
        steps=4, gas=gas, clip=clip)


def test_clipping_is_active_and_measured_during_backward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The norm exceeds the limit (so the factor is applied), and every group's norm was
    measured on the worker while backward ran, none again in step()."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=cpu_config(overlap=True, clip=1e-3))
    try:
        measured: list[str] = []
        real = in_place(eng).measure

        def spy(keys: list[str]) -> None:
            measured.extend(keys)
            real(keys)

        monkeypatch.setattr(in_place(eng), "measure", spy)
        _one_step(eng)
        assert eng.last_grad_norm is not None and eng.last_grad_norm > 1e-3
        assert sorted(measured) == sorted(eng._train_keys)
        busy, hidden = in_place(eng).clock.totals()
        assert busy > 0.0 and 0.0 <= hidden <= busy
    finally:
        eng.close()


def test_update_runs_during_the_next_forward_each_unit_before_its_gather(
        slow_engine: ZeroEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = slow_engine
    step = in_place(eng)
    _one_step(eng)
    assert step.deferred  # step() returned with the update still queued on the worker
    jobs = dict(step._deferred)  # group -> its queued update
    last = list(jobs)[-1]  # the group the next forward gathers last
    seen: list[tuple[str, bool]] = []  # (unit, all its groups updated) right after its gather
    last_pending: list[bool] = []  # at each gather: the last group's update not done yet
    threads: set[str] = set()
    real_update = step.update

    def spy_update(key: str, *args: object) -> float:
        threads.add(threading.current_thread().name)
        return real_update(key, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(step, "update", spy_update)
    real_gather = eng.scheduler.ensure_gathered

    def spy_gather(unit: Unit) -> None:
        real_gather(unit)
        keys = [g.key for g in unit.groups if g.trainable]
        seen.append((unit.label, all(jobs[k].done() for k in keys)))
        last_pending.append(not jobs[last].done())

    monkeypatch.setattr(eng.scheduler, "ensure_gathered", spy_gather)
    ids, tg = make_batches(1, seed=2)[0]
    loss = eng(ids, tg)
    assert len(seen) == len(eng.units) and all(done for _, done in seen), seen
    assert last_pending[0]  # forward began (root gathered) with later updates queued
    eng.backward(loss)
    eng.step()
    monkeypatch.setattr(eng.scheduler, "ensure_gathered", real_gather)
    # on the worker, or taken over by the training thread waiting for it (wait_groups)
    assert any(t.startswith("tierzero-adam-early") for t in threads)
    assert threads <= {threading.main_thread().name} | {
        t for t in threads if t.startswith("tierzero-adam-early")}
    got = full_params(eng, eng.module)
    want = engine_train(cpu_config(overlap=False, clip=1.0),
                        [make_batches(1, seed=1)[0], make_batches(1, seed=2)[0]], 2).params
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_groups_the_worker_has_not_started_are_taken_over_bit_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait for groups still queued behind the worker's current one runs them on the
    waiting thread (each group whole, the same kernel): the same bits as overlap off."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=cpu_config(overlap=True, clip=1.0))
    try:
        step = in_place(eng)
        release = threading.Event()
        ran: dict[str, str] = {}
        real = step.update

        def gated(key: str, *args: object) -> float:
            ran[key] = threading.current_thread().name
            if threading.current_thread() is not threading.main_thread():
                assert release.wait(30)  # the worker holds its first group until released
            return real(key, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(step, "update", gated)
        _one_step(eng)
        first, *rest = list(step._deferred)  # the worker took `first` and blocks in it
        while first not in ran:
            time.sleep(0.001)
        assert step.wait_groups(rest) is None  # `first` still pending
        assert all(ran[k] == threading.main_thread().name for k in rest)
        release.set()
        step.drain()
        assert ran[first].startswith("tierzero-adam-early")
        got = full_params(eng, eng.module)
    finally:
        release.set()
        eng.close()
    for k, v in _reference_after(1).items():
        assert torch.equal(got[k], v), k


def test_checkpoint_save_waits_for_the_deferred_update(slow_engine: ZeroEngine,
                                                        tmp_path: Path) -> None:
    eng = slow_engine
    _one_step(eng)
    assert in_place(eng).deferred
    eng.save_checkpoint(tmp_path, tag="t")
    assert not in_place(eng).deferred
    saved = engine.consolidate(tmp_path, "t")
    want = _reference_after(1)
    for k, v in want.items():
        assert torch.equal(saved[k].float(), v), k


def test_load_checkpoint_and_gathered_parameters_wait(slow_engine: ZeroEngine,
                                                      tmp_path: Path) -> None:
    eng = slow_engine
    _one_step(eng)
    eng.save_checkpoint(tmp_path, tag="t")
    _one_step(eng, seed=2)
    assert in_place(eng).deferred
    # reading a unit between steps waits for its own groups
    block = eng.units[0]
    with engine.GatheredParameters(list(block.module.parameters())):
        assert not any(g.key in in_place(eng)._deferred for g in block.groups)
    _one_step(eng, seed=3)
    assert in_place(eng).deferred
    eng.load_checkpoint(tmp_path, tag="t")  # the pending update ran first, then the load
    assert not in_place(eng).deferred
    got = full_params(eng, eng.module)
    for k, v in _reference_after(1).items():
        assert torch.equal(got[k], v), k


def test_state_dict_and_close_wait(slow_engine: ZeroEngine) -> None:
    eng = slow_engine
    _one_step(eng)
    assert in_place(eng).deferred
    with engine.GatheredParameters(list(eng.module.parameters())):
        # every unit waited for its update before its gather; copies: the views die on exit
        sd = {k: v.detach().clone() for k, v in eng.module.state_dict().items()}
    assert not in_place(eng).deferred
    want1 = _reference_after(1)
    for k, v in want1.items():
        assert torch.equal(sd[k].float(), v), k
    _one_step(eng, seed=2)
    assert in_place(eng).deferred
    eng.close()  # the update runs to the end; parameters are whole again
    want = engine_train(cpu_config(overlap=False, clip=1.0),
                        [make_batches(1, seed=1)[0], make_batches(1, seed=2)[0]], 2).params
    for k, p in eng.module.named_parameters():
        assert torch.equal(p.detach().float(), want[k]), k


def test_worker_failure_is_raised_by_the_next_forward_naming_the_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=cpu_config(overlap=True, clip=1.0))
    try:
        step = in_place(eng)
        real = step.update
        bad = eng._train_keys[1]

        def fail(key: str, *args: object) -> float:
            if key == bad:
                raise OSError("injected kernel failure")
            return real(key, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(step, "update", fail)
        _one_step(eng)
        ids, tg = make_batches(1)[0]
        with pytest.raises(RuntimeError, match=f"shard group '{bad}'.*injected kernel"):
            eng(ids, tg)
        monkeypatch.setattr(step, "update", real)
        for seed in (2, 3):  # training goes on
            _one_step(eng, seed)
    finally:
        eng.close()


def grad_scaler_train(batches: list[tuple[torch.Tensor, torch.Tensor]], blow_up: int | None,
                      clip: float) -> tuple[dict[str, torch.Tensor], list[float], int]:
    """Plain PyTorch with torch.amp.GradScaler's dynamic loss scaling (the scaler of
    cpu_config's fp16: 2**8, x2 after 2 clean steps, /2 on an overflow), fp32 model,
    unscale_, clip_grad_norm_, AdamW; step `blow_up`'s loss is multiplied by inf (its
    gradients overflow, as the engine's fp16 ones do at x 1e9). Returns the parameters,
    the scale after each step and the number of skipped steps."""
    model = make_model()
    o = make_config().optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_factor=2.0,
                                  backoff_factor=0.5, growth_interval=2)
    scales, skipped = [], 0
    for i, (ids, tg) in enumerate(batches):
        loss = model(ids, tg) * (float("inf") if i == blow_up else 1.0)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = scaler.get_scale()
        scaler.step(opt)  # skipped when unscale_ found inf/NaN
        scaler.update()
        skipped += scaler.get_scale() < before
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}, scales, skipped


def assert_within_fp16_noise(got: dict[str, torch.Tensor],
                             want: dict[str, torch.Tensor]) -> None:
    """fp16 compute rounds the gradients, and Adam turns a rounded gradient near zero
    into a full lr-sized step of either sign, so single elements may differ by up to
    2 x lr: per tensor at most max(1, 2 %) of the elements differ by more than lr / 2
    (measured: at most 3 of 2048), and over the others the mean difference stays below
    2 % of the mean distance training moved the tensor (measured: under 1.1 %)."""
    lr = make_config().optimizer.lr
    start = dict(make_model().named_parameters())
    for k, w in want.items():
        moved = float((w - start[k].detach()).abs().mean())
        diff = (got[k] - w).abs()
        flipped = diff > lr / 2
        assert int(flipped.sum()) <= max(1, int(0.02 * diff.numel())), k
        assert float(diff[~flipped].mean()) < 0.02 * moved, k


def test_fp16_overlapped_is_bit_identical_with_skips_and_tracks_fp32() -> None:
    """fp16 dynamic loss scaling, overlap on and off: the same overflow skips (a step
    whose loss is blown up), the same loss scale, the same bits; the skips and the
    scale after every step are those of torch.amp.GradScaler on plain fp32 PyTorch with
    the same clipping, and the parameters within fp16 noise of it."""
    s_on, k_on, p_on = fp16_overlap_runs(
        lambda overlap: cpu_config(overlap=overlap, clip=1.0, precision="fp16"), 6)
    # The five good steps against plain fp32 PyTorch, and against GradScaler's run
    batches = [b for i, b in enumerate(make_batches(6)) if i != FP16_OVERFLOW_STEP]
    ref = reference_train(make_model(), make_config(clip=1.0), [batches], 5)
    assert_within_fp16_noise(p_on, ref.params)
    scaled, scaler_scales, scaler_skips = grad_scaler_train(make_batches(6), 2, 1.0)
    assert s_on == scaler_scales and k_on == scaler_skips == 1
    assert_within_fp16_noise(p_on, scaled)


def _ranks(rank: int) -> dict[str, RefResult]:
    out = {}
    batches = make_batches(3 * 2, seed=1 + rank)
    for overlap in (True, False):
        out[f"clip-{overlap}"] = engine_train(cpu_config(overlap=overlap, clip=1.0, gas=2),
                                              batches, 3, world_mean=True)
        out[f"fp16-{overlap}"] = engine_train(
            cpu_config(overlap=overlap, clip=1.0, precision="fp16"), batches, 3,
            world_mean=True)
    return out


@pytest.mark.multiproc
def test_two_ranks_bit_identical_to_overlap_off_and_match_ddp(tmp_path: Path) -> None:
    r0, r1 = (r["r"] for r in run_two_ranks(tmp_path, {"r": functools.partial(_ranks)}))
    for kind in ("clip", "fp16"):
        on, off = r0[f"{kind}-True"], r0[f"{kind}-False"]
        assert on.losses == off.losses == r1[f"{kind}-True"].losses, kind
        for k in off.params:
            assert torch.equal(on.params[k], off.params[k]), (kind, k)
            assert torch.equal(on.params[k], r1[f"{kind}-True"].params[k]), (kind, k)
    per_rank = [make_batches(3 * 2, seed=1 + r) for r in range(2)]
    ref = reference_train(make_model(), make_config(gas=2, clip=1.0), per_rank, 3)
    on = r0["clip-True"]
    assert_match(on.losses, on.params, ref.losses, ref.params)
    # fp16 (gas 1, clipping 1.0) against plain fp32 PyTorch over both ranks' batches
    ref16 = reference_train(make_model(), make_config(clip=1.0), per_rank, 3)
    assert_within_fp16_noise(r0["fp16-True"].params, ref16.params)


def test_overlap_clock_splits_worker_time_at_the_waits() -> None:
    """Worker seconds inside a wait of the training thread are exposed, the rest hidden:
    the intersection of the recorded intervals (a fake clock gives their ends)."""
    ticks = iter([0.0, 4.0,    # worker 0-4 (nobody waits: hidden)
                  5.0,         # worker starts at 5
                  6.0, 8.0,    # the training thread waits 6-8 (worker still running)
                  9.0,         # worker ends at 9: 1 + 2 + 1 s, 2 of them waited for
                  10.0, 11.0])  # a wait while the worker is idle: no worker time
    clock = OverlapClock(now=lambda: next(ticks))
    with clock.busy():
        pass
    assert clock.totals() == (4.0, 4.0)
    with clock.busy(), clock.waiting(), clock.waiting():  # nested waits count once
        pass
    assert clock.totals() == (8.0, 6.0)
    with clock.waiting():
        pass
    busy, hidden = clock.totals()
    assert (busy, hidden) == (8.0, 6.0) and 0.0 <= hidden <= busy


def test_train_log_shows_the_optimizer_hidden_and_exposed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`tierzero train` with cpu offload, clipping and overlap on: every step record has the
    optimizer's exposed time, its worker's time and the part of it hidden under compute,
    consistent with each other (values are measured, so only their relations are checked),
    and the log line prints them."""
    config = write_config(tmp_path, steps=3)
    cfg = yaml.safe_load(config.read_text())
    cfg["gradient_clipping"] = 1.0
    cfg["offload"] = {"params": {"device": "cpu"},
                      "optimizer": {"device": "cpu", "overlap_step": True}}
    config.write_text(yaml.safe_dump(cfg))
    caplog.set_level("INFO", logger="tierzero.engine.train")
    assert main(["train", str(config), "--no-progress"]) == 0
    steps = [r for r in read_metrics(tmp_path) if r["event"] == "step"]
    assert len(steps) == 3
    for r in steps:
        assert 0.0 <= r["optimizer_hidden_s"] <= r["optimizer_worker_s"] + 1e-9
        assert 0.0 <= r["optimizer_s"] <= r["step_s"]
        assert r["optimizer_hidden_s"] <= r["step_s"]  # ran within the step's wall time
    # the optimizer worked in every step: on its worker, or on the training thread, which
    # takes over the groups the worker has not started when it waits for them (on a busy
    # machine it may take them all), counted as exposed
    assert all(r["optimizer_worker_s"] + r["optimizer_s"] > 0 for r in steps)
    lines = [m for m in caplog.messages if m.startswith("step ")]
    assert len(lines) == 3 and all("exposed" in m and "hidden" in m for m in lines)
