"""The worker threads that run the CPU Adam kernel over ranges of a shard.

Why Python threads and not OpenMP: the ctypes call releases the GIL, so plain
threads run the C loop in parallel. Measured on the dev VM (2 threads, 40M
params, bf16 grad in/out, interleaved, under load): this pool 0.26-0.28 and an
OpenMP build of the same kernel 0.29-0.30 G params/s, the same within noise.
With threads of our own, each can be bound to a NUMA node through
``offload.numa`` before it runs, and the one pool is created here, visibly,
instead of by a second OpenMP runtime beside torch's.

Each thread streams its range once: the kernel keeps no intermediates, so
there is nothing to tile for cache (the PyTorch fallback, which has
intermediates, works in 64 Ki-element chunks instead; see adam_math.py).

Work split: ``[0, n)`` is cut into ``parts`` contiguous ranges whose bounds
are multiples of ``ALIGN`` elements. Part j always goes to worker j, and
worker j is bound to node ``j * nodes // parts``; ``first_touch`` zero-fills a
buffer with the same split, so on a multi-node machine every part of a buffer
lives on the node of the thread that updates it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from . import numa

logger = logging.getLogger(__name__)

ALIGN = 32  # elements: 128 B of fp32, 64 B of bf16, so parts never share a cache line
# Below this many elements per thread the dispatch (~20 us) costs more than it saves.
MIN_PER_THREAD = 1 << 15


def default_threads() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


class AdamThreads:
    """A fixed set of worker threads for the Adam kernel; use as a context manager or close()."""

    def __init__(self, threads: int | None = None) -> None:
        count = default_threads() if threads is None else threads
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"AdamThreads threads={threads!r} is invalid; need an int >= 1")
        self.threads = count
        self._nodes = numa.node_count()
        # On one node the calling thread takes a part itself; on several, every part runs on a
        # bound worker so no part is updated from an arbitrary node.
        self._inline = self._nodes == 1
        workers = count - 1 if self._inline else count
        self._pool: ThreadPoolExecutor | None = None
        if workers > 0:
            # The only threads of the CPU Adam: one per CPU it is given, bound on first use.
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tz-adam")
        self._bound: dict[int, int] = {}  # worker thread id -> node it is bound to
        self._closed = False

    def node_of_part(self, part: int, parts: int) -> int:
        return part * self._nodes // parts

    def split(self, n: int, min_per_thread: int = MIN_PER_THREAD) -> list[tuple[int, int]]:
        """Contiguous ranges covering [0, n); deterministic for a given n."""
        if n <= 0:
            return [(0, 0)]
        parts = max(1, min(self.threads, n // max(1, min_per_thread)))
        step = -(-n // parts)
        step = -(-step // ALIGN) * ALIGN
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]

    def run(self, n: int, fn: Callable[[int, int], None], min_per_thread: int = MIN_PER_THREAD
            ) -> None:
        """Call fn(lo, hi) over a split of [0, n), in parallel; re-raise the first error."""
        if self._closed:
            raise RuntimeError("AdamThreads is closed")
        ranges = self.split(n, min_per_thread)
        if len(ranges) == 1 and self._inline:
            fn(*ranges[0])
            return
        pool = self._pool
        if pool is None:  # pragma: no cover - threads == 1 on one node is handled above
            raise RuntimeError("AdamThreads has no workers")
        futures: list[Future[None]] = []
        local = ranges[-1] if self._inline else None
        remote = ranges[:-1] if self._inline else ranges
        for j, (lo, hi) in enumerate(remote):
            futures.append(pool.submit(self._work, self.node_of_part(j, len(ranges)), fn, lo, hi))
        error: BaseException | None = None
        if local is not None:
            try:
                fn(*local)
            except BaseException as exc:
                error = exc
        for fut in futures:  # wait for every part, even after an error: they use our buffers
            failure = fut.exception()
            if failure is not None and error is None:
                error = failure
        if error is not None:
            raise error

    def _work(self, node: int, fn: Callable[[int, int], None], lo: int, hi: int) -> None:
        # The executor may hand part j to any worker, so a worker (re)binds when its node changes.
        ident = threading.get_ident()
        if self._nodes > 1 and self._bound.get(ident) != node:
            numa.bind_current_thread(node)
            self._bound[ident] = node
        fn(lo, hi)

    def first_touch(self, t: torch.Tensor) -> torch.Tensor:
        """Zero-fill a flat tensor with the same split the kernel uses (NUMA first touch)."""
        flat = t.view(-1)

        def zero(lo: int, hi: int) -> None:
            flat[lo:hi].zero_()

        self.run(flat.numel(), zero)
        return t

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._closed = True

    def __enter__(self) -> AdamThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
