"""Clipping and fp16 with optimizer state on NVMe: gradients measured as they are reduced
([Note: gradients measured where they are reduced] in engine/step/streamed.py).

With offload.optimizer.overlap_step on, the streamed step takes each group's norm and
finiteness right after its reduction during backward and updates after backward. The
results must be those of measuring in step() (overlap off): bit for bit, and plain
PyTorch's (clip_grad_norm_, AdamW) within the parity tolerances.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from engine_helpers import (
    assert_overlap_matches_off_and_pytorch,
    fp16_overlap_runs,
    make_batches,
    make_config,
    make_model,
    offload_config,
    record_grad_stats,
)
from engine_helpers import (
    streamed_runner as runner,
)

from tierzero import engine
from tierzero.engine.config import Config
from tierzero.engine.config.schema import LossScaleConfig, PrecisionConfig


def nvme_config(path: Path, *, overlap: bool, clip: float = 1.0, gas: int = 1,
                fp16: bool = False) -> Config:
    """Params and optimizer state on NVMe (the streamed CPU Adam), swap files in `path`."""
    path.mkdir(exist_ok=True)
    cfg = offload_config(make_config(gas=gas, clip=clip), "nvme", path)
    opt = dataclasses.replace(cfg.offload.optimizer, overlap_step=overlap)
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, optimizer=opt))
    if fp16:  # dynamic scaling from 2**8, growth every 2 good steps
        ls = LossScaleConfig(initial_scale_power=8, growth_interval=2, hysteresis=1)
        cfg = dataclasses.replace(cfg, precision=PrecisionConfig(dtype="fp16", loss_scale=ls))
    return cfg


@pytest.mark.parametrize(("clip", "gas"), [(1.0, 1), (0.5, 2), (1e-3, 1)])
def test_clipped_streamed_step_measured_in_backward_is_bit_identical_and_matches_pytorch(
        tmp_path: Path, clip: float, gas: int) -> None:
    assert_overlap_matches_off_and_pytorch(
        lambda overlap: nvme_config(tmp_path / str(overlap), overlap=overlap, clip=clip,
                                    gas=gas), steps=3, gas=gas, clip=clip)


def test_every_group_is_measured_during_backward_and_none_again_in_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The limit is below the norm, so the factor applies; each group is handed to the
    measuring worker while backward runs, its norm is taken once, and step() only adds
    them up (after waiting for the last ones)."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=nvme_config(tmp_path, overlap=True, clip=1e-3))
    try:
        # (group key, in backward)
        calls, handed, in_backward = record_grad_stats(monkeypatch)
        ids, tg = make_batches(1)[0]
        loss = eng(ids, tg)
        in_backward[0] = True
        eng.backward(loss)
        in_backward[0] = False
        eng.step()
        assert eng.last_grad_norm is not None and eng.last_grad_norm > 1e-3
        assert sorted(k for k, _ in calls) == sorted(eng._train_keys)
        assert sorted(k for k, _ in handed) == sorted(eng._train_keys)
        assert all(during for _, during in handed), handed
    finally:
        eng.close()


def test_a_group_reduced_again_is_measured_again(tmp_path: Path) -> None:
    """grad_stats(redo): a measured group in `redo` (a late gradient reduced it again) is
    measured anew; the others keep their measurement; the measurements are consumed."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=nvme_config(tmp_path, overlap=True))
    try:
        step = runner(eng)
        assert (step.measures, step.defers) == (True, True)
        keys = eng._train_keys
        for key in keys:
            with eng.store.use(key, "grad", writable=True) as g:
                g.fill_(1.0)
        step.begin_measure()
        step.measure(keys)
        step._measured.wait(keys)  # measured on the worker: done before the values change
        first, second = keys[0], keys[1]
        for key in (first, second):  # the gradients change after their measurement
            with eng.store.use(key, "grad", writable=True) as g:
                g.fill_(2.0)
        stats = step.grad_stats({first})
        assert list(stats) == keys
        sizes = {}
        for key in (first, second):
            with eng.store.use(key, "grad") as g:
                sizes[key] = g.numel()
        n_first, n_second = sizes[first], sizes[second]
        assert stats[first].sq_norm == pytest.approx(4.0 * n_first)  # measured again
        assert stats[second].sq_norm == pytest.approx(1.0 * n_second)  # as measured
        again = step.grad_stats(set())  # nothing measured any more: all measured now
        assert again[second].sq_norm == pytest.approx(4.0 * n_second)
    finally:
        eng.close()


def test_fp16_streamed_overlapped_is_bit_identical_with_the_same_skips(
        tmp_path: Path) -> None:
    """fp16 loss scaling with state on NVMe, overlap on and off: the same overflow skip
    (a step whose loss is blown up), the same scales, the same bits."""
    fp16_overlap_runs(
        lambda overlap: nvme_config(tmp_path / str(overlap), overlap=overlap, fp16=True), 5)
