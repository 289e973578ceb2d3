"""offload: memory tiers, budgets, placement, buffer pools, prefetch queue, CPU Adam.

Knows tensors, bytes and tiers; nothing of modules or ranks.

Tier manager API (offload/manager.py has the walk-through)::

    settings = TierSettings(homes={"param": "none", "master": "nvme", ...},
                            budgets=Budgets(device=..., host=..., nvme=...))
    mgr = TierManager([ShardSpec(key, cls, numel, dtype), ...], settings, swap=store)
    mgr.place(key, tensor).wait()
    mgr.set_order([(key, "device"), ...])        # drives prefetch and eviction
    view = mgr.fetch(key, "device").wait()       # 1D view; valid until release()
    mgr.release(key); mgr.evict(key); mgr.memory_report()
"""

from . import numa
from .adam_build import kernel_status
from .adam_kernel import Backend, adam_update, to_low_precision
from .adam_math import AdamHyper
from .adam_stream import AdamStream
from .adam_threads import AdamThreads
from .budget import TierBudgets, memlock_limit, resolve_budgets
from .cpu_adam import CPUAdam
from .errors import BudgetError, OffloadError, PlanError, TransferError
from .manager import TierManager
from .placement import Plan, plan_placement
from .pool import BufferPool, HostAllocator, PoolBuffer
from .prefetch import Prefetcher
from .report import MemoryReport
from .residency import TRANSITIONS, Op, Role, ShardRecord, ShardSpec, State
from .settings import (
    TENSOR_CLASSES,
    TIERS,
    Budgets,
    OffloadDevice,
    PoolSettings,
    PrefetchSettings,
    SettingsError,
    TensorClass,
    Tier,
    TierSettings,
)
from .snapshot import ShardSnapshot, SnapshotSpaceError
from .stream_parts import PipelineStats
from .transfer import SwapBackend, TierTransfer

__all__ = [
    "TENSOR_CLASSES",
    "TIERS",
    "TRANSITIONS",
    "AdamHyper",
    "AdamStream",
    "AdamThreads",
    "Backend",
    "BudgetError",
    "Budgets",
    "BufferPool",
    "CPUAdam",
    "HostAllocator",
    "MemoryReport",
    "OffloadDevice",
    "OffloadError",
    "Op",
    "PipelineStats",
    "Plan",
    "PlanError",
    "PoolBuffer",
    "PoolSettings",
    "PrefetchSettings",
    "Prefetcher",
    "Role",
    "SettingsError",
    "ShardRecord",
    "ShardSnapshot",
    "ShardSpec",
    "SnapshotSpaceError",
    "State",
    "SwapBackend",
    "TensorClass",
    "Tier",
    "TierBudgets",
    "TierManager",
    "TierSettings",
    "TierTransfer",
    "TransferError",
    "adam_update",
    "kernel_status",
    "memlock_limit",
    "numa",
    "plan_placement",
    "resolve_budgets",
    "to_low_precision",
]
