"""Late gradients on a CUDA device: reentrant checkpoint segments sharing parameters, the
engine's shards (or its gathered params with host-homed optimizer state) on the GPU,
against plain PyTorch on the same GPU. On CUDA, AccumulateGrad runs on autograd's device
thread, and the early optimizer step's worker beside it.

Tolerances: as tests/engine/test_engine_cuda.py (same cuBLAS kernels in fp32, TF32 off; the
CPU bounds with 10x margin for GPU reduction kernels): params 1e-4, losses 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_batches, train_steps
from lategrad_helpers import make_shared_model, shared_config, shared_reference

from tierzero import engine

pytestmark = pytest.mark.cuda
STEPS = 6


@pytest.mark.parametrize(("offload", "gas", "overlap_step"),
                         [("none", 2, False), ("cpu", 1, True), ("nvme", 2, False)])
def test_cuda_shared_segments_match_pytorch_on_gpu(offload: str, gas: int, overlap_step: bool,
                                                   tmp_path: Path) -> None:
    clip = 0.0 if overlap_step else 0.5  # clipping turns the early step off
    cfg = shared_config(gas=gas, clip=clip, offload=offload, path=tmp_path,
                        overlap_step=overlap_step)
    batches = make_batches(STEPS * gas)
    ref = shared_reference(make_shared_model(), cfg, [batches], STEPS, device="cuda")
    model = make_shared_model()
    eng, _, _, _ = engine.initialize(model=model, config=cfg)
    losses = train_steps(eng, batches, loss_device="cuda")  # CPU batches, moved by the engine
    with engine.GatheredParameters(list(model.parameters())):
        params = {k: v.detach().float().cpu() for k, v in model.named_parameters()}
    assert eng.memory_report()["late_gradients"] >= 3 * STEPS * gas
    eng.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-5,
                               atol=0)
    for k, want in ref.params.items():
        torch.testing.assert_close(params[k], want, rtol=0, atol=1e-4, msg=k)
