"""Residency: one record per shard, copies per tier, and the legal transitions.

[Note: residency model]
Each shard has exactly one authoritative copy, on its *home* tier. Faster
tiers may hold caches. Caches are inclusive: a shard cached on ``device`` is
also present on every tier between device and its home, so a fetch always
loads from the next slower tier and a write-back always goes one tier down.
A cache is CLEAN (equal to the copy below) or DIRTY (newer). Only the
TierManager mutates records, and only through :func:`transition`, which looks
the move up in ``TRANSITIONS``; an illegal move is a bug and raises.
Byte accounting is derived from these records (see TierManager.audit).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .errors import OffloadError
from .settings import TIERS, TensorClass, Tier

if TYPE_CHECKING:
    from .pool import PoolBuffer
    from .transfer import TierTransfer


class State(enum.Enum):
    ABSENT = "absent"
    LOADING = "loading"  # a cache being filled from the copy below
    CLEAN = "clean"
    DIRTY = "dirty"  # a cache newer than the copy below
    STORING = "storing"  # a dirty cache being written one tier down
    FILLING = "filling"  # receiving a write-back (or the first data) from above


class Op(enum.Enum):
    PLACE = "place"  # first data arrives at the home copy
    LOAD = "load"  # start filling a cache from below
    LOADED = "loaded"
    FAILED = "failed"
    WRITE = "write"  # a cache created holding new data (staging a place)
    MODIFY = "modify"  # a holder may write the cache
    STORE = "store"  # start writing a dirty cache down
    STORED = "stored"
    RECEIVE = "receive"  # start receiving a write-back from above
    FILLED = "filled"
    DROP = "drop"
    DISCARD = "discard"  # the whole shard is overwritten at its home: caches are void


class Role(enum.Enum):
    HOME = "home"
    CACHE = "cache"


_S, _O, _H, _C = State, Op, Role.HOME, Role.CACHE
# (role, state, op) -> next state. Anything absent is illegal.
TRANSITIONS: dict[tuple[Role, State, Op], State] = {
    (_H, _S.ABSENT, _O.PLACE): _S.FILLING,
    (_H, _S.FILLING, _O.FILLED): _S.CLEAN,
    (_H, _S.CLEAN, _O.RECEIVE): _S.FILLING,
    (_H, _S.FILLING, _O.FAILED): _S.CLEAN,  # the cache above is still DIRTY: newer data kept
    (_H, _S.CLEAN, _O.DROP): _S.ABSENT,  # shard removed
    (_C, _S.ABSENT, _O.LOAD): _S.LOADING,
    (_C, _S.LOADING, _O.LOADED): _S.CLEAN,
    (_C, _S.LOADING, _O.FAILED): _S.ABSENT,
    (_C, _S.ABSENT, _O.WRITE): _S.DIRTY,
    (_C, _S.CLEAN, _O.MODIFY): _S.DIRTY,
    (_C, _S.DIRTY, _O.MODIFY): _S.DIRTY,
    (_C, _S.DIRTY, _O.STORE): _S.STORING,
    (_C, _S.STORING, _O.STORED): _S.CLEAN,
    (_C, _S.STORING, _O.FAILED): _S.DIRTY,  # write-back failed: keep the data, stay dirty
    (_C, _S.CLEAN, _O.RECEIVE): _S.FILLING,
    (_C, _S.DIRTY, _O.RECEIVE): _S.FILLING,
    (_C, _S.FILLING, _O.FILLED): _S.DIRTY,
    (_C, _S.FILLING, _O.FAILED): _S.DIRTY,  # the source above is still DIRTY and newer
    (_C, _S.CLEAN, _O.DROP): _S.ABSENT,  # never DIRTY -> ABSENT: data would be lost
    # ... unless the home copy is about to be overwritten whole (TierManager.write_from)
    (_C, _S.CLEAN, _O.DISCARD): _S.ABSENT,
    (_C, _S.DIRTY, _O.DISCARD): _S.ABSENT,
}
TRANSIENT = frozenset({State.LOADING, State.STORING, State.FILLING})
PRESENT = frozenset(State) - {State.ABSENT}


@dataclass(frozen=True)
class ShardSpec:
    """What a shard is: a name, a tensor class, and a flat size."""

    key: str
    cls: TensorClass
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


_tick = itertools.count()


@dataclass
class Copy:
    """One tier's copy of a shard."""

    tier: Tier
    role: Role
    state: State = State.ABSENT
    data: torch.Tensor | None = None  # 1D, spec dtype; None on nvme (lives in swap)
    slot: PoolBuffer | None = None  # the pool buffer behind ``data`` (NVMe shards' host cache)
    transfer: TierTransfer | None = None  # in flight into or out of this copy
    users: int = 0  # holders between fetch() and release()
    write_held: bool = False  # fetched writable and not yet fully released: not a source
    pinned: bool = False  # persistent: never evicted by pressure
    drop_when_clean: bool = False  # evict() asked for it; dropped once written back
    modify_on_load: bool = False  # fetched writable while loading: MODIFY once LOADED
    last_use: int = field(default_factory=lambda: next(_tick))

    def touch(self) -> None:
        self.last_use = next(_tick)


@dataclass
class ShardRecord:
    """The single residency record of a shard, owned by the TierManager."""

    spec: ShardSpec
    home: Tier
    copies: dict[Tier, Copy] = field(default_factory=dict)
    # Bumped whenever the shard's data may change (a writable fetch and its release,
    # write_from): a copy read out at version v is current while the version is v.
    version: int = 0
    # [Note: a lost write]: why the last write to the home failed with no copy left of
    # what it wrote; the home holds older data and is not read until written again
    lost: str | None = None

    def __post_init__(self) -> None:
        for tier in TIERS:
            role = Role.HOME if tier == self.home else Role.CACHE
            self.copies[tier] = Copy(tier=tier, role=role)

    def below(self, tier: Tier) -> Tier:
        """The next slower tier that holds (or will hold) this shard's data."""
        index = TIERS.index(tier)
        if tier == self.home or index + 1 >= len(TIERS):
            raise OffloadError(f"shard {self.spec.key!r}: no tier below {tier!r}")
        return TIERS[index + 1]

    def cache_tiers(self) -> tuple[Tier, ...]:
        """Tiers faster than home, fastest first."""
        return TIERS[: TIERS.index(self.home)]


def transition(record: ShardRecord, tier: Tier, op: Op) -> State:
    """Apply ``op`` to ``record``'s copy on ``tier`` through the table."""
    copy = record.copies[tier]
    nxt = TRANSITIONS.get((copy.role, copy.state, op))
    if nxt is None:
        raise OffloadError(
            f"illegal residency move for shard {record.spec.key!r} on {tier}: "
            f"{copy.role.value} copy in state {copy.state.value} cannot {op.value}"
        )
    copy.state = nxt
    return nxt
