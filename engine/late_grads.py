"""Gradients that reach a parameter after its group was reduced in the same backward.

[Note: late gradients] The scheduler reduces a group as soon as every trainable
parameter in it has fired its post-accumulate hook (schedule.py). Autograd sums
every use of a leaf within one graph task before its AccumulateGrad runs, but
separate graph tasks fire it again: reentrant activation checkpointing
(`checkpoint(..., use_reentrant=True)`: each segment's backward is a nested task)
whose segments share a parameter, a weight used inside and outside a segment, a
tied weight used in a segment and in the root, or user code calling
`torch.autograd.backward` inside a hook. A firing after the group's reduction is
a late gradient: `.grad` holds only the late part (the reduction consumed and
cleared the rest), so reducing the group again, its other parameters counting
zero, adds exactly what plain PyTorch would have accumulated.

Handling, per backward:
- `arrive()` records the group (per unit, the parameter's `.grad` keeps summing
  any further late parts); `take()` hands the groups to `Scheduler.end_backward`,
  which re-reduces them into the gradient shards after the regular
  end-of-backward reductions, units in index order, groups in unit order (a shard
  kept in the compute dtype adds the late part in that dtype: [Note: gradient
  precision] in shards/grad_precision.py). The
  set of late groups follows from autograd's execution order, which is the same
  on every rank when the ranks run the same graph ([Note: reduction order]), so
  every rank issues the same late collectives in the same order. Clipping's norm
  (step()) is taken after end_backward, over the final shards.
- The optimizer step begun during backward (offload.optimizer.overlap_step,
  `OffloadedStep.groups_final`) must not take a group whose gradient can still change.
  `hand_over()` withholds (they are updated by step(), after backward): every
  group that had a late gradient in an earlier backward of this engine, and all
  groups while probing. Probing: this forward ran a unit with gradients off
  inside a grad-enabled engine forward (the first pass of a reentrant segment;
  its backward will be a nested graph task) and no backward since the last
  trace change has shown which groups get late gradients. So the first such
  backward steps nothing early and learns; later ones hand over all but the
  learned groups.
- A late gradient on a group already handed over (a nested backward the forward
  did not announce, or a graph that changed without a unit-order change) cannot
  be made right: the optimizer may have updated the group already.
  `LateGradientError` names the parameter, unit, group, why and the fix; the
  engine abandons the early step (OffloadedStep.abandon: this boundary's step is
  skipped), and the group is withheld from then on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from tierzero.engine.shards.flat import FlatGroup

if TYPE_CHECKING:
    from tierzero.engine.unit import Unit

log = logging.getLogger(__name__)


class LateGradientError(RuntimeError):
    """A gradient arrived for a group the optimizer step begun during backward had taken."""


def qualified_name(group: FlatGroup, param: nn.Parameter) -> str:
    for s in group.slots:
        if s.param is param:
            return s.qname
    return "<unknown parameter>"


class LateGrads:
    """Late-gradient bookkeeping of one scheduler; see [Note: late gradients]."""

    def __init__(self) -> None:
        self.known: set[str] = set()  # group keys that had a late gradient in some backward
        self.arrivals = 0  # late post-accumulate firings seen (tests, logs)
        self._pending: dict[int, set[str]] = {}  # unit index -> late group keys, this pass
        self._handed: set[str] = set()  # group keys given to the early step this pass
        self._forward_grad = False  # this forward runs with gradients enabled
        self._nograd_forward = False  # ... and ran a unit with gradients off inside it
        self._probed = False  # a backward after such a forward completed (since a re-trace)
        # A late gradient on a handed-over group is an error (the early step may have
        # updated it); False when the hand-over only measures ([Note: deferred step]).
        self.strict = True

    # -- forward -----------------------------------------------------------------------
    def begin_forward(self) -> None:
        """A forward begins. One without gradients (no backward follows it) keeps what the
        last forward with gradients announced for the backward still to come."""
        self._forward_grad = torch.is_grad_enabled()
        if self._forward_grad:
            self._nograd_forward = False

    def unit_forward(self) -> None:
        """A unit's forward begins (not a recomputation inside backward)."""
        if self._forward_grad and not torch.is_grad_enabled():
            self._nograd_forward = True

    def retraced(self) -> None:
        """The unit order changed: what was learned about this graph may not hold."""
        self._probed = False

    # -- backward ----------------------------------------------------------------------
    def hand_over(self, groups: list[FlatGroup]) -> list[FlatGroup]:
        """Of `groups` (just reduced), those the early step may take now."""
        if self._nograd_forward and not self._probed:
            return []
        out = [g for g in groups if g.trainable and g.key not in self.known]
        self._handed.update(g.key for g in out)
        return out

    def arrive(self, unit: Unit, group: FlatGroup, param: nn.Parameter) -> None:
        """`param` fired after `group` was reduced in this backward."""
        self.arrivals += 1
        if group.key not in self.known:
            self.known.add(group.key)
            log.info("late gradient: %s (unit %s) fired again after group %s was reduced in "
                     "this backward (reentrant checkpointing or a nested backward); the "
                     "group is reduced again at the end of backward",
                     qualified_name(group, param), unit.label, group.key)
        self._pending.setdefault(unit.index, set()).add(group.key)
        if group.key in self._handed and self.strict:
            raise LateGradientError(
                f"parameter {qualified_name(group, param)!r} (unit {unit.label!r}) received "
                f"a gradient after its group {group.key!r} was reduced and handed to the "
                "optimizer step begun during backward (offload.optimizer.overlap_step), "
                "which may already have updated it with the incomplete gradient. Its "
                "gradient arrived in a second autograd pass within one backward (a "
                "parameter shared by reentrant checkpoint segments, or torch.autograd."
                "backward called inside a hook) that the forward did not announce. This "
                "boundary's step is skipped, but the groups the early step already updated "
                "keep that update (this one possibly from its incomplete gradient): load "
                "the last checkpoint to go on from a consistent state. The group is kept "
                "out of the early step from now on. Fix: set "
                "offload.optimizer.overlap_step: false, or use non-reentrant checkpointing "
                "(use_reentrant=False)")

    def take(self, units: list[Unit]) -> list[tuple[Unit, list[FlatGroup]]]:
        """The groups to reduce again, in fixed order (units by index, groups by unit)."""
        out = []
        for unit in units:
            keys = self._pending.get(unit.index)
            if keys:
                out.append((unit, [g for g in unit.groups if g.key in keys]))
        self._pending.clear()
        return out

    def end_backward(self) -> None:
        if self._nograd_forward:
            self._probed = True
        self.reset()

    def reset(self) -> None:
        """Forget this pass (end of backward, or a failed forward)."""
        self._pending.clear()
        self._handed.clear()
