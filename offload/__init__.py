"""offload: memory tiers, budgets, placement, buffer pools, prefetch queue, CPU Adam.

Knows tensors, bytes and tiers; nothing of modules or ranks.
"""

from . import numa

__all__ = ["numa"]
