"""The fp32 gradient sums of a layer-major pass ([Note: layer-major schedule] in
engine/layer_major.py), and the bytes a pass held at its peak.

Each micro-batch's gradient of a trainable parameter is added into its group's sum and
cleared as it arrives; the scheduler hands a group's sum to its reduction once the pass
is done with the group (Scheduler._issue), or forgets every sum of an abandoned pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from tierzero.engine.shards.flat import ParamSlot, add_upcast

if TYPE_CHECKING:
    from tierzero.engine.unit import Unit


class GradSums:
    """Per trainable group, its gradient summed in fp32 over a pass's micro-batches until
    the group is reduced; the peaks of what a pass held beside one unit's activations."""

    def __init__(self, units: Sequence[Unit]) -> None:
        self._sums: dict[str, torch.Tensor] = {}  # group key -> 1D fp32, padded_numel, device
        self._slot_of = {id(s.param): s for u in units for g in u.groups for s in g.slots}
        self.peak_bytes = 0  # most bytes of the sums held at once
        self.boundary_peak_bytes = 0  # most unit-output leaves a pass kept for backward

    def __contains__(self, key: str) -> bool:
        return key in self._sums

    def fold(self, unit: Unit, param: nn.Parameter) -> None:
        """Add `param.grad` (one micro-batch's) into its group's sum and clear it."""
        grad = param.grad
        if grad is None:
            return
        group = unit.group_of[id(param)]
        slot: ParamSlot = self._slot_of[id(param)]
        acc = self._sums.get(group.key)
        if acc is None:
            acc = torch.zeros(group.padded_numel, dtype=torch.float32, device=grad.device)
            self._sums[group.key] = acc
            held = sum(a.nbytes for a in self._sums.values())
            self.peak_bytes = max(self.peak_bytes, held)
        with torch.no_grad():
            add_upcast(acc[slot.offset:slot.offset + slot.numel], grad.reshape(-1))
        param.grad = None

    def pop(self, key: str) -> torch.Tensor | None:
        """The group's sum, handed to its reduction; None when the group was not summed
        (a micro-step pass)."""
        return self._sums.pop(key, None)

    def clear(self) -> None:
        """Forget every sum (an abandoned pass)."""
        self._sums.clear()

    def boundary_held(self, nbytes: int) -> None:
        """A pass's forward kept `nbytes` of unit-output leaves for its backward."""
        self.boundary_peak_bytes = max(self.boundary_peak_bytes, nbytes)

    def held_peak_bytes(self) -> int:
        """Bytes a layer-major pass holds beside the activations of the unit it runs: the
        units' output leaves of every micro-batch and the fp32 gradient sums (peaks)."""
        return self.boundary_peak_bytes + self.peak_bytes
