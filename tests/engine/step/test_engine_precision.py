"""fp16 loss scaling (overflow -> skip, halve, grow) and the learning-rate schedules."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
from engine_helpers import make_batches, make_config, make_model

from tierzero import engine
from tierzero.engine.config import LossScaleConfig, PrecisionConfig, SchedulerConfig
from tierzero.engine.step.lr_schedules import lr_at
from tierzero.engine.step.precision import LossScaler


def test_loss_scaler_hysteresis_growth_and_floor() -> None:
    s = LossScaler(LossScaleConfig(initial_scale_power=4, growth_interval=3, hysteresis=2,
                                   min_scale=4.0))
    assert s.scale == 16.0
    s.update(overflow=True)  # first overflow spent on hysteresis
    assert s.scale == 16.0
    s.update(overflow=True)
    assert s.scale == 8.0
    for _ in range(3):
        s.update(overflow=False)
    assert s.scale == 16.0  # doubled after growth_interval clean steps
    for _ in range(5):
        s.update(overflow=True)
    assert s.scale == 4.0  # never below min_scale
    static = LossScaler(LossScaleConfig(value=128.0))
    static.update(overflow=True)
    static.update(overflow=False)
    assert static.scale == 128.0


def _fp16_config(hysteresis: int = 1, gas: int = 2, clip: float = 0.0) -> engine.Config:
    cfg = make_config(precision="fp16", gas=gas, clip=clip)
    ls = LossScaleConfig(initial_scale_power=16, growth_interval=1000, hysteresis=hysteresis)
    return dataclasses.replace(cfg, precision=PrecisionConfig(dtype="fp16", loss_scale=ls))


def test_fp16_overflow_skips_step_and_halves_scale(caplog: pytest.LogCaptureFixture) -> None:
    model = make_model()
    eng, opt, _, sched = engine.initialize(device="cpu", model=model, config=_fp16_config())
    (ids, tg), (ids2, tg2) = make_batches(2)
    with engine.GatheredParameters(list(model.parameters())):
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
    lr0 = eng.get_lr()
    eng.backward(eng(ids, tg))
    eng.step()  # micro-step 1 of 2
    eng.backward(eng(ids2, tg2) * 1e9)  # x 2**16 overflows fp16 gradients
    with caplog.at_level(logging.WARNING, logger="tierzero.engine.step.precision"):
        eng.step()
    assert eng.skipped_steps == 1 and eng.global_steps == 0
    assert eng.loss_scaler is not None and eng.loss_scaler.scale == 2.0**15
    assert "overflow" in caplog.text and "skipped" in caplog.text
    assert eng.get_lr() == lr0  # the schedule does not advance on a skipped step
    with engine.GatheredParameters(list(model.parameters())):
        for k, p in model.named_parameters():
            assert torch.equal(p.detach(), before[k]), k
    # the overflowed gradients were dropped: marked zero, overwritten by the next reduction
    # ([Note: gradients zeroed on first use]); read, they are zeros
    assert all(eng.store.grad_zeroed(k) for k in eng._train_keys)
    for k in eng._train_keys:
        assert not eng.store.tensor(k, "grad").any()
    eng.backward(eng(ids, tg))
    eng.step()
    eng.backward(eng(ids2, tg2))
    eng.step()
    assert eng.global_steps == 1 and eng.skipped_steps == 1
    del opt, sched
    eng.close()


def test_fp16_gradients_are_unscaled() -> None:
    """The fp32 gradient shard after unscaling equals the fp32 engine's, within fp16 noise."""
    ids, tg = make_batches(1)[0]
    norms = []
    for cfg in (make_config(clip=1e9), _fp16_config(gas=1, clip=1e9)):
        eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
        eng.backward(eng(ids, tg))
        eng.step()
        norms.append(eng.last_grad_norm)
        eng.close()
    assert norms[0] is not None and norms[1] is not None
    assert math.isclose(norms[0], norms[1], rel_tol=2e-2)  # fp16 compute, fp32 reference


@pytest.mark.parametrize("kind", ["constant", "warmup_linear", "warmup_cosine"])
def test_lr_schedule_curves(kind: str) -> None:
    cfg = SchedulerConfig(type=kind, warmup_steps=4, warmup_start_lr=0.001,  # type: ignore[arg-type]
                          total_steps=None if kind == "constant" else 12, min_lr=0.002)
    lr = lr_at(cfg, peak=0.01)
    assert lr(0) == pytest.approx(0.001)
    assert lr(2) == pytest.approx(0.001 + 0.009 * 0.5)
    assert lr(4) == pytest.approx(0.01)
    if kind == "constant":
        assert lr(100) == pytest.approx(0.01)
    elif kind == "warmup_linear":
        assert lr(8) == pytest.approx(0.006)
        assert lr(12) == pytest.approx(0.002) and lr(50) == pytest.approx(0.002)
    else:
        assert lr(8) == pytest.approx(0.006)  # half way: cosine midpoint
        assert lr(6) == pytest.approx(0.002 + 0.008 * 0.5 * (1 + math.cos(math.pi / 4)))
        assert lr(12) == pytest.approx(0.002)


def test_log_warmup_matches_deepspeed_curve() -> None:
    lr = lr_at(SchedulerConfig(warmup_steps=10, warmup_shape="log"), peak=1.0)
    for t in (0, 3, 9):
        assert lr(t) == pytest.approx(math.log(t + 1) / math.log(10))


def test_engine_steps_schedule_once_per_optimizer_step() -> None:
    sched_cfg = SchedulerConfig(type="warmup_linear", warmup_steps=2, total_steps=6)
    cfg = dataclasses.replace(make_config(gas=2), scheduler=sched_cfg)
    eng, opt, _, sched = engine.initialize(device="cpu", model=make_model(), config=cfg)
    curve = lr_at(sched_cfg, peak=cfg.optimizer.lr)
    seen = []
    for ids, tg in make_batches(8):
        eng.backward(eng(ids, tg))
        eng.step()
        seen.append(opt.param_groups[0]["lr"])
    # lr changes only at optimizer steps (every 2nd micro-step)
    want = [curve(0), curve(1), curve(1), curve(2), curve(2), curve(3), curve(3), curve(4)]
    assert seen == pytest.approx(want)
    assert sched.last_epoch == 4
    eng.close()


def test_loss_scaler_state_round_trips_and_reads_old_checkpoints() -> None:
    """The scaler saves and restores itself (issue 28): the restored one takes the same
    decisions as the original; a checkpoint that named the counters by their attribute
    names still loads."""
    from tierzero.engine.config import LossScaleConfig
    from tierzero.engine.step.precision import LossScaler

    cfg = LossScaleConfig(hysteresis=2, growth_interval=3)
    a = LossScaler(cfg)
    for overflow in (True, False, False):
        a.update(overflow=overflow)
    b = LossScaler(cfg)
    b.load_state_dict(a.state_dict())
    for overflow in (False, True, True, False, False, False):
        a.update(overflow=overflow)
        b.update(overflow=overflow)
        assert a.state_dict() == b.state_dict()
    old = {"scale": 512.0, "_hysteresis": 1, "_good_steps": 2, "overflows": 4}
    c = LossScaler(cfg)
    c.load_state_dict(old)
    assert c.state_dict() == {"scale": 512.0, "hysteresis": 1, "good_steps": 2,
                              "overflows": 4}
