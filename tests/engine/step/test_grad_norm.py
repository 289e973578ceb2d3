"""The global gradient norm on every step, clipping on or off ([Note: the gradient norm on
every step] in engine/step/precision.py).

`get_global_grad_norm()` must be the norm torch.nn.utils.clip_grad_norm_ returns on the
unsharded model (before clipping), and `get_clip_coef()` the factor it applied, for every
step driver: the torch optimizer on the device, the CPU Adam in place (host state) and
streamed (NVMe state), with the step begun during backward (overlap_step) or not.

Tolerance: fp32 on both sides; the engine sums fp32 norms of flat shards in fp64, torch
one fp32 norm per tensor, and the trajectories drift by float rounding (the parity tests'
~1e-6 relative on the parameters). Measured here: norms within 7e-8 relative over five
steps; asserted: 1e-6 relative.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    make_batches,
    make_config,
    make_model,
    offload_config,
    record_grad_stats,
)

from tierzero import engine
from tierzero.engine import engine as engine_mod
from tierzero.engine.config import Config
from tierzero.engine.step import in_place as in_place_mod
from tierzero.engine.step import streamed as streamed_mod

STEPS = 5
NORM_RTOL = 1e-6


def reference_norms(cfg: Config, steps: int) -> list[float]:
    """Plain PyTorch: AdamW on the whole model, clip_grad_norm_ before each step (with an
    infinite limit when clipping is off: it returns the norm and changes nothing)."""
    model = copy.deepcopy(make_model())
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay)
    gas = cfg.batch.gradient_accumulation_steps or 1
    limit = cfg.gradient_clipping if cfg.gradient_clipping > 0 else float("inf")
    norms = []
    for micro, (ids, tg) in enumerate(make_batches(steps * gas)):
        (model(ids, tg) / gas).backward()
        if (micro + 1) % gas == 0:
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), limit)))
            opt.step()
            opt.zero_grad()
    return norms


def engine_norms(cfg: Config, steps: int) -> tuple[list[float], list[float]]:
    """(grad norm, clip coefficient) after each optimizer step of the engine."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
    gas = cfg.batch.gradient_accumulation_steps or 1
    norms, coefs = [], []
    try:
        assert eng.get_global_grad_norm() is None and eng.get_clip_coef() is None
        for micro, (ids, tg) in enumerate(make_batches(steps * gas)):
            eng.backward(eng(ids, tg))
            eng.step()
            if (micro + 1) % gas == 0:
                norm, coef = eng.get_global_grad_norm(), eng.get_clip_coef()
                assert norm is not None and coef is not None
                norms.append(norm)
                coefs.append(coef)
    finally:
        eng.close()
    return norms, coefs


def with_overlap(cfg: Config, overlap: bool) -> Config:
    opt = dataclasses.replace(cfg.offload.optimizer, overlap_step=overlap)
    return dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, optimizer=opt))


def config_for(where: str, tmp_path: Path, *, clip: float, gas: int = 1) -> Config:
    """where: none (device driver), cpu / nvme with overlap_step on, cpu-serial /
    nvme-serial with it off."""
    cfg = make_config(clip=clip, gas=gas)
    if where == "none":
        return cfg
    device, _, serial = where.partition("-")
    cfg = offload_config(cfg, device, tmp_path if device == "nvme" else None)
    return with_overlap(cfg, not serial)


# the limits: off, and below the first steps' norms so that clipping acts (checked)
@pytest.mark.parametrize("clip", [0.0, 0.5])
@pytest.mark.parametrize("where", ["none", "cpu", "cpu-serial", "nvme", "nvme-serial"])
def test_grad_norm_matches_clip_grad_norm(tmp_path: Path, where: str, clip: float) -> None:
    cfg = config_for(where, tmp_path, clip=clip)
    want = reference_norms(cfg, STEPS)
    norms, coefs = engine_norms(cfg, STEPS)
    assert norms == pytest.approx(want, rel=NORM_RTOL)
    if clip > 0:
        assert coefs == [min(1.0, clip / (n + 1e-6)) for n in norms]
        assert min(coefs) < 1.0  # clipping acted, so the norm is taken before it
    else:
        assert coefs == [1.0] * STEPS


@pytest.mark.parametrize("where", ["none", "nvme"])
def test_grad_norm_with_accumulation(tmp_path: Path, where: str) -> None:
    """Two micro-batches per step: the norm of the accumulated gradient, once per step."""
    cfg = config_for(where, tmp_path, clip=0.0, gas=2)
    norms, _ = engine_norms(cfg, 3)
    assert norms == pytest.approx(reference_norms(cfg, 3), rel=NORM_RTOL)


@pytest.mark.parametrize("overlap", [True, False])
def test_unclipped_nvme_norm_is_taken_during_backward(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    """Clipping off, gradients homed on NVMe: each group is measured once, handed to the
    measuring worker as its reduction ends during backward (before the early step consumes
    it, with overlap_step), and step() measures no gradient again for the norm. (The
    worker may finish the last groups after backward returns: step() waits for them.)"""
    cfg = config_for("nvme" if overlap else "nvme-serial", tmp_path, clip=0.0)
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
    try:
        # (group key, in backward)
        calls, handed, in_backward = record_grad_stats(monkeypatch)

        def no_stat(store: object, key: str) -> object:
            raise AssertionError(f"step() measured {key} again")

        monkeypatch.setattr(engine_mod, "grad_stat", no_stat)
        for ids, tg in make_batches(2):
            calls.clear()
            handed.clear()
            loss = eng(ids, tg)
            in_backward[0] = True
            eng.backward(loss)
            in_backward[0] = False
            eng.step()
            norm = eng.get_global_grad_norm()
            assert norm is not None and norm > 0
            assert sorted(k for k, _ in calls) == sorted(eng._train_keys)
            assert sorted(k for k, _ in handed) == sorted(eng._train_keys)
            assert all(during for _, during in handed), handed
    finally:
        eng.close()


def test_unclipped_in_place_overlap_measures_on_the_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host state with overlap_step: the early step's worker measures each group beside
    backward; step() measures none of them on the training thread."""
    cfg = config_for("cpu", tmp_path, clip=0.0)
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
    try:
        threads: list[str] = []
        real_stat = in_place_mod.grad_stat

        def stat(store: object, key: str) -> object:
            threads.append(threading.current_thread().name)
            return real_stat(store, key)  # type: ignore[arg-type]

        def no_stat(store: object, key: str) -> object:
            raise AssertionError(f"step() measured {key} outside the driver")

        monkeypatch.setattr(in_place_mod, "grad_stat", stat)
        monkeypatch.setattr(engine_mod, "grad_stat", no_stat)
        ids, tg = make_batches(1)[0]
        eng.backward(eng(ids, tg))
        eng.step()
        assert eng.get_global_grad_norm() is not None
        assert len(threads) == len(eng._train_keys)
    finally:
        eng.close()


def test_nonfinite_gradient_without_clipping_skips_the_step() -> None:
    """With clipping off the norm is still taken, so a NaN gradient skips the step instead
    of writing NaN into the parameters."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=make_config(clip=0.0))
    try:
        ids, tg = make_batches(1)[0]
        with engine.GatheredParameters(list(eng.module.parameters())):
            before = {k: v.detach().clone() for k, v in eng.module.named_parameters()}
        eng.backward(eng(ids, tg) * float("nan"))
        eng.step()
        norm = eng.get_global_grad_norm()
        assert norm is not None and math.isnan(norm)
        assert eng.skipped_steps == 1 and eng.global_steps == 0
        assert eng.get_clip_coef() is None
        with engine.GatheredParameters(list(eng.module.parameters())):
            for k, v in eng.module.named_parameters():
                assert torch.equal(v.detach(), before[k]), k
    finally:
        eng.close()


@pytest.mark.parametrize("clip", [0.0, 100.0])
def test_a_slow_measurement_ends_before_the_update_lets_its_gradient_go(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clip: float) -> None:
    """The update run during backward (the early step without clipping; a speculated one
    under clipping that does not fire) reads each gradient while the worker measures it,
    and lets the gradient go (dropped unwritten, or written down) only once it is measured
    ([Note: gradients measured where they are reduced] in engine/step/streamed.py): with
    every measurement slowed down, the norms and coefficients are bit for bit those
    measured in step() with overlap_step off."""
    for name in ("serial", "early"):
        (tmp_path / name).mkdir()
    serial = engine_norms(config_for("nvme-serial", tmp_path / "serial", clip=clip), 4)
    real = streamed_mod.grad_stat

    def slow(store: object, key: str) -> object:
        time.sleep(0.02)  # the update of the group is done long before
        return real(store, key)  # type: ignore[arg-type]

    monkeypatch.setattr(streamed_mod, "grad_stat", slow)
    early = engine_norms(config_for("nvme", tmp_path / "early", clip=clip), 4)
    assert early == serial
