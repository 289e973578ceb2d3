"""Helpers for the tier-manager tests (offload/): settings builders and a slow disk."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tierzero.offload import Budgets, PoolSettings, PrefetchSettings, ShardSpec, TierSettings
from tierzero.swap import FileIO, SwapStore


class DelayIO(FileIO):
    """Sleeps before every pread/pwrite: an NVMe with a known, fixed latency per block."""

    def __init__(self, read_delay: float = 0.0, write_delay: float = 0.0) -> None:
        self.read_delay = read_delay
        self.write_delay = write_delay

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        time.sleep(self.read_delay)
        return super().pread(fd, buf, offset)

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        time.sleep(self.write_delay)
        return super().pwrite(fd, buf, offset)


def cpu_settings(
    homes: dict[str, str], *, device: int, host: int, nvme: int = 1 << 30,
    buffer_count: int | None = None, nvme_ahead: int = 1 << 20, device_ahead: int = 1 << 20,
    timeout: float = 5.0, persist: int = 0,
) -> TierSettings:
    """Settings for the CPU stand-in device tier with explicit budgets."""
    return TierSettings(
        homes=homes,  # type: ignore[arg-type]
        budgets=Budgets(device=device, host=host, nvme=nvme),
        pool=PoolSettings(buffer_count=buffer_count),
        prefetch=PrefetchSettings(nvme_bytes=nvme_ahead, device_bytes=device_ahead),
        device="cpu", wait_timeout_s=timeout, persist_bytes=persist,
    )


def store(tmp_path: Path, **kw: object) -> SwapStore:
    return SwapStore(tmp_path, block_size=1 << 16, **kw)  # type: ignore[arg-type]


def data_for(spec: ShardSpec, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(spec.numel, generator=g).to(spec.dtype)
