"""The CUDA paths of the tier manager: pinned pool, copy streams fenced by events,
copies overlapping compute, write-backs ordered after the kernels that wrote.

Skipped with a reason on machines without CUDA (tests/conftest.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tierzero.offload import (
    Budgets,
    PoolSettings,
    PrefetchSettings,
    ShardSpec,
    TierManager,
    TierSettings,
)
from tierzero.offload.budget import memlock_limit
from tierzero.swap import SwapStore

pytestmark = pytest.mark.cuda
NUMEL = 1 << 20  # 4 MiB fp32 per shard
SPIN = 200_000_000  # cycles for torch.cuda._sleep: ~0.1 s at ~2 GHz


def _manager(tmp_path: Path, store: SwapStore, n: int = 6) -> tuple[TierManager, list[ShardSpec]]:
    specs = [ShardSpec(f"p{i}", "param", NUMEL, torch.float32) for i in range(n)]
    settings = TierSettings(
        homes={"param": "nvme"}, device="cuda",
        budgets=Budgets(device=8 * NUMEL * 4, host=256 << 20, nvme=1 << 30),
        pool=PoolSettings(buffer_count=6),
        prefetch=PrefetchSettings(nvme_bytes=4 * NUMEL * 4, device_bytes=2 * NUMEL * 4))
    return TierManager(specs, settings, swap=store), specs


def test_pool_is_pinned_and_round_trip_through_all_tiers(tmp_path: Path) -> None:
    with SwapStore(tmp_path) as store:
        mgr, specs = _manager(tmp_path, store)
        with mgr:
            limit = memlock_limit()
            if limit is None or limit >= mgr.plan.pool_bytes:
                assert mgr.plan.pin and mgr._pool.arena.is_pinned()
            refs = {s.key: torch.randn(NUMEL) for s in specs}
            for k, v in refs.items():
                mgr.place(k, v).wait()
            mgr.set_order([(s.key, "device") for s in specs])
            for s in specs:
                view = mgr.fetch(s.key, "device", writable=True).wait()
                assert view.is_cuda
                torch.testing.assert_close(view.cpu(), refs[s.key], rtol=0, atol=0)
                view.mul_(3)  # a kernel on the default stream writes the cache
                mgr.release(s.key)
                mgr.evict(s.key)  # the D2H write-back must wait for that kernel
            mgr.synchronize()
            for s in specs:
                host = mgr.fetch(s.key, "host").wait()
                torch.testing.assert_close(host, refs[s.key] * 3, rtol=0, atol=0)
                mgr.release(s.key)
            mgr.audit()
            rep = mgr.memory_report()
            assert rep.peak["device"] <= rep.budget["device"]
            assert rep.moved["device_to_host"] == len(specs) * NUMEL * 4


def test_h2d_copy_runs_beside_compute_on_its_own_stream(tmp_path: Path) -> None:
    with SwapStore(tmp_path) as store:
        mgr, specs = _manager(tmp_path, store, n=2)
        with mgr:
            for s in specs:
                mgr.place(s.key, torch.ones(NUMEL)).wait()
            mgr.fetch("p0", "host").wait()  # stage in pinned host memory first
            mgr.release("p0")
            torch.cuda.synchronize()
            torch.cuda._sleep(SPIN)  # long kernel queued on the default stream
            start = time.perf_counter()
            view = mgr.fetch("p0", "device").wait()
            copy_done = time.perf_counter() - start
            still_busy = not torch.cuda.current_stream().query()
            torch.cuda.synchronize()
            assert still_busy, "the H2D copy waited for compute on the default stream"
            assert float(view.sum()) == NUMEL
            assert copy_done < 0.5
            mgr.release("p0")


def test_write_back_is_fenced_after_the_writing_kernel(tmp_path: Path) -> None:
    with SwapStore(tmp_path) as store:
        mgr, _ = _manager(tmp_path, store, n=1)
        with mgr:
            mgr.place("p0", torch.zeros(NUMEL)).wait()
            view = mgr.fetch("p0", "device", writable=True).wait()
            torch.cuda._sleep(SPIN)  # delay the write below on the default stream
            view.fill_(7.0)
            mgr.release("p0")
            mgr.evict("p0")  # D2H must start after fill_, not race it
            mgr.synchronize()
            host = mgr.fetch("p0", "host").wait()
            assert float(host.min()) == 7.0 and float(host.max()) == 7.0
            mgr.release("p0")


def test_device_budget_is_detected_from_free_memory(tmp_path: Path) -> None:
    from tierzero.offload import Budgets as B
    from tierzero.offload import resolve_budgets

    dev = torch.device("cuda", 0)
    free, total = torch.cuda.mem_get_info(dev)
    got = resolve_budgets(B(device=None, host=1 << 30, device_reserve=1 << 30), dev,
                          str(tmp_path), needs_nvme=True)
    assert 0 < got.device <= free - (1 << 30) + (64 << 20)  # other allocations may come and go
    assert got.device < total and got.nvme > 0
