"""Placement: give every shard a home tier and size the host pool, before any
allocation. A plan that cannot fit raises PlanError naming the short tier and
by how many bytes.

[Note: auto placement]
Fixed classes (``none`` -> device, ``cpu`` -> host, ``nvme`` -> nvme) are
placed first. ``auto`` shards are then visited small-first for those at most
``persist_bytes`` (small shards stay resident: each costs a transfer but few
bytes), then by class in order of bytes moved per step when not resident:
``param`` (read in forward and backward) before ``grad`` (written every
micro-step) before ``master``, ``exp_avg``, ``exp_avg_sq`` (touched once per
step by the CPU optimizer). Each goes to the fastest tier with room, so
optimizer state spills to NVMe before parameters do. Only ``param`` may be
homed on the device: the optimizer runs on the CPU, so the other classes are
only ever consumed on the host.

[Note: host allowance]
``TierSettings.host_allowance[cls]`` (the engine fills it for param from
``offload.params.max_in_cpu_bytes``, DeepSpeed's ``max_in_cpu``) lets a class
fixed on ``nvme`` keep some shards homed in host memory: they are visited in
the order ``plan_placement`` is given them and each goes to host while the
class's running total stays within the allowance and the host budget has room
after fixed homes and the full NVMe staging pool (first fit: a shard too large
is skipped, later smaller ones may still fit). Such a shard is an ordinary
host-homed shard from then on (one authoritative copy, no NVMe file space):
gathers read it from host memory, the optimizer writes it there. The engine
passes param in forward order, blocks first and the root last
([Note: which shards the host keeps] in engine/shards/tier_config.py).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from tierzero.swap.header import HEADER_BYTES

from .budget import TierBudgets, memlock_limit
from .errors import PlanError
from .residency import ShardSpec
from .settings import (
    FIXED_HOME,
    STEP_CLASSES,
    TENSOR_CLASSES,
    TIERS,
    TensorClass,
    Tier,
    TierSettings,
)

log = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGE_SIZE")
AUTO_TIERS: dict[TensorClass, tuple[Tier, ...]] = {
    "param": ("device", "host", "nvme"),
    "grad": ("host", "nvme"),
    "master": ("host", "nvme"),
    "exp_avg": ("host", "nvme"),
    "exp_avg_sq": ("host", "nvme"),
}


def align_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Plan:
    """Homes for every shard, resolved budgets and the host pool's shape."""

    specs: Mapping[str, ShardSpec]
    homes: Mapping[str, Tier]
    # shards of a class fixed on nvme homed in host memory by its host allowance
    host_kept: frozenset[str]
    budgets: TierBudgets
    pool_count: int  # host staging buffers (0 when nothing lives on NVMe)
    pool_buffer_bytes: int
    pin: bool  # page-lock the pool (CUDA only, within ulimit -l)
    device_reserve: int  # device bytes kept free for caches of shards homed below

    def home_bytes(self, tier: Tier) -> int:
        return self._home_bytes.get(tier, 0)

    @cached_property
    def _home_bytes(self) -> dict[str, int]:
        """Bytes homed per tier, summed once: the tier manager asks on every device-tier
        fetch, and a 70B model has tens of thousands of shards. The plan's specs and homes
        are not changed after placement."""
        out: dict[str, int] = {}
        for k, s in self.specs.items():
            out[self.homes[k]] = out.get(self.homes[k], 0) + s.nbytes
        return out

    @property
    def pool_bytes(self) -> int:
        return self.pool_count * self.pool_buffer_bytes

    def swap_file_bytes(self) -> int:
        """What the swap file grows to, not only what it holds.

        [Note: swap file growth]
        Every NVMe-homed shard is a region: a 4 KiB header and its payload padded to 4 KiB.
        Every write is copy-on-write (swap/store.py): the new copy is written beside the
        old, which is freed only once the new one is committed, so while writes are in
        flight the file holds two copies of what they write. What they write comes from
        host buffers (the staging pool, and the CPU Adam's ring outside the manager,
        `budgets.nvme_in_flight`), so at most those bytes are doubled."""
        regions = sum(HEADER_BYTES + align_up(s.nbytes) for k, s in self.specs.items()
                      if self.homes[k] == "nvme")
        if not regions:
            return 0
        return regions + self.pool_bytes + self.budgets.nvme_in_flight


def plan_placement(
    specs: Sequence[ShardSpec], settings: TierSettings, budgets: TierBudgets,
    device: torch.device,
) -> Plan:
    """Decide homes and pool size; raise PlanError if the budgets cannot hold them."""
    by_key: dict[str, ShardSpec] = {}
    for spec in specs:
        if spec.key in by_key:
            raise PlanError(f"shard key {spec.key!r} is listed twice; keys must be unique")
        if spec.numel <= 0:
            raise PlanError(f"shard {spec.key!r} has numel {spec.numel}; expected > 0")
        by_key[spec.key] = spec
    fixed: dict[str, Tier] = {
        s.key: FIXED_HOME[settings.homes[s.cls]]
        for s in specs if settings.homes[s.cls] != "auto"
    }
    auto = [s for s in specs if settings.homes[s.cls] == "auto"]
    order = sorted(auto, key=lambda s: (s.nbytes > settings.persist_bytes,
                                        TENSOR_CLASSES.index(s.cls), s.nbytes))
    # room for one cache of the largest shard the engine gathers to the device
    # (param in forward/backward, grad on its way down); optimizer state is
    # consumed on the host and never needs device room.
    device_reserve = max((s.nbytes for s in specs if s.cls in STEP_CLASSES
                          and fixed.get(s.key) != "device"), default=0)
    pin = device.type == "cuda" and settings.pool.pin_memory
    pool_reserved = 0
    homes: dict[str, Tier] = {}
    kept: set[str] = set()
    for _ in range(4):  # reserving the pool may spill more to NVMe: iterate to a fixed point
        homes = dict(fixed)
        room: dict[Tier, int] = {
            "device": budgets.device - device_reserve - _sum(by_key, fixed, "device"),
            "host": budgets.host - pool_reserved - _sum(by_key, fixed, "host"),
            "nvme": budgets.nvme - _sum(by_key, fixed, "nvme"),
        }
        kept = _keep_in_host(specs, settings, homes, room)
        for spec in order:
            tier: Tier = next((t for t in AUTO_TIERS[spec.cls] if room[t] >= spec.nbytes), "nvme")
            homes[spec.key] = tier
            room[tier] -= spec.nbytes
        count, buf, _ = _pool_shape(by_key, homes, settings, budgets, pin, final=False)
        if count * buf == pool_reserved:
            break
        pool_reserved = count * buf
    count, buf, pin = _pool_shape(by_key, homes, settings, budgets, pin, final=True)
    plan = Plan(by_key, homes, frozenset(kept), budgets, count, buf, pin, device_reserve)
    _check_fit(plan)
    _explain(plan, settings)
    return plan


def _keep_in_host(specs: Sequence[ShardSpec], settings: TierSettings, homes: dict[str, Tier],
                  room: dict[Tier, int]) -> set[str]:
    """Rehome shards of nvme classes in host memory within their host allowance ([Note:
    host allowance]); updates `homes` and `room`, returns the keys moved."""
    kept: set[str] = set()
    left = dict(settings.host_allowance)
    for spec in specs:
        if homes.get(spec.key) != "nvme" or spec.nbytes > min(left.get(spec.cls, 0),
                                                               room["host"]):
            continue
        homes[spec.key] = "host"
        kept.add(spec.key)
        left[spec.cls] -= spec.nbytes
        room["host"] -= spec.nbytes
        room["nvme"] += spec.nbytes
    return kept


def _sum(specs: Mapping[str, ShardSpec], homes: Mapping[str, Tier], tier: Tier) -> int:
    return sum(specs[k].nbytes for k, t in homes.items() if t == tier)


def _pool_shape(
    specs: Mapping[str, ShardSpec], homes: Mapping[str, Tier], settings: TierSettings,
    budgets: TierBudgets, pin: bool, *, final: bool,
) -> tuple[int, int, bool]:
    """(buffer count, buffer bytes, pinned) for the NVMe staging pool.

    A buffer holds the largest NVMe shard of a class staged every step
    (``pool.staged``); the buffers together hold the largest NVMe shard of any
    class, which takes a span of them when it is staged ([Note: pool spans]).
    """
    on_nvme = [specs[k] for k, t in homes.items() if t == "nvme"]
    if not on_nvme:
        return 0, 0, pin
    largest = max(on_nvme, key=lambda s: s.nbytes)
    staged = [s for s in on_nvme if s.cls in settings.pool.staged]
    fixed = settings.pool.buffer_bytes
    pf = settings.prefetch
    if staged:
        top = max(staged, key=lambda s: s.nbytes)
        buf = fixed or align_up(top.nbytes)
        if buf < top.nbytes:
            raise PlanError(
                f"pool.buffer_bytes = {buf} is smaller than NVMe shard {top.key!r} "
                f"({top.nbytes} bytes); raise buffer_bytes to at least {align_up(top.nbytes)} "
                "or leave it None to size from the shards"
            )
        want = settings.pool.buffer_count or math.ceil((pf.nvme_bytes + pf.device_bytes) / buf) + 2
    else:  # nothing passes through per step: one staging span plus one for a write-back
        want = settings.pool.buffer_count or 2
        buf = fixed or align_up(-(-largest.nbytes // want))
    if fixed is None:
        buf = max(buf, align_up(-(-largest.nbytes // want)))
    elif want * buf < largest.nbytes:
        raise PlanError(
            f"pool.buffer_count x buffer_bytes = {want} x {buf} is smaller than NVMe shard "
            f"{largest.key!r} ({largest.nbytes} bytes), which must fit a span of the pool; "
            "raise either, or leave buffer_bytes None to size from the shards")
    if not final:  # auto placement reserves the full pool before filling the host
        return want, buf, pin
    host_room = budgets.host - _sum(specs, homes, "host")
    count = min(want, max(0, host_room) // buf)
    if count >= 1 and count * buf < largest.nbytes and fixed is None:
        buf = align_up(-(-largest.nbytes // count))  # fewer buffers left: make them larger
        if count * buf > host_room:  # page rounding of the split: one buffer, if it fits
            count, buf = (1, align_up(largest.nbytes)) if align_up(
                largest.nbytes) <= host_room else (0, buf)
    if 1 <= count < want:
        log.warning("host budget is tight: the NVMe pool gets %d buffers of %d bytes instead of "
                    "%d; fewer transfers can be in flight (slower, not failing)", count, buf, want)
    limit = memlock_limit()
    if pin and limit is not None and limit // buf < count:
        if (limit // buf) * buf >= largest.nbytes:
            log.warning("ulimit -l is %d bytes: the pinned pool is cut to %d buffers "
                        "(wanted %d); raise the memlock limit for more in flight",
                        limit, limit // buf, count)
            count = limit // buf
        else:
            log.warning("ulimit -l is %d bytes, less than the largest NVMe shard (%d bytes) "
                        "in %d-byte pool buffers: the pool stays pageable (slower copies); "
                        "raise the memlock limit to pin it", limit, largest.nbytes, buf)
            pin = False
    if count < 1:
        need = align_up(largest.nbytes)
        raise PlanError(
            f"tier host is short by {need - host_room} bytes: the NVMe staging pool needs at "
            f"least {need} bytes (NVMe shard {largest.key!r}) but the host budget "
            f"({budgets.host}) minus host-homed shards ({_sum(specs, homes, 'host')}) leaves "
            f"{host_room}; raise the host budget or move classes to nvme"
        )
    return count, buf, pin


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _check_fit(plan: Plan) -> None:
    need = {
        "device": plan.home_bytes("device") + plan.device_reserve,
        "host": plan.home_bytes("host") + plan.pool_bytes,
        "nvme": plan.swap_file_bytes(),
    }
    for tier in TIERS:
        budget = plan.budgets.of(tier)
        if tier == "nvme" and need[tier] > budget and plan.budgets.nvme_free is not None:
            b = plan.budgets
            raise PlanError(
                f"not enough disk space for the swap file in {b.nvme_path}: it grows to "
                f"{need[tier]} bytes ({_mb(need[tier])}: shards {plan.home_bytes('nvme')}, "
                f"copy-on-write copies in flight {need[tier] - plan.home_bytes('nvme')}), the "
                f"file system has {b.nvme_free} bytes free ({_mb(b.nvme_free or 0)}), of "
                f"which {b.nvme_reserve} are kept free (offload.budgets.nvme_reserve_fraction);"
                " free space there, point offload.path at a larger file system, or move a "
                "class off nvme")
        if need[tier] > budget:
            by_cls = {c: 0 for c in TENSOR_CLASSES}
            for k, s in plan.specs.items():
                if plan.homes[k] == tier:
                    by_cls[s.cls] += s.nbytes
            parts = ", ".join(f"{c} {n}" for c, n in by_cls.items() if n)
            extra = {"device": f"; cache reserve {plan.device_reserve}",
                     "host": f"; NVMe pool {plan.pool_bytes}", "nvme": ""}[tier]
            raise PlanError(
                f"tier {tier} is short by {need[tier] - budget} bytes: the plan needs "
                f"{need[tier]} (homes: {parts}{extra}) but the budget is {budget}; raise the "
                f"{tier} budget or move a class to a slower tier"
            )


def _explain(plan: Plan, settings: TierSettings) -> None:
    for cls in TENSOR_CLASSES:
        keys = [k for k, s in plan.specs.items() if s.cls == cls]
        if not keys:
            continue
        split = {t: [k for k in keys if plan.homes[k] == t] for t in TIERS}
        where = ", ".join(
            f"{t} {len(ks)} ({sum(plan.specs[k].nbytes for k in ks)} B)"
            for t, ks in split.items() if ks
        )
        how = ("auto: fastest tier with room, small shards and param first, optimizer "
               "state spills first" if settings.homes[cls] == "auto"
               else f"fixed: offload device {settings.homes[cls]!r}")
        allowance = settings.host_allowance.get(cls, 0)
        if allowance and cls == "grad":  # the host budget itself: keep what has room
            kept = [k for k in keys if k in plan.host_kept]
            how += f"; {len(kept)} shards kept in host memory while the host budget has room"
        elif allowance:
            kept = [k for k in keys if k in plan.host_kept]
            how += (f"; host allowance {allowance} B keeps {len(kept)} shards "
                    f"({sum(plan.specs[k].nbytes for k in kept)} B) in host memory")
            if len(kept) < len(keys) and sum(plan.specs[k].nbytes for k in kept) + min(
                    plan.specs[k].nbytes for k in keys if k not in plan.host_kept) <= allowance:
                log.warning("placement %s: the host budget (%d B) leaves room for only %d of "
                            "the shards its host allowance (%d B) would keep; the rest stay "
                            "on NVMe", cls, plan.budgets.host, len(kept), allowance)
        log.info("placement %s: %d shards -> %s [%s]", cls, len(keys), where, how)
