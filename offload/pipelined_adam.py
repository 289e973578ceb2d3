"""The optimizer step over shards whose state lives on another tier, pipelined.

While shard i is updated on the CPU, shard i+1 (and further, with more
buffers) is being fetched and shard i-1 is being stored. Host memory is
bounded: exactly ``buffers`` buffer sets of the largest shard's size exist,
and a buffer set is reused only after its store finished (see
[Note: shard store contract] in shard_store.py for what fetch/store promise).

    buffers = 3:   fetch i+1   |  adam i  |  store i-1     (one of each in flight)
    buffers = k:   fetch up to i+k-2 ahead, stores drain behind
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierzero.swap import trace

from .adam_kernel import Backend, adam_update
from .adam_math import AdamHyper
from .adam_threads import AdamThreads
from .shard_store import ShardBuffers, ShardStore, Transfer

logger = logging.getLogger(__name__)

MIN_BUFFERS = 3  # one being fetched, one being updated, one being stored


@dataclass(frozen=True)
class PipelineStats:
    """Where the time of one pipelined step went (seconds, wall clock)."""

    shards: int
    total_s: float
    compute_s: float  # inside the Adam kernel
    fetch_wait_s: float  # compute thread blocked on a fetch
    store_wait_s: float  # blocked on a store to free a buffer, or draining at the end
    buffer_bytes: int  # host bytes held by the pipeline's buffers


def pipelined_step(
    store: ShardStore,
    *,
    hyper: AdamHyper | Sequence[AdamHyper],
    step: float,
    order: Sequence[int] | None = None,
    grad_scale: float = 1.0,
    threads: AdamThreads | None = None,
    buffers: int = MIN_BUFFERS,
    buffer_sets: Sequence[ShardBuffers] | None = None,
    backend: Backend = "auto",
) -> PipelineStats:
    """Update every shard in `order` (default 0..n-1) once, fetching ahead and storing behind.

    hyper: one AdamHyper for all shards, or one per shard index.
    step: the step number of this update (1 on the first), the same for every shard.
    buffer_sets: reuse these buffer sets (each at least the largest shard) instead of
        allocating `buffers` new ones, e.g. across steps.
    """
    layout = store.layout
    n = len(layout.numels)
    order = list(range(n)) if order is None else list(order)
    if sorted(order) != sorted(set(order)) or any(not 0 <= i < n for i in order):
        raise ValueError(f"pipelined_step order must list distinct shards in 0..{n - 1}; "
                         f"got {order[:10]}{'...' if len(order) > 10 else ''}")
    hypers = _hypers(hyper, n)
    largest = max((layout.numels[i] for i in order), default=0)
    sets = _buffer_sets(store, largest, buffers, buffer_sets)
    if buffer_sets is None and threads is not None:
        for s in sets:  # NUMA first touch: each part lands on the node of the thread updating it
            for buf in (s.master, s.exp_avg, s.exp_avg_sq):
                threads.first_touch(buf)
    buffer_bytes = sum(t.nbytes for s in sets for t in _tensors(s))

    t0 = time.perf_counter()
    compute = fetch_wait = store_wait = 0.0
    free: deque[ShardBuffers] = deque(sets)
    # (full buffer set, transfer on a view of it): a set returns to `free` whole.
    fetches: deque[tuple[ShardBuffers, Transfer]] = deque()
    stores: deque[tuple[ShardBuffers, Transfer]] = deque()
    ahead = len(sets) - 2
    next_fetch = 0
    try:
        for pos, index in enumerate(order):
            while next_fetch < len(order) and next_fetch <= pos + ahead:
                if not free:  # reclaim the oldest stored buffer set
                    t = time.perf_counter()
                    full, done = stores.popleft()
                    done.wait()
                    free.append(full)
                    store_wait += time.perf_counter() - t
                shard = order[next_fetch]
                full = free.popleft()
                fetches.append((full, store.fetch(shard, full.view(layout.numels[shard]))))
                next_fetch += 1
            t = time.perf_counter()
            full, current = fetches.popleft()
            bufs = current.wait()
            fetch_wait += time.perf_counter() - t
            t = time.perf_counter()
            with trace.span("adam", f"shard {index}", numel=layout.numels[index]):
                adam_update(bufs.master, bufs.exp_avg, bufs.exp_avg_sq, bufs.grad,
                            hyper=hypers[index], step=step, grad_scale=grad_scale,
                            shadow=bufs.param16, threads=threads, backend=backend)
            compute += time.perf_counter() - t
            stores.append((full, store.store(index, bufs)))
            # Reclaim finished stores without blocking, so fetches rarely wait for a buffer.
            while stores and stores[0][1].done():
                stores[0][1].wait()
                free.append(stores.popleft()[0])
        t = time.perf_counter()
        while stores:
            stores.popleft()[1].wait()
        store_wait += time.perf_counter() - t
    except BaseException:
        _drain(fetches, stores)
        raise
    return PipelineStats(len(order), time.perf_counter() - t0, compute, fetch_wait, store_wait,
                         buffer_bytes)


def _hypers(hyper: AdamHyper | Sequence[AdamHyper], n: int) -> Sequence[AdamHyper]:
    if isinstance(hyper, AdamHyper):
        return [hyper] * n
    if len(hyper) != n:
        raise ValueError(f"pipelined_step got {len(hyper)} AdamHyper for {n} shards; "
                         "pass one, or one per shard")
    return hyper


def _buffer_sets(store: ShardStore, largest: int, buffers: int,
                 given: Sequence[ShardBuffers] | None) -> list[ShardBuffers]:
    if given is not None:
        sets = list(given)
        small = [i for i, s in enumerate(sets) if s.numel < largest]
        if len(sets) < MIN_BUFFERS or small:
            raise ValueError(f"pipelined_step buffer_sets: need >= {MIN_BUFFERS} sets of >= "
                             f"{largest} elements; got {len(sets)}, too small: {small}")
        return sets
    if not isinstance(buffers, int) or buffers < MIN_BUFFERS:
        raise ValueError(f"pipelined_step buffers={buffers!r}; need an int >= {MIN_BUFFERS} "
                         "(fetch, update and store each hold one)")
    return [ShardBuffers.allocate(store, largest) for _ in range(buffers)]


def _tensors(s: ShardBuffers) -> list[torch.Tensor]:
    return [t for t in (s.master, s.exp_avg, s.exp_avg_sq, s.grad, s.param16) if t is not None]


def _drain(*queues: deque[tuple[ShardBuffers, Transfer]]) -> None:
    """After a failure: let every transfer settle before the buffers go away; log extra errors."""
    for _, tr in (item for q in queues for item in q):
        try:
            tr.wait()
        except Exception as exc:  # the first error is already propagating
            logger.warning("while unwinding a failed pipelined step: %s", exc)
