"""The engine on a CUDA device: shards and gathered params on the GPU, parity with plain
PyTorch on the same GPU.

Tolerances: both sides run the same cuBLAS kernels in fp32 (TF32 off, torch's default
for matmul), so they differ only in summation order as on the CPU; the CPU bounds
are kept with 10x margin for GPU reduction kernels: params 1e-4, losses 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import make_batches, make_config, make_model, train_steps

from tierzero import engine

pytestmark = pytest.mark.cuda
STEPS = 10


def _reference(cfg: engine.Config, batches: list[tuple[torch.Tensor, torch.Tensor]],
               ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch AdamW on the GPU with cfg's optimizer, accumulation and clipping."""
    model = copy.deepcopy(make_model()).cuda()
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay)
    gas = cfg.batch.gradient_accumulation_steps or 1
    losses = []
    for i, (ids, tg) in enumerate(batches):
        loss = model(ids.cuda(), tg.cuda())
        (loss / gas).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % gas == 0:
            if cfg.gradient_clipping > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.gradient_clipping)
            opt.step()
            opt.zero_grad()
    return losses, {k: v.detach().float().cpu() for k, v in model.named_parameters()}


def _engine(cfg: engine.Config, batches: list[tuple[torch.Tensor, torch.Tensor]],
            ) -> tuple[list[float], dict[str, torch.Tensor], engine.ZeroEngine]:
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=cfg)
    losses = train_steps(eng, batches, loss_device="cuda")  # CPU batches, moved by the engine
    with engine.GatheredParameters(list(model.parameters())):
        params = {k: v.detach().float().cpu() for k, v in model.named_parameters()}
    return losses, params, eng


def test_cuda_fp32_matches_pytorch_on_gpu() -> None:
    cfg = make_config(gas=2, clip=0.5)
    batches = make_batches(STEPS * 2)
    ref_losses, ref = _reference(cfg, batches)
    losses, got, eng = _engine(cfg, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                               atol=0)
    for k, want in ref.items():
        torch.testing.assert_close(got[k], want, rtol=0, atol=1e-4, msg=k)
    for key in eng.store.group_keys():
        assert eng.store.tensor(key, "param").device.type == "cuda"
        assert eng.store.tensor(key, "exp_avg").device.type == "cuda"
    assert all(p.numel() == 0 and p.device.type == "cuda" for p in eng.module.parameters())
    eng.close()


def test_cuda_bf16_tracks_fp32() -> None:
    batches = make_batches(STEPS)
    ref_losses, _ = _reference(make_config(clip=0.5), batches)
    losses, _, eng = _engine(make_config(precision="bf16", clip=0.5), batches)
    diff = (torch.tensor(losses) - torch.tensor(ref_losses)).abs().max()
    assert float(diff) < 0.03  # same bound as the CPU bf16 test
    assert eng.memory_report()["shard_bytes"]["param"] * 2 == (
        eng.memory_report()["shard_bytes"]["master"])
    eng.close()
