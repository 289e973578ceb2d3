"""The CPU Adam's update runners: one interface for updating shards in place in host
memory and for streaming them from NVMe ([Note: shard updaters])."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from .adam_math import AdamHyper
from .step_seam import DeferredWatch, GradMeasure, TrainingStateError
from .stream_parts import PipelineStats


# [Note: shard updaters]
# The offloaded step's driver (OffloadedStep in engine/step/offloaded.py) runs the CPU Adam
# update through one `ShardUpdater`, chosen in its constructor from where the optimizer
# state lives, and afterwards only calls it; it never asks which one it holds:
#
#     in place   state in host memory (engine/step/in_place.py InPlaceStep): the kernel
#                runs where the state lives, on a worker thread while backward runs;
#                measures gradients beside backward and defers the update into the next
#                forward ([Note: deferred step]); no step order of its own.
#     streamed   state off the host (engine/step/streamed.py StreamedStep over
#                AdamStream): read ahead into a host ring, updated on the caller's
#                thread, written behind ([Note: streamed optimizer step]), in a step order;
#                measures gradients beside backward ([Note: gradients measured where they
#                are reduced]) and defers the update to a worker during the next forward;
#                where every key its update writes is on NVMe, speculates it into
#                backward ([Note: speculated step] in engine/step/speculation.py).
#
# What a runner cannot do it says through a capability (`measures`, `defers`,
# `has_order`, `speculates`) that the driver reads once, when it decides its `StepMode`; the
# operation itself raises TrainingStateError naming the runner, the call and the
# capability. Operations
# whose meaning holds without the capability are no-ops by definition: `settle` with no
# worker, `wait_groups` / `drain` / `watch_deferred` with nothing deferred,
# `forget_measured` with nothing measured, `set_order` without an order (False: nothing
# changed), `worker_times` (0, 0) without a worker, `flush` with no write in flight.
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
    @property
    def speculates(self) -> bool:
        """The update can run during backward undoably (`begin_speculation`, then
        `commit_speculation` or `undo_speculation`: [Note: speculated step]); False: those
        raise TrainingStateError."""
        ...

    def reserve_speculation(self) -> bool:
        """Room for what a speculated update keeps (SpeculationSpaceError when the disk has
        none); False: this run's layout cannot speculate (see the runner)."""
        ...

    def begin_speculation(self, hyper: AdamHyper, step: float, grad_scale: float, *,
                          order: Sequence[str]) -> None:
        """Backward starts: measure gradients and update each group as it turns final
        (`groups_final`), with `grad_scale`, in `order`, so that it can be undone."""
        ...

    def commit_speculation(self) -> PipelineStats:
        """The speculated update is the step's: update the rest, keep it all."""
        ...

    def undo_speculation(self) -> int:
        """Every group as before the speculated update; returns how many it had updated."""
        ...

    def run_all(self, hyper: AdamHyper, step: float, grad_scale: float) -> PipelineStats:
        """One update of every group, gradients times `grad_scale`."""
        ...

    def begin(self, hyper: AdamHyper, step: float) -> None:
        """Start a step (unscaled gradients); groups are updated as `groups_final` reports
        them, the rest by `finish`."""
        ...

    def groups_final(self, keys: Sequence[str]) -> None:
        """These groups' gradients are final for the open step: update what can be."""
        ...

    def finish(self) -> PipelineStats:
        """Update the groups not updated yet and close the step; a failure is raised, the
        step closed either way."""
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

    def watch_deferred(self) -> DeferredWatch | None:
        """A watch on the groups whose deferred update has not ended (None: none)."""
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
