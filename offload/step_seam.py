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
               finish(grad_scale)             the update (or hand it to the next forward)
    forward    settle(deferred=False)         wait_groups(keys) before each unit's gather
    zero_grad  settle(deferred=False); gradients_zeroed()

Checkpoints ask the driver for its state (`state_dict`) and hand it back
(`load_state_dict`) in one form for both drivers: per group, the per-element state
the shard store holds (the moments: `StoreTensor`s, streamed through the store one
shard at a time, so the state is never copied whole into host memory), the driver's
own per-element tensors, and scalars ([Note: checkpoint layout] in
engine/checkpoint/save.py says where each goes in the files).

Inside the offloaded driver, the CPU Adam update itself runs through one `ShardUpdater`
([Note: shard updaters] below): in place on host memory, or streamed from NVMe.

Everything here speaks of group keys (the shard store's) and tensors: offload knows
nothing of modules, units or ranks.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from .adam_math import AdamHyper
from .adam_stream import PipelineStats
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


STEP_TRANSITIONS: dict[StepState, frozenset[StepState]] = {
    StepState.IDLE: frozenset({StepState.MEASURING, StepState.OPEN}),
    # a second boundary backward before step() measures again, from scratch
    StepState.MEASURING: frozenset({StepState.IDLE, StepState.MEASURING}),
    StepState.OPEN: frozenset({StepState.IDLE, StepState.ABANDONED}),
    StepState.ABANDONED: frozenset({StepState.IDLE}),
}


@dataclass(frozen=True)
class StoreTensor:
    """Per-element optimizer state that the shard store holds: shard `kind` of group `key`.
    Saved and loaded through the store's own access path, one shard at a time."""

    key: str
    kind: str


class TensorSource(Protocol):
    """Saved per-element state of one group, read on demand into a tensor of its size."""

    def read_into(self, out: torch.Tensor) -> None: ...


@runtime_checkable
class StoredSource(Protocol):
    """A saved moment that may also be read in its stored form ([Note: stored moment
    layout] in offload/state_codec.py): `read_into` gives its fp32 values (decoded);
    `stored_as()` is the layout in which its bytes can be copied as they are (None: only
    decoded), and `read_stored_into` copies them."""

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


class StepDriver(Protocol):
    """The optimizer step over every trainable group; see [Note: the optimizer-step seam]."""

    @property
    def listening(self) -> bool:
        """Gradient-final events are wanted now (a step or a measurement begun in backward)."""
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

    def begin(self, *, boundary: bool) -> None:
        """Backward starts; `boundary`: its gradients are the last of this step's."""
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

    def finish(self, grad_scale: float) -> None:
        """The step: gradients times `grad_scale` (unscale, clipping), over every group."""
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


# [Note: shard updaters]
# OffloadedAdam (engine/step/offloaded_adam.py) runs the CPU Adam update through one
# `ShardUpdater`, chosen in its constructor from where the optimizer state lives, and
# afterwards only calls it; it never asks which one it holds:
#
#     in place   state in host memory (engine/step/in_place.py InPlaceStep): the kernel
#                runs where the state lives, on a worker thread while backward runs;
#                measures gradients beside backward and defers the update into the next
#                forward ([Note: deferred step]); no step order of its own.
#     streamed   state off the host (engine/step/streamed.py StreamedStep over
#                AdamStream): read ahead into a host ring, updated on the caller's
#                thread, written behind ([Note: streamed optimizer step]), in a step order.
#
# What a runner cannot do it says through a capability (`measures`, `defers`,
# `has_order`) that the caller asks before relying on it; the operation itself then
# raises TrainingStateError naming the runner, the call and the capability. Operations
# whose meaning holds without the capability are no-ops by definition: `settle` with no
# worker, `wait_groups` / `drain` with nothing deferred, `forget_measured` with nothing
# measured, `set_order` without an order (False: nothing changed), `worker_times` (0, 0)
# without a worker, `flush` with no write in flight.
class ShardUpdater(Protocol):
    """The CPU Adam update over every trainable group; see [Note: shard updaters].

    A step after backward is `run_all`; a step begun during backward is `begin`, then
    `groups_final` as gradients turn final, then `finish` (or `abort`)."""

    @property
    def measures(self) -> bool:
        """Gradients can be measured beside backward (`begin_measure`, `measure`,
        `grad_stats`); False: those raise TrainingStateError."""
        ...

    @property
    def defers(self) -> bool:
        """The update can be handed on into the next forward (`defer`); False: `defer`
        raises TrainingStateError and `deferred` is always False."""
        ...

    @property
    def has_order(self) -> bool:
        """The groups are updated in an order the caller sets (`set_order`); False: in
        construction order (or as handed over), and `set_order` changes nothing."""
        ...

    # -- the step ---------------------------------------------------------------------------
    def run_all(self, hyper: AdamHyper, step: float, grad_scale: float) -> PipelineStats:
        """One update of every group, gradients times `grad_scale`."""
        ...

    @property
    def is_open(self) -> bool:
        """A step is begun (`begin`) and neither finished nor aborted."""
        ...

    def begin(self, hyper: AdamHyper, step: float) -> None:
        """Start a step (unscaled gradients); groups are updated as `groups_final` reports
        them, the rest by `finish`."""
        ...

    def groups_final(self, keys: Sequence[str]) -> None:
        """These groups' gradients are final for the open step: update what can be."""
        ...

    def finish(self) -> PipelineStats:
        """Update the groups not updated yet and close the step (a failure is raised)."""
        ...

    def abort(self) -> int:
        """Close an open step without updating the rest; returns how many groups it had
        updated, each whole (0 when none is open)."""
        ...

    @property
    def order(self) -> list[str]:
        """Group keys in the order a step updates them."""
        ...

    def set_order(self, keys: Sequence[str]) -> bool:
        """Update in this order from the next step on; returns whether the order changed."""
        ...

    def settle(self) -> None:
        """No optimizer thread writes a shard after this, a deferred update aside."""
        ...

    def flush(self) -> None:
        """Every write of the last step has landed (a failure is raised)."""
        ...

    # -- deferral into the next forward ([Note: deferred step]) -----------------------------
    def defer(self, hyper: AdamHyper, step: float, grad_scale: float,
              order: Sequence[str]) -> None:
        """Hand every group's update on, in `order`, while the caller goes on."""
        ...

    @property
    def deferred(self) -> bool:
        """A deferred update is pending (or ran and was not yet waited for)."""
        ...

    def wait_groups(self, keys: Sequence[str]) -> PipelineStats | None:
        """These groups' deferred updates have run; the step's stats once every group's
        has (None before, or when nothing was deferred)."""
        ...

    def drain(self) -> PipelineStats | None:
        """Every deferred update has run; its stats (None when nothing was deferred)."""
        ...

    # -- gradient measurement beside backward (clipping, fp16) ------------------------------
    def begin_measure(self) -> None:
        """Backward begins on a boundary: gradients handed to `measure` are measured."""
        ...

    def measure(self, keys: Sequence[str]) -> None:
        """These groups' gradients are final: measure them."""
        ...

    def forget_measured(self) -> None:
        """Drop every measurement (the gradients changed since)."""
        ...

    def grad_stats(self, redo: set[str]) -> Mapping[str, GradMeasure]:
        """Every group's measure (`redo`: reduced again since, measured now); consumes
        the measurements."""
        ...

    def worker_times(self) -> tuple[float, float]:
        """(seconds the runner's worker thread ran, of which hidden under compute),
        cumulative."""
        ...

    def close(self) -> None:
        """Wait for the runner's work and stop its threads and buffers. Idempotent."""
        ...


def unsupported(runner: str, call: str, capability: str, fix: str) -> TrainingStateError:
    """The error for `call` on a runner whose `capability` is False ([Note: shard
    updaters]), naming both and the fix."""
    return TrainingStateError(f"{runner}: {call} needs `{capability}`, which {runner} does "
                              f"not have; {fix}")


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
