"""Accounting for the tier manager: bytes per tier and class, traffic, stalls.

The manager calls :meth:`Accounting.add` whenever a copy becomes present or
absent (the only place residency bytes change), so current bytes always equal
the sum over the residency records; ``TierManager.audit`` re-derives them from
the records to prove it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .settings import TENSOR_CLASSES, TIERS, TensorClass, Tier
from .transfer import DIRECTIONS, Direction


@dataclass(frozen=True)
class MemoryReport:
    """A snapshot of where the bytes are and what moving them cost."""

    budget: dict[Tier, int]
    current: dict[Tier, int]  # bytes held now, pool included on host
    peak: dict[Tier, int]
    current_by_class: dict[Tier, dict[TensorClass, int]]  # shard bytes (pool excluded)
    peak_by_class: dict[Tier, dict[TensorClass, int]]
    moved: dict[Direction, int]  # bytes per direction since start
    moved_by_class: dict[Direction, dict[TensorClass, int]]  # the same, split by class
    transfers: dict[Direction, int]  # number of transfers per direction
    stall_s: float  # seconds callers blocked in TierTransfer.wait() on fetches
    hits: int  # fetches that found their copy present or already in flight
    misses: int  # fetches that had to start a transfer
    prefetches: int  # transfers started by the prefetch queue
    evictions: int
    writebacks: int  # dirty copies written one tier down
    order_mismatches: int  # fetches that did not follow the recorded order
    pool_buffers: int
    pool_buffer_bytes: int
    pool_in_use: int  # buffers taken now (host caches of NVMe shards, staging)
    pool_peak_in_use: int
    # host buffers handed out by TierManager.host_empty (the CPU Adam's ring, a whole shard
    # assembled from pieces), by purpose: host memory outside the budgeted tier
    outside: dict[str, int] = field(default_factory=dict)
    outside_peak: int = 0  # peak of their sum

    def lines(self) -> list[str]:
        """A human-readable summary, one line per tier then traffic."""
        out = [
            f"{t}: {self.current[t]} B now, {self.peak[t]} B peak, {self.budget[t]} B budget"
            for t in TIERS
        ]
        out.append("moved: " + ", ".join(f"{d} {self.moved[d]} B" for d in DIRECTIONS))
        out.append(f"stall {self.stall_s:.3f} s, hits {self.hits}, misses {self.misses}, "
                   f"prefetches {self.prefetches}, evictions {self.evictions}")
        return out


def _zero_classes() -> dict[TensorClass, int]:
    return dict.fromkeys(TENSOR_CLASSES, 0)


@dataclass
class Accounting:
    """Running counters; residency bytes move only through :meth:`add`."""

    budget: dict[Tier, int]
    base: dict[Tier, int]  # fixed bytes per tier (the host pool)
    by_class: dict[Tier, dict[TensorClass, int]] = field(
        default_factory=lambda: {t: _zero_classes() for t in TIERS})
    peak_by_class: dict[Tier, dict[TensorClass, int]] = field(
        default_factory=lambda: {t: _zero_classes() for t in TIERS})
    peak: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    moved: dict[Direction, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    moved_by_class: dict[Direction, dict[TensorClass, int]] = field(
        default_factory=lambda: {d: _zero_classes() for d in DIRECTIONS})
    transfers: dict[Direction, int] = field(
        default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    stall_s: float = 0.0
    hits: int = 0
    misses: int = 0
    prefetches: int = 0
    evictions: int = 0
    writebacks: int = 0
    outside: dict[str, int] = field(default_factory=dict)  # host_empty bytes by purpose
    outside_peak: int = 0

    def __post_init__(self) -> None:
        for t in TIERS:
            self.peak[t] = self.base[t]

    def current(self, tier: Tier) -> int:
        return self.base[tier] + sum(self.by_class[tier].values())

    def add(self, tier: Tier, cls: TensorClass, nbytes: int) -> None:
        self.by_class[tier][cls] += nbytes
        self.peak_by_class[tier][cls] = max(self.peak_by_class[tier][cls],
                                            self.by_class[tier][cls])
        self.peak[tier] = max(self.peak[tier], self.current(tier))

    def add_outside(self, purpose: str, nbytes: int) -> None:
        self.outside[purpose] = self.outside.get(purpose, 0) + nbytes
        self.outside_peak = max(self.outside_peak, sum(self.outside.values()))

    def moved_bytes(self, direction: Direction | None, cls: TensorClass, nbytes: int) -> None:
        if direction is not None:
            self.moved[direction] += nbytes
            self.moved_by_class[direction][cls] += nbytes
            self.transfers[direction] += 1

    def report(self, *, mismatches: int, pool: tuple[int, int, int, int]) -> MemoryReport:
        return MemoryReport(
            budget=dict(self.budget),
            current={t: self.current(t) for t in TIERS},
            peak=dict(self.peak),
            current_by_class={t: dict(c) for t, c in self.by_class.items()},
            peak_by_class={t: dict(c) for t, c in self.peak_by_class.items()},
            moved=dict(self.moved),
            moved_by_class={d: dict(c) for d, c in self.moved_by_class.items()},
            transfers=dict(self.transfers),
            stall_s=self.stall_s,
            hits=self.hits,
            misses=self.misses,
            prefetches=self.prefetches,
            evictions=self.evictions,
            writebacks=self.writebacks,
            order_mismatches=mismatches,
            pool_buffers=pool[0],
            pool_buffer_bytes=pool[1],
            pool_in_use=pool[2],
            pool_peak_in_use=pool[3],
            outside=dict(self.outside),
            outside_peak=self.outside_peak,
        )
