"""Training runs that save or resume a checkpoint, run in fresh processes by the ckpt tests."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from engine_dist import fresh_process
from engine_helpers import full_params, make_batches, make_config, make_model

from tierzero import engine
from tierzero.engine.config import Config, SchedulerConfig
from tierzero.engine.config.schema import (
    BudgetsConfig,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)


def resume_config(precision: str, gas: int, offload: str = "none",
                  swap: str | None = None) -> Config:
    """Warm-up then cosine decay, clipping: the schedule and the clip both carry state.
    `offload` (none, cpu, nvme, auto, or params_nvme: params on NVMe, optimizer state on the
    device): where params and optimizer state live; nvme swaps to `swap` (a directory of
    this run's own: a swap file belongs to one engine)."""
    sched = SchedulerConfig(type="warmup_cosine", warmup_steps=3, total_steps=12,  # type: ignore[arg-type]
                            warmup_start_lr=1e-4, min_lr=1e-3)
    cfg = make_config(precision=precision, gas=gas, clip=0.5, scheduler=sched)
    # fp16: start the dynamic loss scale far too high, so early steps overflow and are
    # skipped, and let it grow back every 2 clean steps: the scaler's state then matters
    scale = replace(cfg.precision.loss_scale, initial_scale_power=21, growth_interval=2,
                    hysteresis=1)
    cfg = replace(cfg, precision=replace(cfg.precision, loss_scale=scale))
    if offload == "none":
        return cfg
    if swap is not None:
        Path(swap).mkdir(parents=True, exist_ok=True)
    # a device tier smaller than the params (~86 KB fp32): caches are evicted and refetched
    params, opt = ("nvme", "none") if offload == "params_nvme" else (offload, offload)
    return replace(cfg, offload=OffloadConfig(
        params=ParamOffloadConfig(device=params, path=swap),  # type: ignore[arg-type]
        optimizer=OptimizerOffloadConfig(device=opt, path=swap),  # type: ignore[arg-type]
        budgets=BudgetsConfig(device_bytes=(64 << 10) if opt != "none" else (8 << 20))))


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"parameters differ after resume: {bad}"


def assert_resumed(full: dict[str, Any], resumed: dict[str, Any], n: int) -> None:
    """`resumed` (loaded at micro-step n) ended exactly where the uninterrupted `full` did."""
    assert_same_params(resumed["params"], full["params"])
    assert resumed["draws"] == full["draws"][3 * n:]  # RNG streams continue where they were
    assert resumed["lr"] == full["lr"]
    assert resumed["counters"] == full["counters"]
    assert resumed["loss_scale"] == full["loss_scale"]
    assert resumed["client_state"] == {"micro": n}
    # the run moved the parameters after the save, or the comparison proves little
    moved = max(float((full["params"][k] - full["params_at_save"][k]).abs().max())
                for k in full["params"])
    assert moved > 1e-4


def _draw_rngs() -> list[float]:
    """What dropout and data shuffling would draw: one value from each RNG."""
    return [float(torch.rand(1)), random.random(), float(np.random.rand())]


def run_phase(rank: int, *, precision: str, gas: int, ckpt: str, stop: int,
              save_at: int | None = None, load: bool = False,
              background: bool = False, offload: str = "none",
              swap: str | None = None) -> dict[str, Any]:
    """Train micro-steps [start, stop) on this rank's batches: start 0, or the checkpoint's
    micro-step when `load`. Saves after micro-step `save_at`. Each micro-step draws from every
    RNG, so the RNG states at the save point are not the seeded ones. `background`: the save
    is written while the following micro-steps run (it must hold the state at the save)."""
    model = make_model()
    where = None if swap is None else f"{swap}/rank{rank}"
    eng, _, _, _ = engine.initialize(model=model, config=resume_config(precision, gas, offload,
                                                                       where), device="cpu")
    batches = make_batches(stop, seed=1 + rank)
    out: dict[str, Any] = {}
    if load:
        _, out["client_state"] = eng.load_checkpoint(ckpt)
    draws: list[float] = []
    for micro in range(eng.micro_steps, stop):
        ids, tg = batches[micro]
        eng.backward(eng(ids, tg))
        eng.step()
        draws += _draw_rngs()
        if save_at is not None and micro + 1 == save_at:
            pending = eng.save_checkpoint(ckpt, client_state={"micro": micro + 1},
                                          background=background)
            out["save_done_at_return"] = not background or pending.done()  # type: ignore[union-attr]
            out["params_at_save"] = full_params(eng, model)
            out["draws_at_save"] = list(draws)
    out["params"] = full_params(eng, model)
    out["draws"] = draws
    out["lr"] = eng.get_lr()
    out["counters"] = (eng.micro_steps, eng.global_steps, eng.skipped_steps)
    out["loss_scale"] = eng.loss_scaler.scale if eng.loss_scaler else None
    eng.close()
    return out


def _fresh_worker(fn: Callable[[], Any], out: str) -> None:
    torch.set_num_threads(1)
    torch.save(fn(), out)


def run_fresh(tmp: Path, name: str, fn: Callable[[], Any]) -> Any:
    """`fn()` in a new process that ran nothing before (forked from engine_dist's fork
    server, which only imported torch and tierzero): nothing carries over but the files."""
    out = tmp / f"{name}.pt"
    code = fresh_process(_fresh_worker, fn, str(out))
    if code != 0:
        raise RuntimeError(f"fresh process {name!r} exited with {code}")
    return torch.load(out, weights_only=False)


def crash_config(offload: str, swap: str | None) -> Config:
    """crash_child's config: offload none, or params and optimizer state on `offload`."""
    cfg = make_config(units=("Linear",))
    if offload == "none":
        return cfg
    return replace(cfg, offload=OffloadConfig(
        params=ParamOffloadConfig(device=offload, path=swap),  # type: ignore[arg-type]
        optimizer=OptimizerOffloadConfig(device=offload, path=swap)))  # type: ignore[arg-type]


def crash_child(ckpt: str, ready: str, offload: str = "none", swap: str | None = None,
                background: bool = False) -> None:
    """Save tag t0, signal `ready`, then train and save t1, t2, ... until killed.
    `background`: each save is written while the next step runs (the next save waits
    for it), so a kill lands inside a background write or a step that overlaps one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4)))
    cfg = crash_config(offload, swap)
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    x = torch.randn(8, 512)
    for step in range(10_000):
        eng.backward(eng(x).square().mean())
        eng.step()
        pending = eng.save_checkpoint(ckpt, tag=f"t{step}", background=background)
        if step == 0:
            if isinstance(pending, engine.PendingSave):
                pending.wait()
            Path(ready).write_text("ready")


def run_cuda_steps(eng: engine.ZeroEngine,
                   batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """One step per batch; after each, a draw from the CUDA RNG, so a resume that failed to
    restore the CUDA RNG stream shows in the draws."""
    draws = []
    for ids, tg in batches:
        eng.backward(eng(ids, tg))
        eng.step()
        draws.append(float(torch.rand(1, device="cuda")))  # the CUDA RNG stream moves on
    return draws
