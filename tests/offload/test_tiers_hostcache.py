"""Host allowance of a class homed on NVMe ([Note: host allowance] in offload/placement.py):
which shards stay in host memory, how the host budget and the staging pool bound it, the
settings checks, the engine's translation of offload.params.max_in_cpu_bytes, and a
tier manager moving data through a plan with both kinds of param home."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from tierzero.engine.config import load_config
from tierzero.engine.shards.tier_config import tier_settings
from tierzero.offload import (
    Budgets,
    PoolSettings,
    SettingsError,
    ShardSpec,
    TierBudgets,
    TierManager,
    TierSettings,
    plan_placement,
)
from tierzero.swap import SwapStore

CPU = torch.device("cpu")
MiB = 1 << 20
PAGE = 4096
# 6 param shards of 4 pages each (bf16: 8192 elements = 16 KiB), plus fp32 masters
P16 = [ShardSpec(f"u{i}:param", "param", 8192, torch.bfloat16) for i in range(6)]
MASTER = [ShardSpec(f"u{i}:master", "master", 8192, torch.float32) for i in range(6)]
NVME_ALL = TierSettings(homes={"param": "nvme", "master": "nvme"},
                        pool=PoolSettings(buffer_count=2, staged=("param",)))


def _plan(allowance: int, host: int = 64 * MiB, specs: list[ShardSpec] | None = None,
          ) -> tuple[dict[str, str], frozenset[str], int]:
    settings = dataclasses.replace(NVME_ALL, host_allowance={"param": allowance})
    plan = plan_placement(specs or P16 + MASTER, settings,
                          TierBudgets(device=1 << 40, host=host, nvme=1 << 40), CPU)
    return dict(plan.homes), plan.host_kept, plan.pool_bytes


def test_allowance_keeps_the_first_shards_in_order_and_nothing_else() -> None:
    homes, kept, _ = _plan(3 * 16384 + 100)  # room for three shards, not four
    assert kept == {"u0:param", "u1:param", "u2:param"}
    assert [homes[s.key] for s in P16] == ["host"] * 3 + ["nvme"] * 3
    assert all(homes[s.key] == "nvme" for s in MASTER)  # another class: untouched
    none_homes, none_kept, _ = _plan(0)
    assert not none_kept and all(t == "nvme" for t in none_homes.values())


def test_first_fit_skips_a_shard_too_large_and_takes_later_smaller_ones() -> None:
    big = ShardSpec("root:param", "param", 4 * 8192, torch.bfloat16)  # 64 KiB
    specs = [P16[0], big, P16[1]]
    _, kept, _ = _plan(2 * 16384, specs=specs)
    assert kept == {"u0:param", "u1:param"}


def test_whole_class_in_host_needs_no_param_pool() -> None:
    homes, kept, pool = _plan(1 << 30, specs=list(P16))
    assert kept == {s.key for s in P16} and set(homes.values()) == {"host"}
    assert pool == 0  # nothing left on NVMe: no staging buffers


def test_host_budget_bounds_the_allowance_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    # host: the pool (2 x 16 KiB buffers, reserved first) + room for two shards
    with caplog.at_level(logging.INFO, logger="tierzero.offload.placement"):
        _, kept, pool = _plan(1 << 30, host=2 * 16384 + 2 * 16384 + 100)
    assert pool == 2 * 16384
    assert len(kept) == 2 and kept == {"u0:param", "u1:param"}
    text = caplog.text
    assert "host allowance 1073741824 B keeps 2 shards (32768 B) in host memory" in text
    assert "leaves room for only 2 of the shards" in text  # a warning, not a PlanError


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"host_allowance": {"params": 5}}, "unknown tensor class 'params'"),
    ({"host_allowance": {"param": -1}}, "host_allowance['param'] = -1"),
    ({"host_allowance": {"param": 1 << 20}, "homes": {"param": "cpu"}},
     "applies to classes homed on nvme"),
])
def test_bad_allowance_names_the_field(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(SettingsError) as err:
        TierSettings(**kwargs)  # type: ignore[arg-type]
    assert needle in str(err.value)


def _cfg(**params: object) -> TierSettings:
    config = load_config({"zero": {"stage": 3, "prefetch_bytes": 10 * MiB}, "offload": {
        "params": {"device": "nvme", "path": "/tmp", **params},
        "optimizer": {"device": "nvme", "path": "/tmp"},
        "budgets": {"host_bytes": 4 << 30}}})
    return tier_settings(config, CPU)


def test_engine_maps_max_in_cpu_bytes_and_keeps_the_prefetch_window() -> None:
    default = _cfg()
    # tierzero's default: 0, params on nvme are on nvme. With an explicit host budget the
    # gradient (grad_device auto) may use it ([Note: gradient home]).
    assert default.host_allowance == {"grad": 4 << 30}
    cached = _cfg(max_in_cpu_bytes=123 * MiB)
    assert cached.host_allowance == {"param": 123 * MiB, "grad": 4 << 30}
    # the NVMe window is 4 x zero.prefetch_bytes whatever max_in_cpu_bytes says
    for s in (default, cached, _cfg(max_in_cpu_bytes=1 * MiB)):
        assert s.prefetch.nvme_bytes == 40 * MiB and s.prefetch.device_bytes == 10 * MiB


def test_deepspeed_max_in_cpu_maps_and_its_absence_is_zero(
        caplog: pytest.LogCaptureFixture) -> None:
    base = {"zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": "/tmp"}}, "bf16": {"enabled": True}}
    with caplog.at_level(logging.INFO, logger="tierzero.engine.config.ds_offload"):
        assert load_config(base).offload.params.max_in_cpu_bytes == 0
    assert "max_in_cpu is not set: DeepSpeed's default (1e9 elements)" in caplog.text
    caplog.clear()
    base["zero_optimization"]["offload_param"]["max_in_cpu"] = 1e9  # type: ignore[index]
    with caplog.at_level(logging.INFO, logger="tierzero.engine.config.ds_offload"):
        assert load_config(base).offload.params.max_in_cpu_bytes == 2 * 10**9
    assert "max_in_cpu is not set" not in caplog.text


def test_manager_serves_and_updates_both_homes(tmp_path: object) -> None:
    """Place, fetch to the device tier, write new data through write_from (as the CPU Adam
    does): the host-homed shards never touch the swap file, the others round-trip it."""
    settings = dataclasses.replace(NVME_ALL, homes={"param": "nvme"},
                                   host_allowance={"param": 2 * 16384},
                                   budgets=Budgets(device=1 << 30, host=64 * MiB, nvme=1 << 30),
                                   device="cpu")
    with SwapStore(str(tmp_path)) as store, TierManager(P16, settings, swap=store) as mgr:
        assert [mgr.plan.homes[s.key] for s in P16] == ["host"] * 2 + ["nvme"] * 4
        for i, s in enumerate(P16):
            mgr.place(s.key, torch.full((8192,), float(i), dtype=torch.bfloat16)).wait()
        assert [mgr.home_of(s.key) for s in P16] == ["host"] * 2 + ["nvme"] * 4
        for i, s in enumerate(P16):
            new = torch.full((8192,), float(10 + i), dtype=torch.bfloat16)
            mgr.write_from(s.key, new, keep_host=True).wait()
        mgr.synchronize()
        for i, s in enumerate(P16):
            t = mgr.fetch(s.key, "device").wait()
            assert torch.equal(t, torch.full((8192,), float(10 + i), dtype=torch.bfloat16))
            mgr.release(s.key, "device")
        moved = mgr.memory_report().moved
        # only the four NVMe-homed shards were written to the swap file (place + update)
        assert moved["host_to_nvme"] == 2 * 4 * 16384
        mgr.audit()
