"""The streamed CPU Adam's group order follows the order gradients turn final in backward
([Note: step order learned from backward] in offload/step_seam.py).

A model whose root (embedding, final norm, head) is cut into pieces: the head's piece is
final at the start of backward, the embedding's at the end. Before any step the order is
the blocks last to first with the root last; after one step the head leads and the
embedding closes it, and training is bitwise the same as with the order pinned (the Adam
update of a group does not depend on when it runs), and within the usual parity
tolerance of plain PyTorch AdamW (engine_helpers.PARAM_ATOL, LOSS_RTOL). With clipping
the update is deferred into the next forward and follows that forward's order instead
([Note: deferred streamed step] in engine/step/deferred_stream.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    SEQ,
    TinyLM,
    assert_match,
    full_params,
    make_config,
    offload_config,
    reference_train,
    train_steps,
)

from tierzero import engine
from tierzero.engine.config import Config
from tierzero.engine.step.offloaded import OffloadedStep
from tierzero.engine.step.offloaded_adam import OffloadedAdam

BIG_VOCAB = 256  # embedding and head 8192 elements each: larger than a block (4256)


def big_root_model(*, tied: bool = False) -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM(3, vocab=BIG_VOCAB)
    if tied:
        model.head.weight = model.emb.weight
    return model


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(0, BIG_VOCAB, (4, SEQ), generator=g)
        out.append((ids, (ids * 7 + 3) % BIG_VOCAB))
    return out


def group_of(eng: engine.ZeroEngine, qname: str) -> str:
    """The trainable group key holding parameter `qname` (a root piece)."""
    for unit in eng.units:
        for g in unit.groups:
            if g.trainable and any(s.qname == qname for s in g.slots):
                return g.key
    raise AssertionError(f"no group holds {qname}")


def nvme_config(tmp_path: Path, *, clip: float = 0.0) -> Config:
    return offload_config(make_config(clip=clip), "nvme", tmp_path)


@pytest.mark.parametrize("clip", [0.0, 0.5])  # early step during backward / in the next forward
def test_order_follows_backward_after_the_first_step(tmp_path: Path, clip: float) -> None:
    model = big_root_model()
    data = batches(6)
    cfg = nvme_config(tmp_path, clip=clip)
    ref = reference_train(model, cfg, [data], len(data))
    eng, opt, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    try:
        assert isinstance(opt, OffloadedAdam)
        head, emb = group_of(eng, "head.weight"), group_of(eng, "emb.weight")
        assert head != emb  # the root is cut into pieces
        before = eng.step_driver.step_order
        assert before.index(head) > before.index(emb) > before.index(
            group_of(eng, "blocks.0.up.weight"))  # root last, as constructed
        losses = train_steps(eng, data[:1])
        after = eng.step_driver.step_order
        if clip:  # the update runs during the next forward, in its order ([Note: deferred
            # streamed step] in engine/step/deferred_stream.py): the root first
            assert after == eng.scheduler.forward_keys() and after[0] == emb, after
        else:
            blocks = [group_of(eng, f"blocks.{i}.up.weight") for i in (2, 1, 0)]
            assert [k for k in after if k in blocks] == blocks  # last block first
            # the head's pieces (weight, bias; the final norm's) before every block, the
            # embedding last
            assert max(after.index(group_of(eng, q)) for q in (
                "head.weight", "head.bias", "norm.weight")) < after.index(blocks[0]), after
            assert after[-1] == emb, after
            assert after == eng.scheduler.final_order
        losses += train_steps(eng, data[1:])
        assert eng.step_driver.step_order == after  # stable: no further change
        got = full_params(eng, model)
    finally:
        eng.close()
    assert_match(losses, got, ref.losses, ref.params, initial=big_root_model())


def test_learned_order_changes_nothing_but_the_order(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Bitwise the same parameters as with the construction order pinned."""
    data = batches(5)
    runs = []
    for pinned in (False, True):
        if pinned:
            monkeypatch.setattr(OffloadedStep, "_follow_backward_order", lambda self, seen: None)
        model = big_root_model()
        (tmp_path / str(pinned)).mkdir()
        eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                         config=nvme_config(tmp_path / str(pinned)))
        try:
            train_steps(eng, data)
            runs.append((eng.step_driver.step_order, full_params(eng, model)))
        finally:
            eng.close()
    (learned, p_learned), (pinned_order, p_pinned) = runs
    assert learned != pinned_order
    assert all(torch.equal(p_learned[k], p_pinned[k]) for k in p_pinned)


def test_a_failure_applying_the_order_leaves_the_step_counted_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The learned order is applied after the step's update: a failure there (a write the
    runner settles while it drains) is logged, not raised into step(), so the optimizer,
    the lr scheduler and the engine count the step alike, and training goes on with the
    runner's old order (bitwise the run with the order pinned)."""
    from tierzero.engine.step.streamed import StreamedStep
    from tierzero.offload import OffloadError

    data = batches(3)
    runs = []
    for broken in (True, False):
        model = big_root_model()
        (tmp_path / str(broken)).mkdir()
        eng, opt, _, _ = engine.initialize(device="cpu", model=model,
                                           config=nvme_config(tmp_path / str(broken)))
        tried: list[list[str]] = []
        if broken:
            def failing(self: StreamedStep, keys: list[str], into: list[Any] = tried) -> bool:
                into.append(list(keys))
                raise OffloadError("injected: a write failed while the stream drained")

            monkeypatch.setattr(StreamedStep, "set_order", failing)
        else:
            monkeypatch.setattr(OffloadedStep, "_follow_backward_order",
                                lambda self, seen: None)
        try:
            assert isinstance(opt, OffloadedAdam)
            before = eng.step_driver.runner.order  # type: ignore[attr-defined]
            train_steps(eng, data[:1])
            assert eng.global_steps == opt.steps == 1
            assert eng.lr_scheduler.last_epoch == 1
            train_steps(eng, data[1:])
            sched: Any = eng.lr_scheduler
            assert eng.global_steps == opt.steps == sched.last_epoch == 3
            assert eng.step_driver.runner.order == before  # type: ignore[attr-defined]
            assert bool(tried) is broken
            runs.append(full_params(eng, model))
        finally:
            eng.close()
        monkeypatch.undo()
    assert all(torch.equal(runs[0][k], v) for k, v in runs[1].items())


def test_tied_embedding_and_head_is_final_last(tmp_path: Path) -> None:
    """A weight used by both the embedding and the head gets its gradient from both ends of
    backward: its group is final last, after every block."""
    model = big_root_model(tied=True)
    eng, opt, _, _ = engine.initialize(device="cpu", model=model, config=nvme_config(tmp_path))
    try:
        train_steps(eng, batches(2))
        assert isinstance(opt, OffloadedAdam)
        assert eng.step_driver.step_order[-1] == group_of(eng, "emb.weight")
        assert eng.step_driver.step_order[0] == group_of(eng, "head.bias")
    finally:
        eng.close()


def test_a_new_order_is_taken_only_when_two_steps_agree(tmp_path: Path) -> None:
    """The first order seen is taken at once; afterwards a different order seen once (a
    step with other control flow) is not, the same new order seen twice in a row is."""
    model = big_root_model()
    eng, opt, _, _ = engine.initialize(device="cpu", model=model, config=nvme_config(tmp_path))
    try:
        assert isinstance(opt, OffloadedAdam)
        train_steps(eng, batches(1))
        driver = eng.step_driver
        assert isinstance(driver, OffloadedStep)
        learned = driver.step_order
        other = list(reversed(learned))
        driver._follow_backward_order(other)
        assert driver.step_order == learned  # seen once: kept
        driver._follow_backward_order(learned)
        driver._follow_backward_order(other)
        assert driver.step_order == learned  # alternating: kept
        driver._follow_backward_order(other)
        assert driver.step_order == other  # twice in a row: taken
        train_steps(eng, batches(2))  # and the stream runs with it
    finally:
        eng.close()
