"""swap: the NVMe tier. Swap files, aligned asynchronous reads and writes.

Knows files, offsets, bytes and futures; nothing of tensors' meaning.
"""

from swap.aligned import ALIGN, aligned_empty, is_aligned
from swap.errors import SwapError
from swap.fileio import FileIO
from swap.future import SwapFuture
from swap.stats import DirectionStats, SwapStats
from swap.store import SwapStore

__all__ = [
    "ALIGN",
    "DirectionStats",
    "FileIO",
    "SwapError",
    "SwapFuture",
    "SwapStats",
    "SwapStore",
    "aligned_empty",
    "is_aligned",
]
