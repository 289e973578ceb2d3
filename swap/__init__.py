"""swap: the NVMe tier. Swap files, aligned asynchronous reads and writes.

Knows files, offsets, bytes and futures; nothing of tensors' meaning.

    from tierzero.swap import SwapStore, aligned_empty
    with SwapStore("/local_nvme", block_size=1 << 20, threads=4, verify=True) as store:
        buf = aligned_empty(n, torch.float32)      # page-aligned: O_DIRECT, no copy
        store.write("unit3/exp_avg", buf).wait()   # SwapFuture; buf is held until done
        store.read("unit3/exp_avg", out=buf).wait()
        store.delete("unit3/exp_avg")
        kept = store.keep("k"); store.read_kept(kept, out=buf); store.release_kept(kept)
        store.stats()                              # bytes, busy seconds per direction

Every I/O failure is a `SwapError` naming the file and the key; bad arguments
raise ValueError/TypeError before any work. Files: see [Note: swap file
layout] in swap/header.py and the scratch-file rules in swap/scratch.py.
`DrySwap` counts bytes instead of moving them (plans); `trace` is the tracing
seam every package records through ([Note: trace event kinds] in swap/trace.py).
"""

from tierzero.swap import trace
from tierzero.swap.aligned import ALIGN, aligned_empty, is_aligned
from tierzero.swap.dry import DrySwap
from tierzero.swap.errors import SwapError
from tierzero.swap.fileio import FileIO
from tierzero.swap.future import SwapFuture
from tierzero.swap.kept import KeptRegion
from tierzero.swap.stats import DirectionStats, SwapStats
from tierzero.swap.store import SwapStore

__all__ = [
    "ALIGN",
    "DirectionStats",
    "DrySwap",
    "FileIO",
    "KeptRegion",
    "SwapError",
    "SwapFuture",
    "SwapStats",
    "SwapStore",
    "aligned_empty",
    "is_aligned",
    "trace",
]
