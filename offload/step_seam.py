"""The optimizer-step seam: what the engine calls on whatever updates the shards.

[Note: the optimizer-step seam]
The engine chooses one `StepDriver` when it is built and afterwards only calls it;
it never asks which driver it holds. Two implement it:

    device driver     a torch.optim.Optimizer over device-resident fp32 shards
                      (engine/step/device.py DeviceStep): nothing happens during
                      backward; `finish` scales the gradients and steps it.
    offloaded driver  the CPU Adam over shards in the tier manager
                      (engine/step/offloaded.py OffloadedStep): may begin during
                      backward, update each group as its gradient turns final,
                      measure gradients for clipping / fp16 beside backward and
                      defer the update into the next forward.

A training step, as the engine calls it:

    backward   settle(); begin(boundary)      groups_final(keys) for each group whose
               ... reductions ...             gradient shard is final, while `listening`
               abandon()                      (only if backward failed)
    step       take_abandoned()               -> skip this boundary's step
               grad_stats(redo)               -> measured during backward, or None
               finish(grad_scale, next_forward=, seen=)
                                              the update (or hand it to the next forward)
    forward    settle(deferred=False)         wait_groups(keys) before each unit's gather
    zero_grad  settle(deferred=False); gradients_zeroed()
    save       watch_deferred()               a background save of a deferred update
                                              (DeferredWatch below)

Checkpoints ask the driver for its state (`state_dict`) and hand it back
(`load_state_dict`) in one form for both drivers: per group, the per-element state
the shard store holds (the moments: `StoreTensor`s, streamed through the store one
shard at a time, so the state is never copied whole into host memory), the driver's
own per-element tensors, and scalars ([Note: checkpoint layout] in
engine/checkpoint/save.py says where each goes in the files).

Inside the offloaded driver, the CPU Adam update itself runs through one `ShardUpdater`
([Note: shard updaters] in offload/shard_updater.py): in place on host memory, or
streamed from NVMe.

Everything here speaks of group keys (the shard store's) and tensors: offload knows
nothing of modules, units or ranks.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from .state_codec import StoredLayout


class TrainingStateError(RuntimeError):
    """A call that the object's training state does not allow (see `transition`), or that
    the object cannot make at all (a capability it lacks, see `ShardUpdater`)."""


S = TypeVar("S", bound=enum.Enum)


def transition(owner: str, table: Mapping[S, frozenset[S]], old: S, new: S, *, call: str,
               fix: str) -> S:
    """`new` when `table` allows `old` -> `new`, else TrainingStateError naming the owner,
    the call, both states, what `old` allows and the fix."""
    allowed = table[old]
    if new not in allowed:
        names = ", ".join(sorted(s.name for s in allowed)) or "nothing"
        raise TrainingStateError(f"{owner}: {call} in state {old.name} would go to {new.name}, "
                                 f"which {old.name} does not allow (it allows {names}); {fix}")
    return new


class StepState(enum.Enum):
    """Where a driver's step stands between backward and step() ([Note: the optimizer-step
    seam]); the transitions are `STEP_TRANSITIONS`."""

    IDLE = enum.auto()  # nothing begun: step() updates every group
    MEASURING = enum.auto()  # a boundary's backward measures gradients as they turn final
    OPEN = enum.auto()  # a step begun in backward updates groups as they turn final
    ABANDONED = enum.auto()  # that backward failed: step() skips this boundary's step
    # a boundary's backward measures gradients and updates groups as they turn final,
    # undoably ([Note: speculated step] in engine/step/speculation.py)
    SPECULATING = enum.auto()


STEP_TRANSITIONS: dict[StepState, frozenset[StepState]] = {
    StepState.IDLE: frozenset({StepState.MEASURING, StepState.OPEN, StepState.SPECULATING}),
    # a second boundary backward before step() measures again, from scratch
    StepState.MEASURING: frozenset({StepState.IDLE, StepState.MEASURING}),
    StepState.OPEN: frozenset({StepState.IDLE, StepState.ABANDONED}),
    StepState.ABANDONED: frozenset({StepState.IDLE}),
    # step() committed or undid it; undone before step() with its measurements kept
    StepState.SPECULATING: frozenset({StepState.IDLE, StepState.MEASURING}),
}


@dataclass(frozen=True)
class StoreTensor:
    """Per-element optimizer state that the shard store holds: shard `kind` of group `key`.
    Saved and loaded through the store's own access path, one shard at a time."""

    key: str
    kind: str


class TensorSource(Protocol):
    """Saved per-element state of one group, read on demand into a tensor of its size.

    `read_into` gives its values in fp32. A saved moment may also be kept in a stored
    (compressed) form ([Note: stored moment layout] in offload/state_codec.py):
    `stored_as()` is the layout in which its bytes can be copied as they are (None: no
    such form; read_into only), and `read_stored_into` copies those bytes."""

    def read_into(self, out: torch.Tensor) -> None: ...

    def stored_as(self) -> StoredLayout | None: ...

    def read_stored_into(self, out: torch.Tensor) -> None: ...


@dataclass
class GroupState:
    """One trainable group's optimizer state, in the form checkpoints hold it.

    From `state_dict`: `shards` maps a store kind to its StoreTensor and `tensors` holds
    the driver's own tensors (no copies). To `load_state_dict`: both hold TensorSources,
    which the driver reads into the store's shard or its own tensor."""

    shards: dict[str, Any] = field(default_factory=dict)  # "exp_avg" -> StoreTensor | source
    tensors: dict[str, Any] = field(default_factory=dict)  # per element: Tensor | source
    scalars: dict[str, Any] = field(default_factory=dict)  # JSON: {"tensor": v, "dtype": d}|v


class GradMeasure(Protocol):
    """One gradient shard's squared L2 norm and finiteness (clipping, fp16 overflow)."""

    @property
    def sq_norm(self) -> float: ...

    @property
    def finite(self) -> bool: ...


class DeferredWatch:
    """The end of each group's deferred update, reported to one listener ([Note: saving a
    deferred step] in engine/checkpoint/deferred.py).

    `keys`: the groups whose update had not ended when the watch was made (or had failed,
    the failure not raised yet: reported at once). Each is reported once,
    `listener(key, error)`, by the thread that ran its update: after its writes, before
    anyone waiting for the group sees it done; `error` None, or why the group was not
    updated (its update failed, or an earlier group's did). Reports made before `attach`
    are handed to the listener when it attaches."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = frozenset(keys)
        self._lock = threading.Lock()  # reports come from the worker and the training thread
        self._ended: dict[str, str | None] = {}
        self._listener: Callable[[str, str | None], None] | None = None

    def ended(self, key: str, error: str | None) -> None:
        """Group `key`'s update ended (`error`: why it did not update the group)."""
        with self._lock:
            if key not in self.keys or key in self._ended:
                return
            self._ended[key] = error
            listener = self._listener
        if listener is not None:
            listener(key, error)

    def attach(self, listener: Callable[[str, str | None], None]) -> None:
        """Report to `listener` from now on, and at once what was reported before."""
        with self._lock:
            if self._listener is not None:
                raise RuntimeError("DeferredWatch.attach: a listener is attached already")
            self._listener = listener
            ended = dict(self._ended)
        for key, error in ended.items():
            listener(key, error)


class DeferredEnds:
    """Which groups of the pending deferred update have ended, and how, and the watch on
    the rest (at most one: each background save makes a new one after the last ended)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: list[str] = []  # every group of the deferred update
        self._ended: dict[str, str | None] = {}  # group -> None, or why it was not updated
        self._watch: DeferredWatch | None = None

    def begin(self, keys: Sequence[str]) -> None:
        """A deferred update of `keys` starts (none of them has ended)."""
        with self._lock:
            self._keys, self._ended, self._watch = list(keys), {}, None

    def ended(self, key: str, error: str | None) -> None:
        """By the thread that ran (or skipped) `key`'s update, after its writes."""
        with self._lock:
            self._ended[key] = error
            watch = self._watch
        if watch is not None:
            watch.ended(key, error)

    def raised(self) -> None:
        """The update's failure was raised to the training thread: from now on the groups
        it left are the state as it is (a synchronous save writes them so), not failed."""
        with self._lock:
            self._ended = dict.fromkeys(self._ended)

    def watch(self) -> DeferredWatch | None:
        """A watch on the groups whose update has not ended, or failed without the failure
        being raised yet (reported to it at once); None when there are none."""
        with self._lock:
            left = [k for k in self._keys if k not in self._ended or self._ended[k] is not None]
            self._watch = DeferredWatch(left) if left else None
            failed = {k: e for k, e in self._ended.items() if e is not None}
            watch = self._watch
        if watch is not None:
            for key, error in failed.items():
                watch.ended(key, error)
        return watch


class StepDriver(Protocol):
    """The optimizer step over every trainable group; see [Note: the optimizer-step seam]."""

    # How the last boundary's update ran: "step" (in step()), "backward" (begun during
    # backward), "deferred" (into the next forward), "speculated" (during backward, then
    # committed: [Note: speculated step]), "undone" (speculated, undone, deferred); None
    # before the first step and for a skipped one. Read by tierzero train's step log.
    last_update: str | None
    # An update that failed partway, described, until a checkpoint load replaces every
    # group's state ([Note: a partial step] in engine/step/offloaded.py); None otherwise.
    partial_step: str | None

    @property
    def listening(self) -> bool:
        """Gradient-final events are wanted now (a step or a measurement begun in backward)."""
        ...

    @property
    def updates_in_backward(self) -> bool:
        """Groups handed over while listening on a boundary are updated then (not only
        measured): a later gradient on one is an error ([Note: late gradients])."""
        ...

    @property
    def defers(self) -> bool:
        """The update may run during the next forward: each unit's groups are waited for
        (`wait_groups`) before the unit is gathered."""
        ...

    @property
    def step_open(self) -> bool:
        """A step begun during backward has updated some groups and not others."""
        ...

    def begin(self, *, boundary: bool, unscale: float = 1.0) -> None:
        """Backward starts; `boundary`: its gradients are the last of this step's; `unscale`:
        the factor step() will undo fp16's loss scale by if nothing overflows."""
        ...

    def before_use(self) -> None:
        """The shards are about to be read outside the step (a forward, a checkpoint, an
        export) between backward and step(): an update speculated during backward is
        undone first ([Note: speculated step] in engine/step/speculation.py)."""
        ...

    def groups_final(self, keys: Sequence[str]) -> None:
        """These groups' gradient shards are final for this step (called while listening)."""
        ...

    def abandon(self) -> None:
        """Backward failed, or the gradients measured in it are gone: close whatever was
        begun; groups already updated keep their update."""
        ...

    def take_abandoned(self) -> bool:
        """A step begun in backward was abandoned: the engine skips this boundary's step."""
        ...

    def grad_stats(self, redo: set[str]) -> Mapping[str, GradMeasure] | None:
        """Every group's gradient measure taken during backward (`redo`: groups reduced
        again since, measured now); None when backward measured nothing."""
        ...

    def finish(self, grad_scale: float, *, next_forward: Sequence[str],
               seen: Sequence[str]) -> None:
        """The step: gradients times `grad_scale` (unscale, clipping), over every group.
        next_forward: trainable group keys in the order the next forward gathers them;
        seen: the order the last backward finalised them in."""
        ...

    def gradients_zeroed(self) -> None:
        """zero_grad(): measurements of the gradients no longer hold."""
        ...

    def settle(self, *, deferred: bool = True) -> None:
        """No optimizer thread writes a shard after this (with `deferred` False an update
        deferred into the next forward goes on, waited for group by group)."""
        ...

    def wait_groups(self, keys: Sequence[str]) -> None:
        """These groups' deferred updates have run."""
        ...

    def drain(self) -> None:
        """Every deferred update has run."""
        ...

    def watch_deferred(self) -> DeferredWatch | None:
        """A watch on the groups whose deferred update has not ended yet (None: nothing is
        pending): a background save reads each once it has ([Note: saving a deferred
        step] in engine/checkpoint/deferred.py)."""
        ...

    @property
    def step_order(self) -> list[str]:
        """Group keys in the order the step updates them."""
        ...

    def worker_times(self) -> tuple[float, float]:
        """(seconds the driver's worker thread ran, of which hidden under compute)."""
        ...

    def stats(self) -> dict[str, Any] | None:
        """The last step's pipeline statistics (None: nothing to report)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """{"param_groups": [each param group's hyper-parameters, JSON], "state": {group
        key: GroupState}}; nothing is copied (StoreTensors name the store's shards)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The same form, the per-element entries as TensorSources; each group's are read
        into their place (store shards through the store, one at a time)."""
        ...

    def close(self) -> None:
        """Stop the driver's threads and buffers. Idempotent."""
        ...


# [Note: step order learned from backward]
# The streamed CPU Adam updates groups in one order each step, and its read-ahead during
# forward fetches the state of that order's first groups. The right order is the one in
# which gradients turn final in backward: the early step (overlap_step) can then update
# each group as soon as it is reduced, and the ring's read-ahead is what backward
# finalises first. The blocks' order is known (last to first), but not where the root's
# pieces fall: a head used last in forward is final first, the embedding last, and a
# tied or reused weight wherever its last use is. So the order starts from the blocks
# last-to-first with the root last (`StepOrder.backward_guess`) and, after each step,
# `learn`s the order the scheduler saw in the last backward (Scheduler.final_order): at
# once the first time, later only when two steps in a row agree on a new order, so a
# model whose order alternates does not re-order every step. A change drains the stream
# once (AdamStream.set_order, which applies the order; StepOrder alone decides it). Before,
# the disk sat idle at the start of backward (the ring full of read-ahead, the head's
# gradient final but its state queued last) and the head's state was read at the end of
# backward, behind the embedding's (benchmarks/RESULTS.md, "Step order learned from
# backward"). On a model of one root group nothing changes.
class StepOrder:
    """The one owner of the order in which the optimizer step updates the groups; see
    [Note: step order learned from backward]."""

    def __init__(self, keys: Sequence[str], initial: Sequence[str] | None = None) -> None:
        """keys: every trainable group, in construction order; initial: the order until
        backward has been seen (default: construction order)."""
        self._index = {k: i for i, k in enumerate(keys)}
        start = list(keys) if initial is None else list(initial)
        if sorted(self._index[k] for k in start if k in self._index) != list(range(len(keys))):
            raise ValueError(f"StepOrder: the initial order must list every group once; got "
                             f"{start[:3]}... of {len(start)} for {len(keys)} groups")
        self._order = start
        self._seen: list[str] | None = None  # the order seen after the last step

    @classmethod
    def backward_guess(cls, keys: Sequence[str], blocks: Sequence[Sequence[str]],
                       root: Sequence[str]) -> StepOrder:
        """Before any backward: the groups of `blocks` (forward order) last to first, then
        the `root`'s; groups of `keys` named by neither keep their place after them."""
        rank = {k: r for r, group in enumerate([*blocks[::-1], root]) for k in group}
        return cls(keys, sorted(keys, key=lambda k: rank.get(k, len(rank))))

    @property
    def keys(self) -> list[str]:
        """Group keys in step order."""
        return list(self._order)

    def indices(self) -> list[int]:
        """The step order as positions in the construction order of the keys."""
        return [self._index[k] for k in self._order]

    def learn(self, seen: Sequence[str]) -> bool:
        """After a step: `seen` is the order gradients turned final in its backward (empty:
        none seen). Returns whether the step order changed."""
        if not seen:
            return False
        unknown = [k for k in seen if k not in self._index]
        if unknown:
            raise ValueError(f"StepOrder.learn: unknown groups {unknown[:3]}")
        first = self._seen is None
        stable = list(seen) == self._seen
        self._seen = list(seen)
        if not (first or stable):
            return False
        named = list(dict.fromkeys(seen))
        known = set(named)
        order = named + [k for k in self._order if k not in known]
        changed = order != self._order
        self._order = order
        return changed
