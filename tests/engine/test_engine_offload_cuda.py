"""Offload with a CUDA device: param shards homed on host / NVMe are copied host->device
by the tier manager for each gather, the CPU Adam updates state in (pinned) host memory or
NVMe, and the result matches plain PyTorch AdamW on the same GPU.

Tolerances: as tests/engine/test_engine_cuda.py (params 1e-4, losses 1e-5: the CPU bounds with
10x margin for GPU reduction kernels); the CPU Adam's one-ulp differences from torch's
AdamW (tests/offload/test_offload_adam_kernel.py) are far below them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_batches, make_config, offload_config
from test_engine_cuda import _engine, _reference

pytestmark = pytest.mark.cuda
STEPS = 10


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_cuda_offload_matches_pytorch_on_gpu(device: str, tmp_path: Path) -> None:
    cfg = offload_config(make_config(gas=2, clip=0.5), device, tmp_path)
    batches = make_batches(STEPS * 2)
    ref_losses, ref = _reference(cfg, batches)
    losses, got, eng = _engine(cfg, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                               atol=0)
    for k, want in ref.items():
        torch.testing.assert_close(got[k], want, rtol=0, atol=1e-4, msg=k)
    rep = eng.memory_report()
    tiers = rep["tiers"]
    assert tiers["moved"]["host_to_device"] > 0  # gathers fed from host copies
    assert tiers["peak"]["device"] <= tiers["budget"]["device"]
    assert rep["optimizer_step"]["shards"] == 5
    if device == "nvme":
        assert tiers["moved"]["nvme_to_host"] > 0
    assert all(p.numel() == 0 and p.device.type == "cuda" for p in eng.module.parameters())
    eng.close()


def test_cuda_offload_bf16_tracks_fp32(tmp_path: Path) -> None:
    batches = make_batches(STEPS)
    ref_losses, _ = _reference(make_config(clip=0.5), batches)
    cfg = offload_config(make_config(precision="bf16", clip=0.5), "nvme", tmp_path)
    losses, _, eng = _engine(cfg, batches)
    diff = (torch.tensor(losses) - torch.tensor(ref_losses)).abs().max()
    assert float(diff) < 0.03  # same bound as the CPU bf16 test
    eng.close()
