"""The engine's NVMe staging pool is sized for parameter gathers only (bf16 param),
so every fp32 optimizer shard is larger than one pool buffer: initial placement, Init
onto NVMe and checkpoint save/load of NVMe state stage those shards over a span of
buffers ([Note: pool spans]). Results are compared bit for bit (torch.equal): the same
kernels see the same bytes, so any staging error shows up as a difference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import TinyLM, make_batches, train_steps

from tierzero import engine
from tierzero.offload import BufferPool, PoolBuffer

N_BLOCKS, DIM = 2, 128  # blocks of ~66K params: fp32 master 264 KB, bf16 param 132 KB


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(N_BLOCKS, DIM)


def _cfg(swap: Path) -> engine.Config:
    swap.mkdir(parents=True, exist_ok=True)
    return engine.load_config({
        "zero": {"stage": 3, "units": ["Block"], "persistence_threshold_bytes": 0},
        "precision": "bf16",
        "optimizer": {"type": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "offload": {"device": "nvme", "path": str(swap)}})


def _params(model: TinyLM) -> dict[str, torch.Tensor]:
    with engine.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.named_parameters()}


def _pool_smaller_than_masters(eng: engine.ZeroEngine) -> None:
    mgr = eng.store.manager  # type: ignore[attr-defined]
    plan = mgr.plan
    masters = [s.nbytes for k, s in plan.specs.items() if s.cls == "master"
               and plan.homes[k] == "nvme"]
    p16 = [s.nbytes for k, s in plan.specs.items() if s.cls == "param"]
    assert plan.pool_buffer_bytes < max(masters), "the test must exercise pool spans"
    assert plan.pool_buffer_bytes >= max(p16)  # a gather fits one buffer
    mgr.audit()


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The span (buffers) of every pool acquisition larger than one buffer."""
    seen: list[int] = []
    real = BufferPool.try_acquire

    def spy(self: BufferPool, nbytes: int = 0) -> PoolBuffer | None:
        buf = real(self, nbytes)
        if buf is not None and buf.span > 1:
            seen.append(buf.span)
        return buf

    monkeypatch.setattr(BufferPool, "try_acquire", spy)
    return seen


def test_checkpoint_of_nvme_state_through_a_pool_smaller_than_a_master(
        tmp_path: Path, spans: list[int]) -> None:
    batches = make_batches(6)
    model = _model()
    eng, _, _, _ = engine.initialize(model=model, config=_cfg(tmp_path / "s1"), device="cpu")
    _pool_smaller_than_masters(eng)
    train_steps(eng, batches[:3])
    placed = len(spans)
    assert placed > 0  # initial placement staged masters over spans
    eng.save_checkpoint(tmp_path / "ckpt")
    assert len(spans) > placed  # so did the save
    want_losses = train_steps(eng, batches[3:])
    want = _params(model)
    eng.close()

    model2 = _model()
    eng2, _, _, _ = engine.initialize(model=model2, config=_cfg(tmp_path / "s2"), device="cpu")
    train_steps(eng2, batches[:1])  # state to be overwritten by the load
    before_load = len(spans)
    eng2.load_checkpoint(tmp_path / "ckpt")
    assert len(spans) > before_load  # and the load
    _pool_smaller_than_masters(eng2)
    assert train_steps(eng2, batches[3:]) == want_losses
    got = _params(model2)
    eng2.close()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the run moved the parameters after the save, or the comparison proves little
    state = engine.consolidate(tmp_path / "ckpt")
    assert any(not torch.equal(state[k].to(want[k].dtype), want[k]) for k in want)


def test_init_onto_nvme_through_a_pool_smaller_than_a_master(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "swap")
    with engine.Init(config=cfg):
        model = _model()
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    _pool_smaller_than_masters(eng)
    batches = make_batches(3)
    got_losses = train_steps(eng, batches)
    got = _params(model)
    eng.close()
    ref = _model()
    eng_ref, _, _, _ = engine.initialize(model=ref, config=_cfg(tmp_path / "ref"), device="cpu")
    assert train_steps(eng_ref, batches) == got_losses
    want = _params(ref)
    eng_ref.close()
    assert all(torch.equal(got[k], want[k]) for k in want)
