"""logging.wall_clock_breakdown: rank 0 logs each due optimizer step's phase times.

Only what is guaranteed is checked: when the line comes, what it names, that every
figure is a non-negative number; never the timings themselves."""

from __future__ import annotations

import dataclasses
import re

import pytest
from engine_helpers import make_batches, make_config, make_model

from tierzero import engine
from tierzero.engine.config.schema import LoggingConfig

NAMES = ("forward", "backward", "step", "gathers", "deferred-update waits",
         "optimizer hidden", "io stall")


def _run(caplog: pytest.LogCaptureFixture, *, on: bool) -> list[str]:
    cfg = dataclasses.replace(make_config(gas=2, clip=1.0), logging=LoggingConfig(
        steps_per_print=2, wall_clock_breakdown=on))
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
    caplog.set_level("INFO", logger="tierzero.engine.wall_clock")
    try:
        for ids, tg in make_batches(8):  # 4 optimizer steps of 2 micro-steps
            eng.backward(eng(ids, tg))
            eng.step()
    finally:
        eng.close()
    return [r.getMessage() for r in caplog.records if r.name == "tierzero.engine.wall_clock"]


def test_breakdown_logged_every_steps_per_print(caplog: pytest.LogCaptureFixture) -> None:
    lines = _run(caplog, on=True)
    assert [re.search(r"optimizer step (\d+)", m).group(1) for m in lines] == ["2", "4"]  # type: ignore[union-attr]
    for m in lines:
        assert "2 micro-step(s)" in m
        for name in NAMES:
            value = re.search(rf"\| {name} (-?[\d.]+)", m)
            assert value is not None and float(value.group(1)) >= 0.0, (name, m)


def test_no_breakdown_by_default(caplog: pytest.LogCaptureFixture) -> None:
    assert _run(caplog, on=False) == []
