"""offload: memory tiers, budgets, placement, buffer pools, prefetch queue, CPU Adam.

Knows tensors, bytes and tiers; nothing of modules or ranks.
"""

from . import numa
from .adam_build import kernel_status
from .adam_kernel import Backend, adam_update, to_low_precision
from .adam_math import AdamHyper
from .adam_threads import AdamThreads
from .cpu_adam import CPUAdam
from .pipelined_adam import PipelineStats, pipelined_step
from .shard_store import (
    HostShardStore,
    ShardBuffers,
    ShardLayout,
    ShardStore,
    SwapShardStore,
    Transfer,
)

__all__ = [
    "AdamHyper",
    "AdamThreads",
    "Backend",
    "CPUAdam",
    "HostShardStore",
    "PipelineStats",
    "ShardBuffers",
    "ShardLayout",
    "ShardStore",
    "SwapShardStore",
    "Transfer",
    "adam_update",
    "kernel_status",
    "numa",
    "pipelined_step",
    "to_low_precision",
]
