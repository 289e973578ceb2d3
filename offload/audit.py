"""The tier manager's invariants, re-derived from its records (TierManager.audit)."""

from __future__ import annotations

from collections.abc import Mapping

from .errors import OffloadError
from .pool import BufferPool
from .report import Accounting
from .residency import Role, ShardRecord, State
from .settings import TIERS


def check_records(records: Mapping[str, ShardRecord], pool: BufferPool,
                  acct: Accounting) -> None:
    """Caches inclusive down to each home, no dirty home copy, no over-release, byte
    counters equal to what the records hold, no tier over its budget at its peak, every
    taken pool buffer held by a host cache; raise OffloadError naming the first break."""
    derived = dict.fromkeys(TIERS, 0)
    slots = 0
    for key, rec in records.items():
        present = [t for t in TIERS if rec.copies[t].state is not State.ABSENT]
        if present and present != list(TIERS[TIERS.index(present[0]):
                                             TIERS.index(rec.home) + 1]):
            raise OffloadError(f"audit: shard {key!r} has copies on {present}: caches "
                               f"are not inclusive down to its home {rec.home}")
        for t in present:
            copy = rec.copies[t]
            if copy.slot is not None:
                slots += copy.slot.span
            else:
                derived[t] += rec.spec.nbytes
            if copy.role is Role.HOME and copy.state is State.DIRTY:
                raise OffloadError(f"audit: the home copy of {key!r} is dirty")
            if copy.users < 0:
                raise OffloadError(f"audit: {key!r} on {t} released more than fetched")
    derived["host"] += pool.nbytes
    for t in TIERS:
        if derived[t] != acct.current(t):
            raise OffloadError(f"audit: {t} holds {derived[t]} bytes by the records but "
                               f"{acct.current(t)} by the counters")
        if acct.peak[t] > acct.budget[t]:
            raise OffloadError(f"audit: {t} peaked at {acct.peak[t]} bytes, over "
                               f"its budget {acct.budget[t]}")
    if slots != pool.in_use:
        raise OffloadError(f"audit: {pool.in_use} pool buffers are taken but "
                           f"{slots} host caches hold one (leak)")
