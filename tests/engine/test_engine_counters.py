"""The engine's step counters save and restore themselves (counters_state / load_counters):
what a checkpoint keeps of them, and a name this engine does not keep refused by name."""

from __future__ import annotations

import pytest
from engine_helpers import make_batches, make_config, make_model

from tierzero import engine
from tierzero.engine.checkpoint.layout import CheckpointError
from tierzero.engine.engine import COUNTERS


def test_counters_round_trip_and_unknown_names_are_refused() -> None:
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=make_config())
    try:
        for ids, tg in make_batches(2):
            eng.backward(eng(ids, tg))
            eng.step()
        saved = eng.counters_state()
        assert set(saved) == set(COUNTERS)
        assert saved["global_steps"] == 2 and saved["micro_steps"] == 2
        assert isinstance(saved["last_grad_norm"], float)
        fresh, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                           config=make_config())
        try:
            fresh.load_counters(saved)
            assert fresh.counters_state() == saved
            with pytest.raises(CheckpointError, match=r"\['epoch'\].*not kept"):
                fresh.load_counters({**saved, "epoch": 3})
            assert fresh.counters_state() == saved  # refused before anything changed
        finally:
            fresh.close()
    finally:
        eng.close()
