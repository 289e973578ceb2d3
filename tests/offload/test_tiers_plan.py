"""Settings validation, budget resolution and placement (offload/settings, budget, placement)."""

from __future__ import annotations

import logging

import pytest
import torch

from tierzero.offload import (
    Budgets,
    PlanError,
    PoolSettings,
    PrefetchSettings,
    SettingsError,
    ShardSpec,
    TierBudgets,
    TierSettings,
    plan_placement,
    resolve_budgets,
)
from tierzero.offload import placement as placement_mod

CPU = torch.device("cpu")
MiB = 1 << 20


def specs_of(counts: dict[str, tuple[int, int]]) -> list[ShardSpec]:
    """{class: (shards, numel each)} -> fp32 specs named class/i."""
    return [ShardSpec(f"{cls}/{i}", cls, numel, torch.float32)  # type: ignore[arg-type]
            for cls, (n, numel) in counts.items() for i in range(n)]


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"homes": {"params": "cpu"}}, "unknown tensor class(es) ['params']"),
    ({"homes": {"grad": "disk"}}, "homes['grad'] = 'disk'"),
    ({"device": "tpu"}, "device = 'tpu'"),
    ({"wait_timeout_s": 0}, "wait_timeout_s = 0"),
])
def test_bad_settings_name_the_field(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(SettingsError) as err:
        TierSettings(**kwargs)  # type: ignore[arg-type]
    assert needle in str(err.value)


def test_bad_pool_and_prefetch_values() -> None:
    with pytest.raises(SettingsError, match=r"pool\.buffer_count = 0"):
        PoolSettings(buffer_count=0)
    with pytest.raises(SettingsError, match=r"budgets\.host = -1"):
        Budgets(host=-1)
    with pytest.raises(SettingsError, match=r"prefetch\.nvme_bytes"):
        PrefetchSettings(nvme_bytes=-5)


def test_detected_budgets_subtract_reserves(tmp_path: object) -> None:
    got = resolve_budgets(Budgets(device=10, host=None, nvme=None, host_reserve=0, nvme_reserve=0),
                          CPU, str(tmp_path), needs_nvme=True)
    assert got.device == 10 and got.host > 0 and got.nvme > 0
    reserved = resolve_budgets(Budgets(device=10, host_reserve=1 << 62), CPU, str(tmp_path),
                               needs_nvme=True)
    assert reserved.host == 0  # the reserve never makes a budget negative
    with pytest.raises(PlanError, match="explicit budget"):
        resolve_budgets(Budgets(), CPU, None, needs_nvme=False)
    with pytest.raises(PlanError, match="swap_path"):
        resolve_budgets(Budgets(device=1, host=1), CPU, None, needs_nvme=True)


def test_auto_spills_optimizer_state_before_params(caplog: pytest.LogCaptureFixture) -> None:
    specs = specs_of({"param": (4, MiB // 4), "grad": (4, MiB // 4), "master": (4, MiB // 4),
                      "exp_avg": (4, MiB // 4), "exp_avg_sq": (4, MiB // 4)})  # 1 MiB each
    # device: 2 params + one cache reserve; host: params, grads, master + pool
    settings = TierSettings(device="cpu", persist_bytes=0,
                            pool=PoolSettings(buffer_count=2),
                            budgets=Budgets(device=3 * MiB, host=16 * MiB, nvme=1 << 30))
    budgets = TierBudgets(device=3 * MiB, host=16 * MiB, nvme=1 << 30)
    with caplog.at_level(logging.INFO, logger="tierzero.offload.placement"):
        plan = plan_placement(specs, settings, budgets, CPU)
    where = {cls: sorted(plan.homes[s.key] for s in specs if s.cls == cls)
             for cls in ("param", "grad", "master", "exp_avg", "exp_avg_sq")}
    assert where["param"] == ["device", "device", "host", "host"]
    assert where["grad"] == ["host"] * 4 and where["master"] == ["host"] * 4
    # host room 16 - 2 (pool) = 14 MiB: 2 params + 4 grads + 4 master + 4 exp_avg; exp_avg_sq spills
    assert where["exp_avg"] == ["host"] * 4 and where["exp_avg_sq"] == ["nvme"] * 4
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("placement ")]
    assert len(lines) == 5 and all("auto" in line for line in lines)
    assert plan.pool_count == 2 and plan.pool_buffer_bytes == MiB


def test_auto_keeps_small_shards_resident() -> None:
    specs = [*specs_of({"exp_avg_sq": (3, MiB // 4)}),
             ShardSpec("tiny", "exp_avg_sq", 16, torch.float32)]
    settings = TierSettings(device="cpu", persist_bytes=1024, pool=PoolSettings(buffer_count=1))
    plan = plan_placement(specs, settings, TierBudgets(device=MiB, host=2 * MiB + 64,
                                                       nvme=1 << 30), CPU)
    assert plan.homes["tiny"] == "host"  # small: placed first, stays on the fast tier
    assert sorted(plan.homes[s.key] for s in specs[:3]) == ["host", "nvme", "nvme"]


def test_plan_that_cannot_fit_names_tier_and_shortfall() -> None:
    specs = specs_of({"param": (2, MiB // 4), "master": (2, MiB // 4)})
    settings = TierSettings(device="cpu", homes={"param": "none", "master": "cpu"})
    with pytest.raises(PlanError) as err:
        plan_placement(specs, settings, TierBudgets(device=2 * MiB, host=MiB, nvme=0), CPU)
    msg = str(err.value)
    assert "tier host is short by 1048576 bytes" in msg and "master 2097152" in msg
    with pytest.raises(PlanError, match="tier device is short by 1 bytes"):
        plan_placement(specs, settings, TierBudgets(device=2 * MiB - 1, host=4 * MiB, nvme=0), CPU)


def test_pool_too_small_for_a_shard_and_degraded_pool(caplog: pytest.LogCaptureFixture) -> None:
    specs = specs_of({"master": (2, MiB // 4)})
    nvme = TierBudgets(device=0, host=10 * MiB, nvme=1 << 30)
    small = TierSettings(device="cpu", homes={"master": "nvme"},
                         pool=PoolSettings(buffer_bytes=4096))
    with pytest.raises(PlanError, match=r"buffer_bytes = 4096 is smaller than NVMe shard"):
        plan_placement(specs, small, nvme, CPU)
    want8 = TierSettings(device="cpu", homes={"master": "nvme"}, pool=PoolSettings(buffer_count=8))
    with caplog.at_level(logging.WARNING, logger="tierzero.offload.placement"):
        plan = plan_placement(specs, want8, TierBudgets(device=0, host=3 * MiB, nvme=1 << 30), CPU)
    assert plan.pool_count == 3  # fewer in flight instead of failing
    assert sum("host budget is tight" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(PlanError, match="tier host is short by"):
        plan_placement(specs, want8, TierBudgets(device=0, host=MiB - 1, nvme=1 << 30), CPU)


def test_pinned_pool_is_cut_to_the_memlock_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = specs_of({"master": (2, MiB // 4)})
    settings = TierSettings(device="cpu", homes={"master": "nvme"},
                            pool=PoolSettings(buffer_count=6))
    budgets = TierBudgets(device=0, host=64 * MiB, nvme=1 << 30)
    monkeypatch.setattr(placement_mod, "memlock_limit", lambda: 2 * MiB + 5)
    count, buf, pin = placement_mod._pool_shape(
        {s.key: s for s in specs}, {s.key: "nvme" for s in specs}, settings, budgets, True,
        final=True)
    assert (count, buf, pin) == (2, MiB, True)
    monkeypatch.setattr(placement_mod, "memlock_limit", lambda: 4096)
    count, _, pin = placement_mod._pool_shape(
        {s.key: s for s in specs}, {s.key: "nvme" for s in specs}, settings, budgets, True,
        final=True)
    assert (count, pin) == (6, False)  # below one buffer: stay pageable, keep the count


def test_duplicate_and_empty_shards_are_rejected() -> None:
    s = ShardSpec("a", "grad", 4, torch.float32)
    settings = TierSettings(device="cpu")
    budgets = TierBudgets(device=MiB, host=MiB, nvme=0)
    with pytest.raises(PlanError, match="listed twice"):
        plan_placement([s, s], settings, budgets, CPU)
    with pytest.raises(PlanError, match="numel 0"):
        plan_placement([ShardSpec("z", "grad", 0, torch.float32)], settings, budgets, CPU)
