"""offload: memory tiers, budgets, placement, buffer pools, prefetch queue, CPU Adam.

Knows tensors, bytes and tiers; nothing of modules or ranks.
"""

from . import numa
from .adam_build import kernel_status
from .adam_kernel import Backend, adam_update, to_low_precision
from .adam_math import AdamHyper
from .adam_threads import AdamThreads
from .cpu_adam import CPUAdam

__all__ = [
    "AdamHyper",
    "AdamThreads",
    "Backend",
    "CPUAdam",
    "adam_update",
    "kernel_status",
    "numa",
    "to_low_precision",
]
