"""Which units stay gathered between their forward and their backward, and the order of
a step's parameter and gradient uses that the shard store reads ahead.

[Note: reuse distance] From the second forward on (a trace exists), a unit whose next use
(its backward) comes within `max_reuse_distance_bytes` of parameter bytes gathered in
between stays gathered after its forward instead of being released and gathered again,
as long as the gathered bytes stay within `max_live_bytes` (zero.max_reuse_distance_bytes,
zero.max_live_bytes): the last units of forward are the first of backward.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierzero.engine.unit import Unit
from tierzero.offload.settings import TensorClass


class KeepRule:
    """[Note: reuse distance]: the bounds, and each traced unit's reuse distance."""

    def __init__(self, max_live_bytes: int, max_reuse_distance_bytes: int) -> None:
        self.max_live = max_live_bytes
        self.max_reuse = max_reuse_distance_bytes
        self.distance: dict[int, int] = {}  # unit index -> bytes gathered before its reuse

    def learn(self, units: Sequence[Unit], trace: list[int]) -> None:
        """Per traced unit: parameter bytes gathered between its forward and its backward
        (every later unit's forward and backward)."""
        by_index = {u.index: u for u in units}
        out: dict[int, int] = {}
        later = 0
        for i in reversed(trace):
            u = by_index[i]
            if u.persistent or u.is_root:
                continue
            out.setdefault(i, 2 * later)
            later += u.full_bytes()
        self.distance = out

    def keeps(self, unit: Unit, gathered_bytes: int) -> bool:
        """After `unit`'s forward, with `gathered_bytes` gathered: keep it for backward."""
        d = self.distance.get(unit.index)
        return (not unit.persistent and d is not None and d <= self.max_reuse
                and gathered_bytes <= self.max_live)

    def predict_kept(self, units: Sequence[Unit], root: Unit, fwd: list[Unit]) -> set[int]:
        """The units the forward will keep gathered this step, by the same rule."""
        live = root.full_bytes()
        live += sum(u.gathered_bytes() for u in units if u.persistent and not u.is_root)
        kept: set[int] = set()
        for u in fwd:
            live += u.full_bytes()
            d = self.distance.get(u.index)
            if d is not None and d <= self.max_reuse and live <= self.max_live:
                kept.add(u.index)
            else:
                live -= u.full_bytes()
        return kept


def step_uses(units: Sequence[Unit], trace: list[int], root: Unit, rule: KeepRule
              ) -> list[tuple[str, TensorClass]]:
    """This step's parameter and gradient uses in order, from the recorded trace: the root,
    each non-persistent unit's forward, then the same units in reverse for backward (a
    re-gather unless kept, then the gradient shard's accumulation)."""
    by_index = {u.index: u for u in units}
    fwd = [by_index[i] for i in trace if not by_index[i].persistent]
    entries: list[tuple[str, TensorClass]] = []
    if not root.current:
        entries += [(g.key, "param") for g in root.groups]
    entries += [(g.key, "param") for u in fwd for g in u.groups]
    kept = rule.predict_kept(units, root, fwd)
    for u in fwd[::-1]:
        if u.index not in kept:
            entries += [(g.key, "param") for g in u.groups]
        if not (u.has_frozen or u.dynamic):  # those reduce at the end of backward
            # (the store leaves out a fresh shard's read: [Note: gradients zeroed on first
            # use] in shards/store.py)
            entries += [(g.key, "grad") for g in u.groups if g.trainable]
    return entries
