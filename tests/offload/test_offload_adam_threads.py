"""AdamThreads: the work split, error propagation, and NUMA binding on a (simulated) 2-node host."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from tierzero.offload import AdamThreads, adam_threads


def test_split_covers_range_aligned() -> None:
    with AdamThreads(3) as pool:
        for n in (0, 1, 31, 1 << 15, 3 * (1 << 15) + 5, 10_000_019):
            parts = pool.split(n)
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
            assert all(lo % adam_threads.ALIGN == 0 for lo, _ in parts)
            assert len(parts) <= 3 * adam_threads.CHUNKS_PER_THREAD


def test_error_is_raised_after_every_running_chunk_finished() -> None:
    active = [0]
    calls = [0]
    lock = threading.Lock()

    def fn(lo: int, hi: int) -> None:
        with lock:
            active[0] += 1
            calls[0] += 1
        try:
            time.sleep(0.002)
            if lo == 0:
                raise OSError("chunk 0 failed")
        finally:
            with lock:
                active[0] -= 1

    with AdamThreads(4) as pool, pytest.raises(OSError, match="chunk 0 failed"):
        pool.run(4 << 15, fn)
    assert active[0] == 0  # nothing still touching the buffers
    assert calls[0] < len(pool.split(4 << 15))  # the others stopped taking chunks


@pytest.mark.parametrize(("nodes", "threads"), [(2, 4), (4, 2), (3, 3)])
def test_numa_nodes_bind_workers_and_first_touch(
    monkeypatch: pytest.MonkeyPatch, nodes: int, threads: int
) -> None:
    binds: dict[int, int] = {}  # thread id -> node it was last bound to

    def bind(node: int) -> bool:
        binds[threading.get_ident()] = node
        return True

    monkeypatch.setattr(adam_threads.numa, "node_count", lambda: nodes)
    monkeypatch.setattr(adam_threads.numa, "bind_current_thread", bind)
    seen: dict[int, int] = {}  # chunk start -> node its thread was bound to
    lock = threading.Lock()
    main = threading.get_ident()

    def fn(lo: int, hi: int) -> None:
        assert threading.get_ident() != main, "on several nodes no chunk runs unbound"
        with lock:
            assert lo not in seen, "a chunk ran twice"
            seen[lo] = binds[threading.get_ident()]

    n = 40 << 15
    with AdamThreads(threads) as pool:
        chunks = pool.split(n)
        users = min(threads, len(chunks))
        want = {lo: pool.node_of_chunk(c, len(chunks), users)
                for c, (lo, _) in enumerate(chunks)}
        # Contiguous blocks of chunks per node, and every node with work is used.
        assert list(want.values()) == sorted(want.values())
        assert set(want.values()) == {pool.node_of_worker(w, users) for w in range(users)}
        for _ in range(3):  # repeated runs: the executor may shuffle tasks between workers
            seen.clear()
            pool.run(n, fn)
            assert seen == want
        t = torch.full((n,), 7.0)
        pool.first_touch(t)
        assert not t.any()


def test_slow_thread_takes_fewer_chunks() -> None:
    # Dynamic chunking: a thread that stalls (as if descheduled) does not hold the others.
    counts: dict[int, int] = {}
    lock = threading.Lock()

    def fn(lo: int, hi: int) -> None:
        ident = threading.get_ident()
        with lock:
            counts[ident] = counts.get(ident, 0) + 1
            first = counts[ident] == 1 and len(counts) == 1
        if first:
            time.sleep(0.3)

    with AdamThreads(2) as pool:
        pool.run(2 << 16, fn)
    assert sum(counts.values()) == len(pool.split(2 << 16)) == 2 * adam_threads.CHUNKS_PER_THREAD
    assert sorted(counts.values()) == [1, 2 * adam_threads.CHUNKS_PER_THREAD - 1]


def test_closed_pool_refuses_work() -> None:
    pool = AdamThreads(2)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(10, lambda lo, hi: None)
