"""A unit: the parameters gathered and released together, and its state through a step.

[Note: unit residency]
A unit's full parameters are RELEASED (size-0 buffers; the shards hold the values),
GATHERED (every group's full buffer current), or STALE (gathered, but the shards changed
since: an optimizer step, a checkpoint load, a pretrained load). The unit moves between
them only through its own methods, each checked against `RESIDENCY_TRANSITIONS`:

    RELEASED --gather--> GATHERED --mark_stale--> STALE --gather--> GATHERED
    GATHERED / STALE --release (not persistent) / drop--> RELEASED

so a read of a copy that predates the shards (a STALE unit) is never mistaken for a
current one, and no caller flips the flags by hand. The scheduler decides *when* (order,
in-flight bounds, the driver's notifications); the unit does *what* (gather, release,
its per-pass gradient bookkeeping: which parameters fired, which groups are reduced).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch import nn

from tierzero.engine.collectives import Comm
from tierzero.engine.shards.flat import FlatGroup, gather_group, release_group
from tierzero.engine.shards.store import ShardStore
from tierzero.offload.step_seam import transition


class Residency(enum.Enum):
    """Where a unit's full parameters stand ([Note: unit residency])."""

    RELEASED = enum.auto()
    GATHERED = enum.auto()
    STALE = enum.auto()


RESIDENCY_TRANSITIONS: dict[Residency, frozenset[Residency]] = {
    Residency.RELEASED: frozenset({Residency.GATHERED, Residency.RELEASED}),
    Residency.GATHERED: frozenset({Residency.STALE, Residency.RELEASED}),
    Residency.STALE: frozenset({Residency.GATHERED, Residency.RELEASED, Residency.STALE}),
}


@dataclass
class Unit:
    """Runtime state of one unit (engine-owned; nothing is stored on the user's module)."""

    index: int
    name: str  # qualified module name; "" for the root
    module: nn.Module
    is_root: bool
    persistent: bool  # stays gathered (small, or stage 1/2)
    groups: list[FlatGroup]
    trainable: tuple[nn.Parameter, ...]
    has_frozen: bool
    # holds a leaf module (MoE): which parameters get gradients may differ across ranks, so
    # its gradients are reduced at the end of backward ([Note: units and rank divergence])
    dynamic: bool = False
    residency: Residency = Residency.RELEASED
    fired: set[int] = field(default_factory=set)  # ids of params whose grad arrived this backward
    reduced: bool = False  # grads of this backward already reduce-scattered (every group)
    reduced_groups: set[str] = field(default_factory=set)  # reduced one by one (the root's)
    # id of each trainable parameter -> its group (which group a late gradient belongs to)
    group_of: dict[int, FlatGroup] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.group_of = {id(s.param): g for g in self.groups if g.trainable for s in g.slots}
        if all(g.gathered for g in self.groups):
            # built from gathered groups, or nothing to gather (no parameters of its own)
            self.residency = Residency.GATHERED

    @property
    def label(self) -> str:
        return self.name or "<root>"

    # -- residency ([Note: unit residency]) ---------------------------------------------
    @property
    def gathered(self) -> bool:
        """Full parameters present (current or stale)."""
        return self.residency is not Residency.RELEASED

    @property
    def stale(self) -> bool:
        return self.residency is Residency.STALE

    @property
    def current(self) -> bool:
        """Gathered, and not older than the shards."""
        return self.residency is Residency.GATHERED

    def _allowed(self, new: Residency, call: str) -> Residency:
        return transition(f"unit {self.label!r}", RESIDENCY_TRANSITIONS, self.residency, new,
                          call=call, fix="gather a unit only when it is released or stale "
                          "([Note: unit residency] in engine/unit.py)")

    @property
    def lendable(self) -> bool:
        """Its gathers may view the store's buffers ([Note: a gather viewing the pool's
        buffer] in shards/lent.py): a unit released as soon as its backward ends. Not the
        root or a persistent unit (gathered across steps), and not one reduced at the end
        of backward (frozen parameters, a leaf module: gathered until then)."""
        return bool(self.trainable) and not (self.is_root or self.persistent
                                             or self.has_frozen or self.dynamic)

    @property
    def lent(self) -> bool:
        """Some group views a store's buffer now."""
        return any(g.lent_from is not None for g in self.groups)

    def gather(self, comm: Comm, store: ShardStore, *, lend: bool = False) -> None:
        """Every group's full parameters from the shards (a collective with several ranks).
        Checked before any work; a gather that fails part-way frees what it gathered.
        `lend`: groups may view the store's buffers (only when `lendable`)."""
        new = self._allowed(Residency.GATHERED, "gather()")
        if lend and not self.lendable:
            raise ValueError(f"unit {self.label!r}: gather(lend=True) of a unit that is not "
                             "released as its backward ends (Unit.lendable)")
        try:
            for g in self.groups:
                gather_group(g, comm, store, lend=lend)
        except BaseException:
            self.drop()
            raise
        self.residency = new

    def release(self) -> int:
        """Free the full parameters unless the unit is persistent; the bytes freed."""
        return 0 if self.persistent else self.drop()

    def drop(self) -> int:
        """Free the full parameters, persistent or not; the bytes freed. A unit without
        parameters of its own stays gathered (there is nothing to free)."""
        if not self.groups:
            self.residency = Residency.GATHERED
            return 0
        nbytes = self.gathered_bytes()
        new = self._allowed(Residency.RELEASED, "drop()")
        for g in self.groups:
            if g.gathered:
                release_group(g)
        self.residency = new
        return nbytes

    def write_back(self, comm: Comm, store: ShardStore, src: int) -> None:
        """Full parameters edited on rank `src` (GatheredParameters) -> every rank's shards
        (a collective)."""
        with torch.no_grad():
            for g in self.groups:
                if g.base is None:
                    raise RuntimeError(f"write_back: unit {self.label!r} is not gathered")
                comm.broadcast(g.base, src, g.key)
                lo = comm.rank * g.shard_numel
                mine = g.base[lo:lo + g.shard_numel]  # may alias param (one rank)
                with store.use(g.key, "param", writable=True) as param:
                    if g.trainable and store.has(g.key, "master"):  # (none if bf16)
                        with store.use(g.key, "master", writable=True) as master:
                            if master.data_ptr() != param.data_ptr():
                                # Only edited elements replace the fp32 master (param is
                                # always master rounded, so a difference is an edit); the
                                # rest keep full precision instead of a round trip through
                                # the compute dtype.
                                m = mine.to(master.device)
                                changed = m != master.to(m.dtype)
                                master.copy_(torch.where(changed, m.float(), master))
                    if mine.data_ptr() != param.data_ptr():
                        param.copy_(mine)

    def mark_stale(self) -> None:
        """The shards changed: a gathered copy predates them."""
        if self.gathered:
            self.residency = self._allowed(Residency.STALE, "mark_stale()")

    def hand_back(self, *, keep_values: bool) -> None:
        """The engine closes: every parameter gets its own copy of its gathered values
        (`keep_values`; the unit must be gathered) or is left released (size 0); the
        unit's gathered buffers are freed either way."""
        for g in self.groups:
            owned = [s.param.data.clone() if keep_values else None for s in g.slots]
            release_group(g)
            for s, data in zip(g.slots, owned, strict=True):
                if data is not None:
                    s.param.data = data
        self.residency = Residency.RELEASED

    def gathered_bytes(self) -> int:
        return sum(g.padded_numel * g.full.element_size() for g in self.groups if g.gathered)

    def full_bytes(self) -> int:
        """What the unit holds when gathered."""
        return sum(g.padded_numel * g.full.element_size() for g in self.groups)

    # -- gradients of one backward -------------------------------------------------------
    def fire(self, param: nn.Parameter) -> bool:
        """`param`'s gradient arrived; whether every trainable parameter's has now."""
        self.fired.add(id(param))
        return len(self.fired) == len(self.trainable)

    def late_group(self, param: nn.Parameter) -> FlatGroup | None:
        """The group of `param` if it was reduced already this backward (a late gradient,
        [Note: late gradients])."""
        if not self.reduced_groups:
            return None
        group = self.group_of[id(param)]
        return group if group.key in self.reduced_groups else None

    def groups_complete(self) -> list[FlatGroup]:
        """Trainable groups not reduced yet whose every parameter has its gradient."""
        return [g for g in self.groups if g.trainable and g.key not in self.reduced_groups
                and all(id(s.param) in self.fired for s in g.slots)]

    def unreduced(self, *, trainable_only: bool = False) -> list[FlatGroup]:
        return [g for g in self.groups if g.key not in self.reduced_groups
                and (g.trainable or not trainable_only)]

    def mark_reduced(self, groups: list[FlatGroup]) -> None:
        self.reduced_groups.update(g.key for g in groups)
        self.reduced = all(g.key in self.reduced_groups for g in self.groups if g.trainable)

    def reset_for_pass(self) -> None:
        """A backward ended (or was abandoned): forget which gradients arrived."""
        self.fired.clear()
        self.reduced = False
        self.reduced_groups.clear()
