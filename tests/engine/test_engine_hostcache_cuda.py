"""offload.params.max_in_cpu_bytes on a CUDA device: host-homed param shards (pinned when
the pool is) are copied host->device for each gather like NVMe-homed ones after their read,
and training matches the all-NVMe run and plain PyTorch on the same GPU.

Tolerances: as tests/engine/test_engine_offload_cuda.py (params 1e-4, losses 1e-5 against plain
PyTorch on the GPU); the cached and uncached runs run the same kernels on the same bytes,
but GPU reductions need not be bitwise repeatable, so they are compared with the same
bounds instead of torch.equal.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from engine_helpers import make_batches, make_config
from test_engine_cuda import _engine, _reference
from test_engine_hostcache import CACHE

from tierzero.engine.config.schema import (
    BudgetsConfig,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)

pytestmark = pytest.mark.cuda
STEPS = 10


def _cfg(path: Path, cache: int) -> object:
    path.mkdir(parents=True, exist_ok=True)
    return dataclasses.replace(make_config(gas=2, clip=0.5), offload=OffloadConfig(
        params=ParamOffloadConfig(device="nvme", path=str(path), max_in_cpu_bytes=cache),
        optimizer=OptimizerOffloadConfig(device="nvme", path=str(path)),
        budgets=BudgetsConfig(device_bytes=8 << 20)))


def test_cuda_partial_cache_matches_all_nvme_and_pytorch(tmp_path: Path) -> None:
    batches = make_batches(STEPS * 2)
    cached_cfg, nvme_cfg = _cfg(tmp_path / "c", CACHE), _cfg(tmp_path / "n", 0)
    ref_losses, ref = _reference(cached_cfg, batches)  # type: ignore[arg-type]
    losses, got, eng = _engine(cached_cfg, batches)  # type: ignore[arg-type]
    tiers = eng.memory_report()["tiers"]
    eng.close()
    base_losses, base, eng0 = _engine(nvme_cfg, batches)  # type: ignore[arg-type]
    eng0.close()
    assert tiers["params_in_cpu"] > 0 and tiers["homes"]["param"]["nvme"] > 0
    assert tiers["moved"]["host_to_device"] > 0
    for want_losses, want in ((ref_losses, ref), (base_losses, base)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses),
                                   rtol=1e-5, atol=0)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=1e-4, msg=k)
