"""OffloadedAdam: the torch.optim face of the offloaded CPU Adam.

When optimizer state is offloaded (cpu or nvme) `initialize()` returns this as the
optimizer. It holds what the lr schedule and user code reach through a
`torch.optim.Optimizer`: one param group carrying the hyper-parameters (`lr`, `betas`,
`eps`, `weight_decay`) and the step count. Its "params" are size-0 handles, one per
trainable flat group, because the fp32 masters, the moments and the gradients live in the
tier manager, not in tensors it could hold. The update itself is the step driver's
(OffloadedStep in step/offloaded.py, which holds the runner that updates the shards:
[Note: the optimizer-step seam] in offload/step_seam.py); the engine steps it, so
`step()` here refuses with the call to make instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tierzero.engine.checkpoint.layout import CheckpointError
from tierzero.offload import AdamHyper
from tierzero.offload.step_seam import TrainingStateError


class OffloadedAdam(torch.optim.Optimizer):
    """Adam/AdamW's param group and step count over offloaded flat shards."""

    def __init__(self, keys: Sequence[str], *, adamw: bool, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        handles = [torch.empty(0) for _ in keys]  # size-0: the state is in the tier manager
        super().__init__(handles, {"lr": lr, "betas": betas, "eps": eps,
                                   "weight_decay": weight_decay})
        self.adamw = adamw
        self._keys = list(keys)
        self._steps = 0
        self._counting = False  # inside count_step(): step() counts

    @property
    def keys(self) -> list[str]:
        """The trainable group keys, in construction order."""
        return list(self._keys)

    @property
    def steps(self) -> int:
        """Optimizer steps taken (Adam's bias correction counts from it)."""
        return self._steps

    def hyper(self) -> AdamHyper:
        """The hyper-parameters the next update uses: the param group's, as now."""
        group = self.param_groups[0]
        return AdamHyper(lr=float(group["lr"]), beta1=float(group["betas"][0]),
                         beta2=float(group["betas"][1]), eps=float(group["eps"]),
                         weight_decay=float(group["weight_decay"]), adamw=self.adamw)

    def count_step(self) -> None:
        """The driver has started the update numbered `steps + 1`: count it through
        `step()`, so what watches a torch optimizer's step sees one (an lr schedule's
        order check, hooks registered with register_step_pre_hook / _post_hook)."""
        self._counting = True
        try:
            self.step()
        finally:
            self._counting = False

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Counts the update the step driver started (`count_step`); called from anywhere
        else it refuses: the update is the engine's to run."""
        if closure is not None or not self._counting:
            raise TrainingStateError(
                "OffloadedAdam.step(): the engine steps the offloaded optimizer (its update "
                "is ordered with backward and the next forward); call eng.step() after "
                "eng.backward(loss), or eng.train_batch(...)")
        self._steps += 1

    # -- the step count in a checkpoint ------------------------------------------------------
    # Saved in the same form as torch's AdamW ({"step": {"tensor": n, "dtype":
    # "torch.float32"}} per group), so a checkpoint of either loads into the other.
    def step_scalars(self) -> dict[str, Any]:
        """The per-group scalars of a checkpoint: {"step": torch AdamW's form}."""
        return {"step": {"tensor": float(self._steps), "dtype": str(torch.float32)}}

    @staticmethod
    def saved_steps(groups: Mapping[str, Mapping[str, Any]]) -> int:
        """The one step count of every group's saved scalars (group key -> {"step": ...}),
        checked (CheckpointError) without changing anything."""
        steps: dict[str, int] = {}
        for key, scalars in groups.items():
            value = scalars.get("step", 0)
            step = float(value["tensor"] if isinstance(value, dict) else value)
            if step != int(step) or step < 0:
                raise CheckpointError(f"optimizer step {step} of group {key!r} is not a count")
            steps[key] = int(step)
        if len(set(steps.values())) > 1:
            raise CheckpointError(f"optimizer groups were saved at different steps {steps}; "
                                  "the engine's CPU Adam keeps one step count for every group")
        return next(iter(steps.values()), 0)

    def load_steps(self, steps: int) -> None:
        """Resume the count at `steps` (a checkpoint's, from `saved_steps`)."""
        self._steps = steps
