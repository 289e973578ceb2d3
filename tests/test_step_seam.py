"""The optimizer-step seam's small owners (offload/step_seam.py), without an engine."""

from __future__ import annotations

import pytest

from tierzero.offload.step_seam import StepOrder

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
