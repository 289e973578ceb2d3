"""zero_grad() marks the fp32 gradient shards instead of writing zeros ([Note: gradients zeroed
on first use] in engine/shards/store.py): every reader must still see zeros.

Each test first trains a step, so the shards hold non-zero gradients that a missed zeroing
would leak: into a step with no backward, into a checkpoint saved mid-accumulation, and over
gradients a checkpoint load restored. Exactness: bitwise (torch.equal) against the same
engine path with explicit zeros, or against the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import full_params, make_batches, make_config, make_model, offload_config

from tierzero import engine
from tierzero.engine.config import Config


def config(offload: str, tmp_path: Path, *, gas: int = 1) -> Config:
    cfg = make_config(gas=gas)
    return cfg if offload == "none" else offload_config(cfg, offload, tmp_path)


def grads(eng: engine.ZeroEngine) -> dict[str, torch.Tensor]:
    out = {}
    for k in eng._train_keys:
        with eng.store.use(k, "grad") as g:
            out[k] = g.clone()
    return out


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_step_without_backward_sees_zero_gradients(offload: str, tmp_path: Path) -> None:
    """step() right after a step (no backward): Adam with zero gradients, i.e. only weight
    decay and the moments' decay; the same as writing the zeros by hand first."""
    runs = []
    for explicit in (False, True):
        (tmp_path / str(explicit)).mkdir()
        model = make_model()
        eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                         config=config(offload, tmp_path / str(explicit)))
        try:
            ids, tg = make_batches(1)[0]
            eng.backward(eng(ids, tg))
            eng.step()  # leaves non-zero values in the shards, marked zero
            if explicit:
                for k in eng._train_keys:
                    with eng.store.use(k, "grad", overwrite=True) as g:
                        g.zero_()
            eng.step()
            runs.append(full_params(eng, model))
        finally:
            eng.close()
    marked, explicit_zeros = runs
    assert all(torch.equal(marked[k], explicit_zeros[k]) for k in marked)


def test_zero_grad_writes_nothing_until_read(tmp_path: Path) -> None:
    """The mark, not a memset: the old values stay in the shard (seen through views the
    plain store keeps valid) until its first use, which hands out zeros and writes them."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=config("none", tmp_path))
    try:
        ids, tg = make_batches(1)[0]
        eng.backward(eng(ids, tg))
        before = grads(eng)
        with eng.store.use(eng._train_keys[0], "grad") as view:  # the shard itself
            pass
        eng.zero_grad()
        assert all(eng.store.grad_zeroed(k) for k in eng._train_keys)
        assert torch.equal(view, before[eng._train_keys[0]]) and view.any()  # not written
        assert all(not v.any() for v in grads(eng).values())  # first use: zeros
        assert not view.any()  # written into the shard, the marks taken
        assert not any(eng.store.grad_zeroed(k) for k in eng._train_keys)
    finally:
        eng.close()


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_checkpoint_mid_accumulation_after_zero_grad_holds_zeros(offload: str,
                                                                 tmp_path: Path) -> None:
    """A save mid-accumulation keeps the partial gradients; after a user's zero_grad() those
    are zeros, not the values the shards still hold."""
    (tmp_path / "swap").mkdir()
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=config(offload, tmp_path / "swap", gas=2))
    try:
        ids, tg = make_batches(1)[0]
        eng.backward(eng(ids, tg))
        eng.step()  # micro-step 1 of 2: partial gradients in the shards
        assert any(v.any() for v in grads(eng).values())
        eng.zero_grad()
        eng.save_checkpoint(tmp_path / "ckpt")
    finally:
        eng.close()
    (tmp_path / "swap2").mkdir()
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=config(offload, tmp_path / "swap2", gas=2))
    try:
        eng.load_checkpoint(tmp_path / "ckpt")
        assert eng.micro_steps == 1
        assert all(not v.any() for v in grads(eng).values())
    finally:
        eng.close()


def test_loaded_partial_gradients_are_kept_after_zero_grad(tmp_path: Path) -> None:
    """An engine whose shards zero_grad() just marked loads a mid-accumulation checkpoint:
    the restored partial gradients are accumulated into, not overwritten by the next
    reduction; the run ends bitwise where the uninterrupted run does."""
    batches = make_batches(4)

    def train(eng: engine.ZeroEngine, micro: range) -> None:
        for m in micro:
            eng.backward(eng(*batches[m]))
            eng.step()

    cfg = config("none", tmp_path, gas=2)
    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    train(eng, range(3))  # a full step, then micro-step 1 of the second
    eng.save_checkpoint(tmp_path / "ckpt")
    train(eng, range(3, 4))
    want = full_params(eng, model)
    eng.close()

    model = make_model(seed=5)
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    try:
        train(eng, range(2))  # a boundary: zero_grad() has marked every shard
        assert all(eng.store.grad_zeroed(k) for k in eng._train_keys)
        eng.load_checkpoint(tmp_path / "ckpt")
        assert not any(eng.store.grad_zeroed(k) for k in eng._train_keys)
        train(eng, range(3, 4))
        got = full_params(eng, model)
    finally:
        eng.close()
    assert all(torch.equal(got[k], want[k]) for k in want)
