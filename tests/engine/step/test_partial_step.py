"""An optimizer update that fails partway ([Note: a partial step] in engine/step/offloaded.py).

The kernel is made to raise on the second parameter group an update reaches: the first
keeps the step's update, the failed one does not. The engine keeps the failure, and
save_checkpoint refuses (synchronous and background), naming the step and the failure,
until a checkpoint is loaded; `allow_partial_step=True` saves the state as it is, and that
checkpoint loads to exactly that state. After the load of the checkpoint from before,
saves work again and training goes on. The update deferred into the next forward (state
on NVMe, streamed; state in host memory, in place) and the update in step() (overlap_step
off).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import full_params, make_batches, make_config, make_model, offload_config

from tierzero import engine
from tierzero.engine.checkpoint.layout import LATEST, CheckpointError
from tierzero.engine.config import Config
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.step.in_place import InPlaceStep
from tierzero.engine.step.offloaded import OffloadedStep, StepMode
from tierzero.offload.adam_stream import AdamStream

CASES = {  # name: (optimizer home, overlap_step, the driver's mode)
    "nvme-deferred": ("nvme", True, StepMode.DEFER),
    "nvme-in-step": ("nvme", False, StepMode.MEASURE),
    "cpu-deferred": ("cpu", True, StepMode.DEFER),
}


def config(tmp_path: Path, home: str, overlap: bool) -> Config:
    """Clipping at 1.0 (the step waits for the global norm); speculation off, so the
    update runs where the mode says ([Note: speculated step] undoes its own failures)."""
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    cfg = offload_config(make_config(clip=1.0), home, swap if home == "nvme" else None)
    opt = dataclasses.replace(cfg.offload.optimizer, overlap_step=overlap,
                              speculate_step=False)
    return dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, optimizer=opt))


class SecondGroupFails:
    """While armed, the kernel raises on the second distinct group it is asked to update
    (each group whole before it: the streamed kernel runs piece by piece)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        self.seen: list[Any] = []
        self._lock = threading.Lock()
        real_stream, real_in_place = AdamStream._update, InPlaceStep.update

        def stream_kernel(stream: Any, bufs: Any, piece: Any, *args: Any) -> float:
            self._check(piece.keys["master"])
            return real_stream(stream, bufs, piece, *args)

        def in_place(step: Any, key: str, *args: Any) -> float:
            self._check(key)
            return real_in_place(step, key, *args)

        monkeypatch.setattr(AdamStream, "_update", stream_kernel)
        monkeypatch.setattr(InPlaceStep, "update", in_place)

    def _check(self, group: Any) -> None:
        with self._lock:
            if not self.armed:
                return
            if group not in self.seen:
                self.seen.append(group)
            if self.seen.index(group) == 1:
                raise OSError("injected kernel failure")


def one_step(eng: ZeroEngine, seed: int) -> None:
    ids, tg = make_batches(1, seed=seed)[0]
    eng.backward(eng(ids, tg))
    eng.step()


@pytest.mark.parametrize("case", list(CASES))
def test_a_partial_step_is_not_saved_until_a_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        case: str) -> None:
    home, overlap, mode = CASES[case]
    fails = SecondGroupFails(monkeypatch)
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=config(tmp_path, home, overlap))
    driver = eng.step_driver
    assert isinstance(driver, OffloadedStep) and driver.mode is mode
    ck = tmp_path / "ck"
    try:
        one_step(eng, 1)
        eng.save_checkpoint(ck, tag="good")
        good = full_params(eng, eng.module)
        assert driver.partial_step is None
        fails.armed = True
        with pytest.raises(Exception, match="injected kernel failure"):
            one_step(eng, 2)  # in step(), or handed to the next forward
            eng.step_driver.drain()  # (what the next forward's first wait raises)
        fails.armed = False
        assert len(fails.seen) >= 2
        partial = driver.partial_step
        assert partial is not None and "optimizer step 2's update failed partway" in partial
        assert "injected kernel failure" in partial
        now = full_params(eng, eng.module)
        changed = [k for k in good if not torch.equal(good[k], now[k])]
        # the first group took step 2's update, the failed one did not
        assert changed and len(changed) < len(good), changed
        for background in (False, True):
            with pytest.raises(CheckpointError, match=r"save_checkpoint refused: optimizer "
                               r"step 2's update failed partway \(.*injected kernel failure"
                               r".*load_checkpoint.*allow_partial_step=True"):
                eng.save_checkpoint(ck, tag="torn", background=background)
        assert (ck / LATEST).read_text().strip() == "good"
        assert not (ck / "torn").exists()
        # knowingly: the state as it is, which loads to exactly that state
        with caplog.at_level(logging.WARNING, logger="tierzero.engine.engine"):
            eng.save_checkpoint(ck, tag="partial", allow_partial_step=True)
            eng.quiesce("export_hf")  # what an export settles first: it warns, goes on
        said = [r.getMessage() for r in caplog.records]
        assert any("allow_partial_step" in m and "injected" in m for m in said), said
        assert any(m.startswith("export_hf of a partial optimizer step") for m in said), said
        eng.load_checkpoint(ck, tag="good")
        assert driver.partial_step is None
        got = full_params(eng, eng.module)
        assert all(torch.equal(got[k], good[k]) for k in good)
        one_step(eng, 2)  # training goes on, and saves again
        eng.save_checkpoint(ck, tag="after")
        assert (ck / LATEST).read_text().strip() == "after"
        eng.load_checkpoint(ck, tag="partial")
        got = full_params(eng, eng.module)
        assert all(torch.equal(got[k], now[k]) for k in now)
        eng.step_driver.drain()
    finally:
        eng.close()

