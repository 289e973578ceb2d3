"""Checkpoints of offloaded state with a CUDA device: params gathered on the GPU, shards on
host / NVMe through the tier manager. Save, load into a fresh engine, continue: bit-identical
to continuing the original (as tests/engine/checkpoint/test_ckpt_cuda.py for resident shards)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_helpers import resume_config, run_cuda_steps
from engine_helpers import full_params, make_batches, make_model

from tierzero import engine


@pytest.mark.cuda
@pytest.mark.parametrize("offload", ["cpu", "nvme", "params_nvme"])
def test_cuda_offloaded_save_load_resume_is_exact(tmp_path: Path, offload: str) -> None:
    batches = make_batches(8)
    model = make_model()
    cfg = resume_config("bf16", 1, offload, str(tmp_path / "swap1"))
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cuda")
    run_cuda_steps(eng, batches[:4])
    pending = eng.save_checkpoint(tmp_path / "ck", background=True)
    assert not isinstance(pending, Path)  # written while the next steps run
    want_draws = run_cuda_steps(eng, batches[4:])
    want = full_params(eng, model)
    eng.close()

    model2 = make_model(seed=3)
    cfg2 = resume_config("bf16", 1, offload, str(tmp_path / "swap2"))
    eng2, _, _, _ = engine.initialize(model=model2, config=cfg2, device="cuda")
    eng2.load_checkpoint(tmp_path / "ck")
    got_draws = run_cuda_steps(eng2, batches[4:])
    got = full_params(eng2, model2)
    eng2.close()
    assert got_draws == want_draws
    bad = [k for k in want if not torch.equal(want[k], got[k])]
    assert not bad, bad


@pytest.mark.cuda
def test_cuda_init_onto_nvme_equals_plain_build(tmp_path: Path) -> None:
    """engine.Init onto NVMe, then initialize on the GPU: gathered values equal a plain
    build with the same seed."""
    cfg = resume_config("fp32", 1, "nvme", str(tmp_path / "swap"))
    ref = make_model()
    with engine.Init(config=cfg):
        model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cuda")
    try:
        got = full_params(eng, model)
        assert all(torch.equal(got[k].cpu(), v.detach()) for k, v in ref.named_parameters())
    finally:
        eng.close()
