"""The optimizer-step seam's small owners (offload/step_seam.py), without an engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from engine_helpers import make_batches, make_config, make_model

from tierzero import engine
from tierzero.engine.config.schema import OffloadConfig, OptimizerOffloadConfig
from tierzero.engine.schedule import PassState
from tierzero.offload.step_seam import (
    STEP_TRANSITIONS,
    StepOrder,
    StepState,
    TrainingStateError,
    transition,
)

KEYS = ["b0", "b1", "b2", "emb", "head"]  # construction order: blocks, then the root's pieces


def test_backward_guess_is_blocks_last_to_first_then_the_root() -> None:
    order = StepOrder.backward_guess(KEYS, [["b0"], ["b1"], ["b2"]], ["emb", "head"])
    assert order.keys == ["b2", "b1", "b0", "emb", "head"]
    assert order.indices() == [2, 1, 0, 3, 4]


def test_first_order_seen_is_taken_at_once_then_only_when_two_steps_agree() -> None:
    order = StepOrder(KEYS)
    seen = ["head", "b2", "b1", "b0", "emb"]
    assert order.learn(seen) and order.keys == seen
    other = list(reversed(seen))
    assert not order.learn(other) and order.keys == seen  # seen once: kept
    assert not order.learn(seen)  # the learned order again: no change
    assert not order.learn(other)  # alternating: kept
    assert order.learn(other) and order.keys == other  # twice in a row: taken
    assert not order.learn([])  # a backward that finalised nothing says nothing


def test_groups_left_out_keep_their_relative_order_after_the_named_ones() -> None:
    order = StepOrder(KEYS)
    assert order.learn(["head", "b1"])
    assert order.keys == ["head", "b1", "b0", "b2", "emb"]


def test_unknown_groups_and_incomplete_initial_orders_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown groups"):
        StepOrder(KEYS).learn(["nope"])
    with pytest.raises(ValueError, match="every group once"):
        StepOrder(KEYS, ["b0", "b1"])


def test_an_illegal_transition_names_owner_call_states_and_fix() -> None:
    with pytest.raises(TrainingStateError) as err:
        transition("the step", STEP_TRANSITIONS, StepState.ABANDONED, StepState.OPEN,
                   call="backward()", fix="call step() first")
    msg = str(err.value)
    for part in ("the step", "backward()", "ABANDONED", "OPEN", "allows IDLE",
                 "call step() first"):
        assert part in msg, (part, msg)
    assert transition("the step", STEP_TRANSITIONS, StepState.OPEN, StepState.ABANDONED,
                      call="abandon()", fix="") is StepState.ABANDONED


def test_scheduler_passes_are_checked() -> None:
    """A backward pass cannot begin inside another, nor a forward inside a backward; a
    failed forward leaves the scheduler idle."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=make_config())
    try:
        ids, tg = make_batches(1)[0]
        assert eng.scheduler.state is PassState.IDLE
        loss = eng(ids, tg)
        assert eng.scheduler.state is PassState.IDLE
        eng.scheduler.begin_backward()
        with pytest.raises(TrainingStateError, match=r"begin_backward.*BACKWARD"):
            eng.scheduler.begin_backward()
        with pytest.raises(TrainingStateError, match="begin_forward"):
            eng(ids, tg)
        eng.scheduler.end_backward()
        assert eng.scheduler.state is PassState.IDLE
        with pytest.raises(TypeError):
            eng(ids)  # the model's forward fails: the pass is aborted
        assert eng.scheduler.state is PassState.IDLE
        del loss
        eng.backward(eng(ids, tg))
        eng.step()
    finally:
        eng.close()


def test_backward_again_after_a_failed_early_step_is_refused(tmp_path: Path) -> None:
    """A backward that failed with the step begun during it (overlap_step) leaves that
    boundary's step abandoned: another backward on the boundary is refused (it would begin
    a second step over units already updated) until step() skips it; then training goes
    on, the scheduler idle."""
    cfg = dataclasses.replace(make_config(), offload=OffloadConfig(
        optimizer=OptimizerOffloadConfig(device="cpu", overlap_step=True)))
    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    try:
        fail = {"on": True}

        def boom(*_: object) -> None:
            if fail["on"]:
                raise RuntimeError("injected backward failure")

        handle = model.blocks[0].register_full_backward_hook(boom)
        ids, tg = make_batches(1)[0]
        with pytest.raises(RuntimeError, match="injected backward failure"):
            eng.backward(eng(ids, tg))
        assert eng.step_driver.step_open is False
        fail["on"] = False
        loss = eng(ids, tg)
        with pytest.raises(TrainingStateError, match=r"ABANDONED.*call eng\.step"):
            eng.backward(loss)
        assert eng.scheduler.state is PassState.IDLE
        eng.step()  # skipped
        assert eng.skipped_steps == 1 and eng.global_steps == 0
        handle.remove()
        eng.backward(eng(ids, tg))
        eng.step()
        assert eng.global_steps == 1
    finally:
        eng.close()
