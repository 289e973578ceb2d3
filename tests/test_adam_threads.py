"""AdamThreads: the work split, error propagation, and NUMA binding on a (simulated) 2-node host."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from offload import AdamThreads, adam_threads


def test_split_covers_range_aligned() -> None:
    with AdamThreads(3) as pool:
        for n in (0, 1, 31, 1 << 15, 3 * (1 << 15) + 5, 10_000_019):
            parts = pool.split(n)
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
            assert all(lo % adam_threads.ALIGN == 0 for lo, _ in parts)
            assert len(parts) <= 3


def test_worker_error_is_raised_after_all_parts_finish() -> None:
    done: list[tuple[int, int]] = []
    lock = threading.Lock()

    def fn(lo: int, hi: int) -> None:
        if lo == 0:
            raise OSError("part 0 failed")
        with lock:
            done.append((lo, hi))

    with AdamThreads(4) as pool, pytest.raises(OSError, match="part 0 failed"):
        pool.run(4 << 15, fn)
    assert len(done) == 3  # the other parts still ran to completion


def test_two_numa_nodes_bind_workers_and_first_touch(monkeypatch: pytest.MonkeyPatch) -> None:
    binds: dict[int, int] = {}  # thread id -> node it was last bound to

    def bind(node: int) -> bool:
        binds[threading.get_ident()] = node
        return True

    monkeypatch.setattr(adam_threads.numa, "node_count", lambda: 2)
    monkeypatch.setattr(adam_threads.numa, "bind_current_thread", bind)
    seen: list[tuple[int, int]] = []  # (part start, node its thread was bound to)
    lock = threading.Lock()
    main = threading.get_ident()

    def fn(lo: int, hi: int) -> None:
        assert threading.get_ident() != main, "on several nodes no part runs unbound"
        with lock:
            seen.append((lo, binds[threading.get_ident()]))

    with AdamThreads(4) as pool:
        for _ in range(3):  # repeated runs: the executor may shuffle parts between workers
            seen.clear()
            pool.run(4 << 16, fn)
            parts = pool.split(4 << 16)
            want = {lo: pool.node_of_part(j, len(parts)) for j, (lo, _) in enumerate(parts)}
            assert dict(seen) == want == {0: 0, 1 << 16: 0, 2 << 16: 1, 3 << 16: 1}
        t = torch.full((4 << 16,), 7.0)
        pool.first_touch(t)
        assert not t.any()


def test_closed_pool_refuses_work() -> None:
    pool = AdamThreads(2)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(10, lambda lo, hi: None)
