"""The optimizer-step seam's small owners (offload/step_seam.py), without an engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from engine_helpers import make_batches, make_config, make_model, offload_config

from tierzero import engine
from tierzero.engine.config.schema import OffloadConfig, OptimizerOffloadConfig
from tierzero.engine.schedule import PassState
from tierzero.offload.step_seam import (
    STEP_TRANSITIONS,
    GroupState,
    StepOrder,
    StepState,
    StoreTensor,
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


class _Held:
    """A TensorSource over a tensor already in memory."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def read_into(self, out: torch.Tensor) -> None:
        out.copy_(self.t)

    def stored_as(self) -> None:
        return None  # fp32 values only

    def read_stored_into(self, out: torch.Tensor) -> None:
        raise AssertionError("a source with no stored form is read with read_into")


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_each_driver_saves_and_loads_its_own_state(offload: str, tmp_path: Path) -> None:
    """state_dict() names the store's moments (StoreTensors, nothing copied) and the step
    in the same form for both drivers; load_state_dict() reads each group's moments back
    into the store through their sources and takes the step and hyper-parameters."""
    cfg = make_config() if offload == "none" else offload_config(make_config(), offload,
                                                                tmp_path)
    eng, opt, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
    try:
        for ids, tg in make_batches(2):
            eng.backward(eng(ids, tg))
            eng.step()
        state = eng.step_driver.state_dict()
        assert list(state["state"]) == eng._train_keys
        for key, group in state["state"].items():
            assert group.shards == {k: StoreTensor(key, k) for k in ("exp_avg", "exp_avg_sq")}
            assert group.tensors == {}
            assert group.scalars == {"step": {"tensor": 2.0, "dtype": "torch.float32"}}
        assert state["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]
        saved = {}
        for key in eng._train_keys:
            for kind in ("exp_avg", "exp_avg_sq"):
                with eng.store.use(key, kind) as t:  # type: ignore[arg-type]
                    saved[key, kind] = t.detach().clone()
                    assert t.any()
        eng.step_driver.load_state_dict({
            "param_groups": [{**state["param_groups"][0], "lr": 0.5}],
            "state": {key: GroupState(
                shards={k: _Held(torch.full_like(saved[key, k], 0.25))
                        for k in ("exp_avg", "exp_avg_sq")},
                scalars={"step": {"tensor": 7.0, "dtype": "torch.float32"}})
                for key in eng._train_keys}})
        assert opt.param_groups[0]["lr"] == 0.5
        again = eng.step_driver.state_dict()["state"]
        assert all(g.scalars["step"]["tensor"] == 7.0 for g in again.values())
        for key in eng._train_keys:
            for kind in ("exp_avg", "exp_avg_sq"):
                with eng.store.use(key, kind) as t:  # type: ignore[arg-type]
                    assert bool((t == 0.25).all()), (key, kind)
    finally:
        eng.close()
