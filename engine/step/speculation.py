"""When the streamed optimizer update is speculated into backward.

[Note: speculated step]
Clipping's global norm and fp16's overflow check need every gradient before any update,
so with state on NVMe the exact update runs after backward: during the next forward with
overlap_step ([Note: deferred streamed step] in step/deferred_stream.py), at the drive's
pace while forward's compute idles, and every gradient crosses the drive twice (written
down during backward, read back by the update). In most steps of a run the update turns
out to be the unclipped one: the coefficient is exactly 1 and nothing overflowed. A
speculated step (SuperOffload's speculation-then-validation, made exact) runs that update
during backward, each group as its gradient turns final, as the early step does without
clipping, and decides in step():

- the clip coefficient times the fp16 unscale is exactly the factor the update used, the
  hyper-parameters are unchanged and no group was reduced again after its update (a late
  gradient): commit. Every value is the one the exact update gives (the same kernel on
  the same gradient with the same factor); the gradients are dropped unread;
- otherwise (clipping fired, an overflow or a non-finite norm skips the step, a late
  gradient, lr changed between backward and step()): undo, then the exact update. The
  stream's writes are waited for, every state key written points back at the region it
  had ([Note: speculated shards] in offload/speculation.py), and the step runs as it
  would have without speculation (deferred into the next forward, or skipped), from the
  gradients, which the speculated update did not consume: it only wrote each one down
  (evicted) after using it, so backward's pool room stays free.

The commit does not wait for the update's last writes: they land during the next forward,
as every streamed step's do (waiting for them in step() made a 2.07B step 1.4x slower:
benchmarks/RESULTS.md). A write that fails before the commit is seen by the update (it
waits for the room its writes hold, and looks at those that landed) and undoes the step;
one that fails after it is the committed step's: raised once, to whoever waits for it
first, and its shard refused wherever it is read until written again ([Note: a lost
write] in offload/core.py), so no checkpoint saves the torn group. Nothing after the
commit point undoes it: a failure the gradients' discards settle there is logged.

Anything that reads the shards between backward and step() undoes the speculation first
(`before_use`: a forward, a checkpoint, an export), and so does a failed backward, a
second boundary backward and zero_grad(): each group is then either untouched or, after
step(), updated exactly once.

Only the streamed step speculates (state homed on NVMe: a kept region costs no copy), and
only where every key its update writes is homed there; on a dry run (tierzero plan) never,
so the plan counts the deferred step's bytes, an upper bound of a committed one's.

`SpeculationPolicy` decides per step, so a run whose clipping fires every step does not
pay twice: speculate after `calm_needed` exact steps in a row (1 at first; the first
step of a run waits for one). Each undo doubles `calm_needed` (at most MAX_CALM), each
commit halves it. Every rank takes the same decisions: they follow the all-reduced norm.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CALM = 64  # exact steps in a row a speculation waits for, at most


@dataclass
class SpeculationPolicy:
    """Whether the next boundary's update is speculated; see [Note: speculated step]."""

    enabled: bool
    calm_needed: int = 1
    calm: int = 0  # exact steps in a row (coefficient 1, not skipped), up to now
    speculated: int = 0  # steps speculated (counted by the driver)
    undone: int = 0  # of which undone

    def should(self) -> bool:
        return self.enabled and self.calm >= self.calm_needed

    def observe(self, *, exact: bool, speculated: bool) -> None:
        """One boundary's outcome: `exact`: its update was the unclipped, unskipped one."""
        self.calm = self.calm + 1 if exact else 0
        if speculated and exact:
            self.calm_needed = max(1, self.calm_needed // 2)
        elif speculated:
            self.calm_needed = min(MAX_CALM, self.calm_needed * 2)
