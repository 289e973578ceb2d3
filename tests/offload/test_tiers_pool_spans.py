"""Pool spans: buffers sized for what is staged every step, larger shards over adjacent
buffers ([Note: pool spans] in offload/pool.py, sizing in offload/placement.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiers_util import data_for, store

from tierzero.offload import (
    Budgets,
    BufferPool,
    HostAllocator,
    OffloadError,
    PlanError,
    PoolSettings,
    PrefetchSettings,
    ShardSpec,
    TierManager,
    TierSettings,
)
from tierzero.offload.placement import TierBudgets, plan_placement

MiB = 1 << 20
CPU = torch.device("cpu")


def test_spans_take_adjacent_buffers_and_come_back_whole() -> None:
    pool = BufferPool(4, 8192, HostAllocator(pin=False, node=None))
    one = pool.try_acquire(100)
    assert one is not None and one.span == 1 and one.index == 0
    two = pool.try_acquire(8192 + 1)  # one byte over a buffer: two adjacent buffers
    assert two is not None and (two.index, two.span) == (1, 2) and two.data.numel() == 16384
    assert two.data.data_ptr() == one.data.data_ptr() + 8192  # contiguous in the one arena
    assert pool.in_use == 3 and pool.peak_in_use == 3
    assert not pool.can_take(2 * 8192)  # one slot left
    pool.release(one)
    assert pool.in_use == 2 and not pool.can_take(2 * 8192)  # slots 0 and 3: not adjacent
    pool.release(two)
    three = pool.try_acquire(3 * 8192)
    assert three is not None and (three.index, three.span) == (0, 3)
    with pytest.raises(OffloadError, match="released twice"):
        pool.release(two)
    with pytest.raises(OffloadError, match="needs 5 pool buffers"):
        pool.try_acquire(4 * 8192 + 1)


def _specs() -> list[ShardSpec]:
    # param 2 MiB (bf16) per unit, master 4 MiB (fp32): the pool stages only param
    return ([ShardSpec(f"u{i}:param", "param", MiB, torch.bfloat16) for i in range(3)]
            + [ShardSpec(f"u{i}:master", "master", MiB, torch.float32) for i in range(3)])


def _settings(count: int | None, staged: tuple[str, ...]) -> TierSettings:
    return TierSettings(
        homes={"param": "nvme", "master": "nvme"},
        budgets=Budgets(device=64 * MiB, host=64 * MiB, nvme=1 << 30),
        pool=PoolSettings(buffer_count=count, staged=staged),  # type: ignore[arg-type]
        prefetch=PrefetchSettings(nvme_bytes=4 * MiB, device_bytes=2 * MiB),
        device="cpu", wait_timeout_s=2.0)


def test_pool_is_sized_by_the_staged_classes() -> None:
    budgets = TierBudgets(device=64 * MiB, host=64 * MiB, nvme=1 << 30)
    every = plan_placement(_specs(), _settings(3, ("param", "grad", "master", "exp_avg",
                                                    "exp_avg_sq")), budgets, CPU)
    assert (every.pool_count, every.pool_buffer_bytes) == (3, 4 * MiB)  # the old sizing
    staged = plan_placement(_specs(), _settings(3, ("param", "grad")), budgets, CPU)
    assert (staged.pool_count, staged.pool_buffer_bytes) == (3, 2 * MiB)  # param each
    # one buffer requested: it must still hold the largest shard of any class
    single = plan_placement(_specs(), _settings(1, ("param", "grad")), budgets, CPU)
    assert (single.pool_count, single.pool_buffer_bytes) == (1, 4 * MiB)
    # nothing staged per step (params not on NVMe): two buffers spanning one master
    settings = _settings(None, ("param", "grad"))
    only = plan_placement(_specs()[3:], TierSettings(
        homes={"master": "nvme"}, budgets=settings.budgets, pool=settings.pool,
        prefetch=settings.prefetch, device="cpu"), budgets, CPU)
    assert (only.pool_count, only.pool_buffer_bytes) == (2, 2 * MiB)
    # a host budget with room for one buffer only: fewer, larger buffers
    tight = TierBudgets(device=64 * MiB, host=5 * MiB, nvme=1 << 30)
    cut = plan_placement(_specs(), _settings(5, ("param", "grad")), tight, CPU)
    assert cut.pool_count * cut.pool_buffer_bytes >= 4 * MiB and cut.pool_bytes <= 5 * MiB


def test_a_pool_smaller_than_a_master_shard_places_fetches_and_evicts_it(
        tmp_path: Path) -> None:
    """Masters (4 MiB) through 2 MiB buffers: place, fetch to host and device, write a
    change, evict it, read it back; every byte where it belongs, the audit clean."""
    specs = _specs()
    with TierManager(specs, _settings(3, ("param", "grad")), swap=store(tmp_path)) as mgr:
        assert mgr.plan.pool_buffer_bytes == 2 * MiB
        data = {s.key: data_for(s, i) for i, s in enumerate(specs)}
        for k, v in data.items():
            mgr.place(k, v).wait()
        mgr.synchronize()
        mgr.audit()
        assert mgr.memory_report().pool_in_use == 0
        view = mgr.fetch("u1:master", "host", writable=True).wait()
        assert mgr.memory_report().pool_in_use == 2  # one span of two buffers
        assert torch.equal(view, data["u1:master"])
        view.add_(1.0)
        mgr.release("u1:master")
        p16 = mgr.fetch("u0:param", "device").wait()  # the third buffer stays usable
        assert torch.equal(p16, data["u0:param"])
        mgr.release("u0:param")
        mgr.audit()
        mgr.evict("u1:master")  # dirty: written down first
        mgr.synchronize()
        out = torch.empty(MiB)
        mgr.read_into("u1:master", out).wait()
        assert torch.equal(out, data["u1:master"] + 1.0)
        # a second master while the first span's buffers are held: eviction makes room
        held = mgr.fetch("u0:param", "host").wait()
        m2 = mgr.fetch("u2:master", "host").wait()
        assert torch.equal(m2, data["u2:master"]) and torch.equal(held, data["u0:param"])
        mgr.release("u2:master")
        mgr.release("u0:param")
        mgr.audit()


def test_a_pool_too_small_for_a_shard_in_any_span_is_refused_by_the_plan(tmp_path: Path) -> None:
    specs = [ShardSpec("p", "param", MiB, torch.bfloat16),
             ShardSpec("m", "master", MiB, torch.float32)]
    settings = TierSettings(
        homes={"param": "nvme", "master": "nvme"},
        budgets=Budgets(device=64 * MiB, host=64 * MiB, nvme=1 << 30),
        pool=PoolSettings(buffer_count=1, buffer_bytes=2 * MiB, staged=("param",)),
        device="cpu")
    with pytest.raises(PlanError, match=r"buffer_count x buffer_bytes = 1 x 2097152 is "
                                        r"smaller than NVMe shard 'm'"):
        TierManager(specs, settings, swap=store(tmp_path))


def test_a_tight_host_budget_still_gets_a_pool_that_holds_the_largest_shard() -> None:
    """Room for two 8 KiB buffers (16384 B) but a 16388-byte master: two larger buffers
    would round up past the room (2 x 12 KiB), so the pool is one 20 KiB buffer."""
    specs = [ShardSpec("p", "param", 4096, torch.bfloat16),  # 8 KiB: the staged size
             ShardSpec("m", "master", 4097, torch.float32)]  # 16388 B
    settings = TierSettings(homes={"param": "nvme", "master": "nvme"}, device="cpu",
                            pool=PoolSettings(buffer_count=5, staged=("param",)))
    plan = plan_placement(specs, settings, TierBudgets(device=1 << 20, host=20480, nvme=1 << 30),
                          CPU)
    assert (plan.pool_count, plan.pool_buffer_bytes) == (1, 20480)
    with pytest.raises(PlanError, match="tier host is short by 2048 bytes"):
        plan_placement(specs, settings, TierBudgets(device=1 << 20, host=18432, nvme=1 << 30), CPU)
