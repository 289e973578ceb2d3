"""The worker threads that run the CPU Adam kernel over ranges of a shard.

Why Python threads and not OpenMP: the ctypes call releases the GIL, so plain
threads run the C loop in parallel, as fast as an OpenMP build of the same
kernel (benchmarks/RESULTS.md, "Measurements behind design choices"). With
threads of our own, each can be bound to a NUMA node through ``offload.numa``
before it runs, and the one pool is created here, visibly,
instead of by a second OpenMP runtime beside torch's.

Each thread streams its range once: the kernel keeps no intermediates, so
there is nothing to tile for cache (the PyTorch fallback, which has
intermediates, works in 64 Ki-element chunks instead; see adam_math.py).

Work split: ``[0, n)`` is cut into chunks (about ``CHUNKS_PER_THREAD`` per
thread, bounds multiples of ``ALIGN`` elements). Worker w is bound to node
``w * nodes // threads``; chunk c belongs to the node of worker
``c * threads // chunks`` (contiguous blocks of chunks per node). The threads
bound to a node take its chunks from a shared queue, one at a time, so a
thread slowed by another process (the swap I/O threads, a data loader, other
ranks) takes fewer chunks instead of holding up the whole step, as a static
one-range-per-thread split would. ``first_touch`` zero-fills a buffer with the
same chunk-to-node map, so on a multi-node machine every chunk of a buffer
lives on the node that updates it. The gain is robustness (a lower worst case),
not peak speed (benchmarks/RESULTS.md, "Measurements behind design choices").
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from . import numa

logger = logging.getLogger(__name__)

ALIGN = 32  # elements: 128 B of fp32, 64 B of bf16, so parts never share a cache line
# Below this many elements per thread the dispatch to a thread costs more than it saves.
MIN_PER_THREAD = 1 << 15
# Chunks per thread: enough to rebalance around a descheduled thread, few enough that the
# per-chunk cost (one ctypes call) stays far below a chunk's time.
CHUNKS_PER_THREAD = 8


@functools.lru_cache(maxsize=1)
def _log_placement(nodes: int) -> None:
    if nodes > 1:
        logger.info("CPU Adam threads are bound per NUMA node (%d nodes); chunks first-touched "
                    "on the node that updates them", nodes)
    else:
        logger.info("CPU Adam thread binding is a no-op: one NUMA node (or no libnuma)")


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
        _log_placement(self._nodes)
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

    def node_of_worker(self, worker: int, users: int) -> int:
        return worker * self._nodes // users

    def node_of_chunk(self, chunk: int, chunks: int, users: int) -> int:
        """The node whose workers take `chunk`: that of worker chunk*users//chunks, so every
        node that has chunks also has a worker (even with fewer threads than nodes)."""
        return self.node_of_worker(chunk * users // chunks, users)

    def split(self, n: int, min_per_thread: int = MIN_PER_THREAD) -> list[tuple[int, int]]:
        """Contiguous chunks covering [0, n); deterministic for a given n."""
        if n <= 0:
            return [(0, 0)]
        users = max(1, min(self.threads, n // max(1, min_per_thread)))
        if users == 1:
            return [(0, n)]
        step = -(-n // (users * CHUNKS_PER_THREAD))
        step = max(-(-step // ALIGN) * ALIGN, ALIGN)
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]

    def run(self, n: int, fn: Callable[[int, int], None], min_per_thread: int = MIN_PER_THREAD
            ) -> None:
        """Call fn(lo, hi) over the chunks of [0, n), in parallel; re-raise the first error.

        Every chunk has finished (or was never started, after an error) when this returns.
        """
        if self._closed:
            raise RuntimeError("AdamThreads is closed")
        ranges = self.split(n, min_per_thread)
        if len(ranges) == 1 and self._inline:
            fn(*ranges[0])
            return
        pool = self._pool
        if pool is None:  # pragma: no cover - threads == 1 on one node is handled above
            raise RuntimeError("AdamThreads has no workers")
        users = min(self.threads, len(ranges))
        queues: list[deque[tuple[int, int]]] = [deque() for _ in range(self._nodes)]
        for c, r in enumerate(ranges):
            queues[self.node_of_chunk(c, len(ranges), users)].append(r)
        failed = threading.Event()
        futures: list[Future[None]] = []
        for w in range(users - 1 if self._inline else users):
            node = self.node_of_worker(w, users)
            futures.append(pool.submit(self._work, node, queues[node], fn, failed))
        error: BaseException | None = None
        if self._inline:  # one node: the caller takes chunks too
            try:
                self._drain(queues[0], fn, failed)
            except BaseException as exc:
                error = exc
        for fut in futures:  # wait for every worker, even after an error: they use our buffers
            failure = fut.exception()
            if failure is not None and error is None:
                error = failure
        if error is not None:
            raise error

    @staticmethod
    def _drain(queue: deque[tuple[int, int]], fn: Callable[[int, int], None],
               failed: threading.Event) -> None:
        while not failed.is_set():
            try:
                lo, hi = queue.popleft()  # atomic in CPython: each chunk is taken once
            except IndexError:
                return
            try:
                fn(lo, hi)
            except BaseException:
                failed.set()  # the others stop taking chunks
                raise

    def _work(self, node: int, queue: deque[tuple[int, int]], fn: Callable[[int, int], None],
              failed: threading.Event) -> None:
        # The executor may run this on any worker, so a worker (re)binds when its node changes.
        ident = threading.get_ident()
        if self._nodes > 1 and self._bound.get(ident) != node:
            numa.bind_current_thread(node)
            self._bound[ident] = node
        self._drain(queue, fn, failed)

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
