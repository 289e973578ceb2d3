"""Late gradients and the optimizer step begun during backward (offload.optimizer.overlap_step).

A group handed to the early step must not change afterwards ([Note: late gradients] in
engine/late_grads.py). The engine withholds what may still change: everything in the
first backward whose forward ran a reentrant segment (it learns which groups get late
gradients), the learned groups after. A late gradient the forward did not announce, on
a group already handed over, raises LateGradientError; the step is skipped.

Tolerances: engine_helpers.PARAM_ATOL / LOSS_RTOL (see test_lategrad_parity.py); the
in-place kernel is elementwise, so overlap_step on and off give identical bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import assert_match, full_params, make_batches
from lategrad_helpers import RootSegmentLM, make_shared_model, shared_config, shared_reference
from torch import nn

from tierzero import engine
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.step.offloaded import OffloadedStep

STEPS = 5


def _spy_handed(eng: ZeroEngine) -> list[tuple[int, str]]:
    """(micro-step, group key) of every group given to the early step, in order."""
    opt = eng.step_driver
    assert isinstance(opt, OffloadedStep)
    seen: list[tuple[int, str]] = []
    real = opt.groups_final

    def spy(keys: list[str]) -> None:
        seen.extend((eng.micro_steps, k) for k in keys)
        real(keys)

    opt.groups_final = spy  # type: ignore[method-assign]
    return seen


def _train(eng: ZeroEngine, model: nn.Module,
           steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = []
    for ids, tg in make_batches(steps):
        loss = eng(ids, tg)
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
    return losses, full_params(eng, model)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_early_step_withholds_groups_with_late_gradients(offload: str, tmp_path: Path) -> None:
    cfg = shared_config(clip=0.0, offload=offload, path=tmp_path, overlap_step=True)
    model = make_shared_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    handed = _spy_handed(eng)
    losses, params = _train(eng, model, STEPS)
    late = eng.memory_report()["late_gradients"]
    eng.close()
    assert late >= 3 * STEPS
    # the first backward probes (nothing handed over); from the second on, the blocks
    # whose gradients arrive once are updated during backward, never those that get
    # late gradients (blocks 0 and 2, the root with the embedding)
    assert handed and min(step for step, _ in handed) == 1
    assert {k for _, k in handed} == {"blocks.1/float32/trainable", "blocks.3/float32/trainable"}
    ref = shared_reference(make_shared_model(), cfg, [make_batches(STEPS)], STEPS)
    assert_match(losses, params, ref.losses, ref.params)
    (tmp_path / "off").mkdir()
    off = shared_config(clip=0.0, offload=offload, path=tmp_path / "off", overlap_step=False)
    model = make_shared_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=off)
    off_losses, off_params = _train(eng, model, STEPS)
    eng.close()
    assert off_losses == losses
    assert all(torch.equal(off_params[k], params[k]) for k in params)


def _root_segment_model() -> RootSegmentLM:
    torch.manual_seed(0)
    return RootSegmentLM(4)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_unannounced_late_gradient_on_a_handed_group_raises(offload: str,
                                                            tmp_path: Path) -> None:
    """The root's only reentrant segment holds no unit, so the forward does not announce
    a nested backward: the root's group is reduced (the segment's backward fires the
    embedding weight) and handed over before the lookup's gradient arrives."""
    cfg = shared_config(clip=0.0, offload=offload, path=tmp_path, overlap_step=True)
    model = _root_segment_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    opt = eng.step_driver
    try:
        handed = _spy_handed(eng)
        ids, tg = make_batches(1)[0]
        with pytest.raises(engine.LateGradientError) as err:
            eng.backward(eng(ids, tg))
        msg = str(err.value)
        for part in ("'emb.weight'", "unit '<root>'", "'<root>/float32/trainable'",
                     "overlap_step: false", "use_reentrant=False"):
            assert part in msg, (part, msg)
        assert isinstance(opt, OffloadedStep) and not opt.step_open
        eng.step()  # this boundary's step is skipped
        assert eng.skipped_steps == 1 and eng.global_steps == 0
        assert ("<root>/float32/trainable") in {k for _, k in handed}
        # from now on the root is withheld: training goes on without the error
        handed.clear()
        for ids, tg in make_batches(3, seed=5):
            eng.backward(eng(ids, tg))
            eng.step()
        assert eng.global_steps == 3 and eng.memory_report()["late_gradients"] == 4
        assert handed and "<root>/float32/trainable" not in {k for _, k in handed}
    finally:
        eng.close()


def test_unannounced_late_gradient_without_overlap_step_is_exact() -> None:
    """The same model without the early step: the late gradient is reduced at the end of
    backward, and training matches plain PyTorch."""
    cfg = shared_config(clip=0.5, offload="cpu", overlap_step=False)
    batches = make_batches(STEPS)
    ref = shared_reference(_root_segment_model(), cfg, [batches], STEPS)
    model = _root_segment_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    losses, params = _train(eng, model, STEPS)
    assert eng.memory_report()["late_gradients"] == STEPS
    eng.close()
    assert_match(losses, params, ref.losses, ref.params)


def test_changed_unit_order_probes_again(tmp_path: Path) -> None:
    """Dynamic control flow: from step 3 block 1 (so far updated during backward) is the
    shared one. The unit order changes, so the next backward probes again instead of
    handing block 1 over and then failing on its late gradient; training matches plain
    PyTorch run through the same change."""
    cfg = shared_config(clip=0.0, offload="cpu", overlap_step=True)
    change = ((0, 1), 1, (2, 3, 1))  # block 1 plain and in segments A and B
    model, ref_model = make_shared_model(), make_shared_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    handed = _spy_handed(eng)
    o = cfg.optimizer
    opt = torch.optim.AdamW(ref_model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay)
    losses, ref_losses = [], []
    for step, (ids, tg) in enumerate(make_batches(STEPS)):
        if step == 2:
            model.plan = ref_model.plan = change
        loss = eng(ids, tg)
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
        ref_loss = ref_model(ids, tg)
        ref_loss.backward()
        ref_losses.append(float(ref_loss.detach()))
        for p in ref_model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    params = full_params(eng, model)
    assert eng.scheduler.trace_changes == 1
    eng.close()
    steps_handed = {step: {k for s, k in handed if s == step} for step in range(STEPS)}
    assert steps_handed[0] == set() and steps_handed[2] == set()  # the probes
    assert "blocks.1/float32/trainable" in steps_handed[1]
    assert steps_handed[3] == steps_handed[4] == {"blocks.3/float32/trainable"}
    assert_match(losses, params, ref_losses,
                 {k: v.detach() for k, v in ref_model.named_parameters()})
