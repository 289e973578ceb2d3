"""Tier budgets: taken from settings, or detected from the machine.

device: free CUDA memory (``torch.cuda.mem_get_info``) minus a reserve; on a
        CPU-only machine the stand-in device tier must be given a budget.
host:   available RAM (psutil) minus a reserve.
nvme:   free space on the swap path's file system minus a reserve.
Also reads the memlock limit (``ulimit -l``) that caps pinned memory.
"""

from __future__ import annotations

import logging
import resource
import shutil
from dataclasses import dataclass

import psutil
import torch

from .errors import PlanError
from .settings import Budgets, Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierBudgets:
    """Resolved bytes per tier, and where the nvme budget came from (for messages)."""

    device: int
    host: int
    nvme: int
    nvme_in_flight: int = 0  # copy-on-write bytes the swap file grows by beyond the pool
    nvme_path: str | None = None  # the swap directory whose free space was measured
    nvme_free: int | None = None  # its free bytes at start (None: the budget was given)
    nvme_reserve: int = 0  # bytes of it kept free

    def of(self, tier: Tier) -> int:
        return {"device": self.device, "host": self.host, "nvme": self.nvme}[tier]


def memlock_limit() -> int | None:
    """Bytes this process may page-lock (``ulimit -l``); None when unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def resolve_budgets(
    budgets: Budgets, device: torch.device, swap_path: str | None, *, needs_nvme: bool
) -> TierBudgets:
    """Fill every ``None`` in ``budgets`` from the machine; log what was detected."""
    dev = budgets.device
    if dev is None:
        if device.type != "cuda":
            raise PlanError(
                "budgets.device is None but there is no CUDA device to measure; give the "
                "CPU stand-in device tier an explicit budget in bytes"
            )
        free, _total = torch.cuda.mem_get_info(device)
        dev = max(0, int(free) - budgets.device_reserve)
        log.info("device budget detected: %d free - %d reserve = %d bytes",
                 free, budgets.device_reserve, dev)
    host = budgets.host
    if host is None:
        avail = int(psutil.virtual_memory().available)
        host = max(0, avail - budgets.host_reserve)
        log.info("host budget detected: %d available - %d reserve = %d bytes",
                 avail, budgets.host_reserve, host)
    nvme = budgets.nvme
    free_disk: int | None = None
    reserve = 0
    if nvme is None:
        if swap_path is None:
            if needs_nvme:
                raise PlanError(
                    "budgets.nvme is None and no swap_path is set; name the swap directory "
                    "(offload path) or give an explicit nvme budget"
                )
            nvme = 0
        else:
            usage = shutil.disk_usage(swap_path)
            free_disk = int(usage.free)
            reserve = (budgets.nvme_reserve if budgets.nvme_reserve is not None
                       else int(usage.total * budgets.nvme_reserve_fraction))
            nvme = max(0, free_disk - reserve)
            log.info("nvme budget detected at %s: %d free - %d reserve = %d bytes",
                     swap_path, free_disk, reserve, nvme)
    return TierBudgets(device=dev, host=host, nvme=nvme, nvme_in_flight=budgets.nvme_in_flight,
                       nvme_path=swap_path, nvme_free=free_disk, nvme_reserve=reserve)
