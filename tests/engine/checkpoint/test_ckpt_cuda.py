"""Checkpoints of an engine whose shards live on a CUDA device: save, load into a fresh
engine, continue; bit-identical to continuing the original (CUDA RNG state included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_helpers import run_cuda_steps
from engine_helpers import full_params, make_batches, make_config, make_model

from tierzero import engine


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_save_load_resume_is_exact(tmp_path: Path, precision: str) -> None:
    batches = make_batches(8)
    cfg = make_config(precision=precision, clip=0.5)
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cuda")
    assert eng.store.tensor(eng._train_keys[0], "master").is_cuda
    run_cuda_steps(eng, batches[:4])
    eng.save_checkpoint(tmp_path)
    want_draws = run_cuda_steps(eng, batches[4:])
    want = full_params(eng, model)
    eng.close()

    model2 = make_model(seed=3)
    eng2, _, _, _ = engine.initialize(model=model2, config=cfg, device="cuda")
    eng2.load_checkpoint(tmp_path)
    got_draws = run_cuda_steps(eng2, batches[4:])
    got = full_params(eng2, model2)
    eng2.close()
    assert got_draws == want_draws
    bad = [k for k in want if not torch.equal(want[k], got[k])]
    assert not bad, bad
    sd = engine.consolidate(tmp_path)
    assert set(sd) == set(want)
