"""OffloadedStep: the offloaded CPU Adam behind the optimizer-step seam.

`OffloadedAdam` (step/offloaded_adam.py) updates the shards; `OffloadedStep` decides when
([Note: the optimizer-step seam] in offload/step_seam.py): during backward as gradients
turn final, after it, or during the next forward; it keeps the step's `StepState`, asks
`StepOrder` for the order the stream updates groups in, and saves and loads the CPU
Adam's part of a checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tierzero.engine.checkpoint.layout import CheckpointError
from tierzero.engine.config import Config
from tierzero.engine.schedule import Scheduler
from tierzero.engine.step.device import (
    hyper_params,
    load_hyper_params,
    load_store_moments,
    store_moments,
)
from tierzero.engine.step.offloaded_adam import OffloadedAdam
from tierzero.offload.step_seam import (
    STEP_TRANSITIONS,
    DeferredWatch,
    GradMeasure,
    GroupState,
    StepState,
    transition,
)

log = logging.getLogger(__name__)


class OffloadedStep:
    """The offloaded CPU Adam behind the step seam ([Note: the optimizer-step seam] in
    offload/step_seam.py): `OffloadedAdam` updates the shards; this decides when.

    On an accumulation boundary, with nothing that needs every gradient first (clipping's
    global norm, fp16's overflow check) and offload.optimizer.overlap_step on, the step
    begins when backward starts and each group is updated once its gradient shard is
    reduced (`groups_final`, from the scheduler; not a group that may still get late
    gradients, [Note: late gradients]), while backward runs on the others: state streamed
    from NVMe on the compute thread ([Note: streamed optimizer step]), state in host memory
    in place on one worker thread ([Note: in-place early step]). `finish()` does the rest.
    `lr` and the other hyper-parameters are taken when backward starts. With clipping or
    fp16 the gradients are measured during backward; state updated in place is then
    updated during the next forward ([Note: deferred step]), streamed state in step(),
    after backward ([Note: gradients measured where they are reduced] in step/streamed.py).
    """

    def __init__(self, optimizer: OffloadedAdam, scheduler: Scheduler, config: Config, *,
                 fp16: bool) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        # both runners of the update can begin during backward ([Note: shard updaters])
        overlap = config.offload.optimizer.overlap_step
        needs_every_grad = config.gradient_clipping > 0 or fp16
        self.enabled = overlap and not needs_every_grad
        # The gradient norm is measured on every boundary ([Note: the gradient norm on every
        # step]): with the early step, each group right before it is handed over; else
        # during backward in a measuring pass where the runner can measure and either runs
        # beside backward (overlap_step) or has gradients that may leave host memory.
        # Clipping's norm or fp16's overflow check then updates during the next forward
        # ([Note: deferred step]) where the runner can (in place); the streamed step
        # updates in step(), after backward.
        self.measures = optimizer.can_measure and not self.enabled and (
            overlap or not optimizer.grads_in_host)
        self.measures_early = self.enabled and optimizer.can_measure
        self.defers = self.measures and overlap and optimizer.can_defer
        if self.measures:
            # nothing is updated during backward: a late gradient only makes its group's
            # measurement stale (measured again in step(), Scheduler.reissued)
            scheduler.late.strict = False
        self.state = StepState.IDLE  # checked transitions: STEP_TRANSITIONS
        self.total = len(optimizer.param_groups[0]["params"])
        scheduler.subscribe(self)

    def _to(self, new: StepState, call: str) -> None:
        self.state = transition(
            "the optimizer step (offload.optimizer.overlap_step)", STEP_TRANSITIONS,
            self.state, new, call=call, fix="call eng.step() once after each backward() on an "
            "accumulation boundary, also after a backward() that failed (it skips the step)")

    @property
    def listening(self) -> bool:
        return self.state in (StepState.MEASURING, StepState.OPEN)

    @property
    def step_open(self) -> bool:
        return self.state is StepState.OPEN

    @property
    def step_order(self) -> list[str]:
        return self.optimizer.step_order

    def begin(self, *, boundary: bool) -> None:
        if self.measures:
            if boundary:
                self._to(StepState.MEASURING, "backward() on an accumulation boundary")
                self.optimizer.begin_measure()
            else:
                if self.state is StepState.MEASURING:
                    self._to(StepState.IDLE, "backward() within an accumulation")
                self.optimizer.forget_measured()  # the gradients change again
            return
        if not (self.enabled and boundary):
            return
        self._to(StepState.OPEN, "backward() on an accumulation boundary")
        self.optimizer.begin_step()
        if self.measures_early:
            self.optimizer.begin_measure()

    def groups_final(self, keys: Sequence[str]) -> None:
        if self.state is StepState.MEASURING:
            self.optimizer.measure(keys)
            return
        if self.measures_early:
            # before the update: the streamed step consumes a gradient it has used
            self.optimizer.measure(keys)
        self.optimizer.groups_final(keys)

    def grad_stats(self, redo: set[str]) -> Mapping[str, GradMeasure] | None:
        """The gradients measured during this boundary's backward (consumed), or None. In
        an open step the groups not handed over are measured here, before finish()
        updates them."""
        if self.state is StepState.OPEN and self.measures_early:
            return self.optimizer.grad_stats(redo)
        if self.state is not StepState.MEASURING:
            return None
        self._to(StepState.IDLE, "step()")
        return self.optimizer.grad_stats(redo)

    def finish(self, grad_scale: float) -> None:
        """Unscale and clip folded into the CPU Adam's one pass over the gradients."""
        if self.defers:
            self.optimizer.step(grad_scale=grad_scale, defer=self.scheduler.forward_keys())
            return
        try:
            self.optimizer.step(grad_scale=grad_scale)
        finally:
            if self.state is StepState.OPEN and not self.optimizer.step_open:
                self._to(StepState.IDLE, "step()")  # finished, or failed and closed
        self._follow_backward_order()

    def abandon(self) -> None:
        """Backward failed with a step begun early: groups updated so far keep their update
        (each whole: master, moments and param together); the step of this boundary is
        skipped, never applied twice. Measurements (clipping / fp16) are dropped: nothing
        was updated, and step() measures what the gradients hold then."""
        if self.state is StepState.MEASURING:
            self._to(StepState.IDLE, "abandon()")
            self.optimizer.forget_measured()
        if self.state is StepState.OPEN:
            if self.measures_early:
                self.optimizer.forget_measured()
            done = self.optimizer.abort_step()
            self._to(StepState.ABANDONED, "abandon()")
            log.error("backward failed after the optimizer step had updated %d of %d "
                      "parameter groups (overlap_step); those keep their update, the step "
                      "of this boundary is skipped", done, self.total)

    def take_abandoned(self) -> bool:
        if self.state is not StepState.ABANDONED:
            return False
        self._to(StepState.IDLE, "step()")
        return True

    def gradients_zeroed(self) -> None:
        if self.state is StepState.MEASURING:
            self.abandon()  # measured gradients are gone: step() measures zeros

    def settle(self, *, deferred: bool = True) -> None:
        self.optimizer.settle(deferred=deferred)

    def wait_groups(self, keys: Sequence[str]) -> None:
        self.optimizer.wait_groups(keys)

    def drain(self) -> None:
        self.optimizer.drain()

    def watch_deferred(self) -> DeferredWatch | None:
        return self.optimizer.watch_deferred()

    def worker_times(self) -> tuple[float, float]:
        return self.optimizer.worker_times()

    def stats(self) -> dict[str, Any] | None:
        return self.optimizer.stats()

    def close(self) -> None:
        self.optimizer.close()

    # -- checkpoints ([Note: the optimizer-step seam]) -----------------------------------
    # The CPU Adam keeps no per-tensor torch state: its moments are the store's shards
    # (streamed from their tiers when saved and loaded) and its step count is one integer,
    # saved in the same form as torch's AdamW ({"step": {"tensor": n, "dtype":
    # "torch.float32"}} per group), so a checkpoint of either loads into the other.
    def state_dict(self) -> dict[str, Any]:
        store = self.optimizer.store
        step = {"tensor": float(self.optimizer.steps), "dtype": str(torch.float32)}
        return {"param_groups": hyper_params(self.optimizer),
                "state": {key: GroupState(shards=store_moments(store, key),
                                          scalars={"step": dict(step)})
                          for key in self.optimizer.keys}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved_groups = state["param_groups"]
        for saved in saved_groups:  # torch's AdamW saves flags the CPU Adam does not have
            unsupported = [k for k in ("amsgrad", "maximize") if saved.get(k)]
            if unsupported:
                raise CheckpointError(f"the checkpoint's optimizer uses {unsupported}, which "
                                      "the engine's CPU Adam (offload.optimizer.device cpu/"
                                      "nvme) does not implement; load with offload.optimizer."
                                      "device 'none'")
        groups: Mapping[str, GroupState] = state["state"]
        steps: dict[str, int] = {}
        for key, group in groups.items():  # checked before anything changes
            unknown = sorted({*group.scalars, *group.tensors} - {"step"})
            if unknown:
                raise CheckpointError(
                    f"optimizer state {unknown} of group {key!r} has no place in the engine's "
                    "CPU Adam (offload.optimizer.device cpu/nvme); it was saved by another "
                    "optimizer type: load with offload.optimizer.device 'none' and that "
                    "optimizer")
            value = group.scalars.get("step", 0)
            step = float(value["tensor"] if isinstance(value, dict) else value)
            if step != int(step) or step < 0:
                raise CheckpointError(f"optimizer step {step} of group {key!r} is not a count")
            steps[key] = int(step)
        if len(set(steps.values())) > 1:
            raise CheckpointError(f"optimizer groups were saved at different steps {steps}; "
                                  "the engine's CPU Adam keeps one step count for every group")
        for key, group in groups.items():
            load_store_moments(self.optimizer.store, key, group)  # one shard at a time
        self.optimizer.steps = next(iter(steps.values()), 0)
        load_hyper_params(self.optimizer, saved_groups, known_only=True)

    def _follow_backward_order(self) -> None:
        """After a step: the order decides on the last backward's final order ([Note: step
        order learned from backward] in offload/step_seam.py); the stream applies it."""
        seen = self.scheduler.final_order  # trainable groups only (Scheduler._issue)
        if self.optimizer.order.learn(seen) and self.optimizer.apply_step_order():
            log.debug("optimizer step order follows backward: %s ... %s", seen[:2], seen[-2:])
