"""A unit's residency moves only through its own checked methods ([Note: unit residency]
in engine/unit.py), and its per-backward gradient bookkeeping resets in one call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_batches, make_model

from tierzero import engine
from tierzero.engine.unit import Residency, Unit
from tierzero.offload.step_seam import TrainingStateError


def _engine(tmp: Path, offload: str = "none") -> engine.ZeroEngine:
    raw = {"zero": {"stage": 3, "persistence_threshold_bytes": 0, "units": ["Block"]},
           "precision": "fp32", "optimizer": {"type": "adamw", "lr": 1e-2}}
    if offload != "none":
        raw["offload"] = {"device": offload, **({"path": str(tmp)} if offload == "nvme" else {})}
    cfg = engine.load_config(raw)
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
    return eng


def _block(eng: engine.ZeroEngine) -> Unit:
    return next(u for u in eng.units if not u.is_root)


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_residency_through_a_step(tmp_path: Path, offload: str) -> None:
    eng = _engine(tmp_path, offload)
    unit = _block(eng)
    assert unit.residency is Residency.RELEASED and not unit.gathered
    ids, targets = make_batches(1)[0]
    eng.backward(eng(ids, targets))
    eng.step()
    assert all(u.residency is Residency.RELEASED for u in eng.units if not u.is_root)
    eng.scheduler.ensure_gathered(unit)
    assert unit.current
    w = unit.trainable[0].detach().clone()
    eng.scheduler.mark_stale()  # as after a checkpoint load: the shards changed
    assert unit.stale and unit.gathered and not unit.current
    eng.scheduler.refresh()  # gathered again from the shards
    assert unit.current and torch.equal(unit.trainable[0].detach(), w)
    assert eng.scheduler.gathered_bytes() >= unit.full_bytes()
    eng.scheduler.release(unit)
    assert unit.residency is Residency.RELEASED and unit.trainable[0].numel() == 0
    eng.close()


def test_a_second_gather_is_refused_before_any_work(tmp_path: Path) -> None:
    eng = _engine(tmp_path)
    unit = _block(eng)
    eng.scheduler.ensure_gathered(unit)
    with pytest.raises(TrainingStateError, match=r"unit 'blocks\.0'.*gather\(\) in state GATHERED"):
        unit.gather(eng.comm, eng.store)
    assert unit.current  # untouched
    eng.scheduler.release(unit)
    unit.mark_stale()  # released: nothing to mark
    assert unit.residency is Residency.RELEASED
    eng.close()


def test_gradient_bookkeeping_resets_per_backward(tmp_path: Path) -> None:
    eng = _engine(tmp_path)
    unit = _block(eng)
    params = unit.trainable
    assert not any(unit.fire(p) for p in params[:-1])
    assert unit.fire(params[-1])  # every trainable parameter's gradient arrived
    assert unit.groups_complete() == [g for g in unit.groups if g.trainable]
    unit.mark_reduced(unit.groups_complete())
    assert unit.reduced and unit.late_group(params[0]) is unit.group_of[id(params[0])]
    unit.reset_for_pass()
    assert not unit.reduced and not unit.fired and unit.late_group(params[0]) is None
    eng.close()
