"""The streamed CPU Adam with a CUDA device ([Note: streamed optimizer step]): state on
NVMe streamed through a pinned host ring, the new param written to the GPU (params on
the device) or to NVMe, the step begun during backward (overlap_step), against plain
PyTorch AdamW on the same GPU.

Tolerances: as tests/engine/test_engine_offload_cuda.py (params 1e-4 absolute, losses 1e-5
relative: the CPU parity bounds with 10x margin for GPU reduction kernels).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from engine_helpers import make_batches, make_config, stream_of
from test_engine_cuda import _engine, _reference

from tierzero.engine.config.schema import (
    BudgetsConfig,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)
from tierzero.engine.step.offloaded import OffloadedStep

pytestmark = pytest.mark.cuda
STEPS = 8


@pytest.mark.parametrize("params", ["none", "nvme"])
@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_streamed_step_matches_pytorch(params: str, overlap: bool,
                                            tmp_path: Path) -> None:
    gas = 2
    cfg = dataclasses.replace(make_config(gas=gas), offload=OffloadConfig(
        params=ParamOffloadConfig(device=params,  # type: ignore[arg-type]
                                  path=str(tmp_path) if params == "nvme" else None),
        optimizer=OptimizerOffloadConfig(device="nvme", path=str(tmp_path),
                                         overlap_step=overlap),
        budgets=BudgetsConfig(device_bytes=64 << 20)))
    batches = make_batches(STEPS * gas)
    ref_losses, ref = _reference(cfg, batches)
    losses, got, eng = _engine(cfg, batches)
    try:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        for k, want in ref.items():
            torch.testing.assert_close(got[k], want, rtol=0, atol=1e-4, msg=k)
        opt = eng.step_driver
        assert isinstance(opt, OffloadedStep) and stream_of(opt) is not None
        assert stream_of(opt)._ring.arena.is_pinned()  # CUDA: the ring is page-locked
        tiers = eng.memory_report()["tiers"]
        assert tiers["moved"]["nvme_to_host"] > 0 and tiers["moved"]["host_to_nvme"] > 0
        ids, tg = batches[0]
        for _ in range(gas):
            eng.backward(eng(ids, tg))
            if overlap and eng.is_gradient_accumulation_boundary():
                assert opt.step_open  # begun during this backward
            eng.step()
        assert not opt.step_open
    finally:
        eng.close()
