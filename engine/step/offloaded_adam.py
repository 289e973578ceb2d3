"""The optimizer step when optimizer state is offloaded (cpu or nvme): CPU Adam, streamed.

`OffloadedAdam` is the `torch.optim.Optimizer` that `initialize()` returns in
that case. Its one param group carries the hyper-parameters (so the lr
schedule and user code change `lr` as usual); its "params" are size-0 handles,
one per trainable flat group, because the fp32 masters, the moments and the gradients
(fp32, or the compute dtype where that is exact: [Note: gradient precision]) live in the
tier manager, not in tensors it could hold. When the state is
homed off the host (NVMe, or placed by the planner) `step()` runs an
`offload.AdamStream` over every group ([Note: streamed optimizer step]): each
shard's state is read once into a host ring (offload.optimizer.buffer_count x
buffer_bytes), updated, and written once, with the new compute-dtype `param` written
in the same pass to its home tier; the last writes drain, and the next step's
first reads run, behind the next forward and backward. When the state is
homed in host memory (offload.optimizer.device = cpu) the kernel runs in place
on it instead, group by group (no staging copies; engine/step/in_place.py). Either
way the step can begin during backward (OffloadedStep in step/offloaded.py,
offload.optimizer.overlap_step). The two are `ShardUpdater`s ([Note: shard updaters]
in offload/shard_updater.py): one is chosen in the constructor and every call goes to it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tierzero.engine.shards.tiered import TieredShardStore
from tierzero.engine.step.in_place import InPlaceStep
from tierzero.engine.step.streamed import StreamedStep
from tierzero.offload import AdamHyper, AdamThreads, PipelineStats
from tierzero.offload.shard_updater import ShardUpdater
from tierzero.offload.step_seam import DeferredWatch, GradMeasure, StepOrder

log = logging.getLogger(__name__)


def threads_per_rank(world_size: int) -> int:
    """Kernel threads for this rank: its CPUs shared by the ranks on this host (the kernel's
    default, all CPUs, oversubscribes the cores with several ranks per host)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or 1)
    return max(1, len(os.sched_getaffinity(0)) // max(1, local))


class OffloadedAdam(torch.optim.Optimizer):
    """Adam/AdamW over offloaded flat shards; the engine calls `step()` at the boundary."""

    def __init__(self, store: TieredShardStore, keys: Sequence[str], *, adamw: bool,
                 lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 threads: int, buffer_bytes: int = 0, order: StepOrder | None = None
                 ) -> None:
        """buffer_bytes: the stream's host ring (StateLayout.ring_bytes()); order:
        the owner of the streamed step's group order ([Note: step order learned from
        backward]; default: construction order)."""
        handles = [torch.empty(0) for _ in keys]  # size-0: the state is in the tier manager
        super().__init__(handles, {"lr": lr, "betas": betas, "eps": eps,
                                   "weight_decay": weight_decay})
        self.adamw = adamw
        self.steps = 0
        self.last_stats: PipelineStats | None = None
        self._store = store
        self._keys = list(keys)
        self.order = StepOrder(self._keys) if order is None else order
        dtype = store.param_dtype(self._keys[0]) if self._keys else torch.float32
        # With fp32 compute the kernel's low-precision shadow does not apply: param is
        # the master itself (written from it).
        shadow = dtype if dtype in (torch.bfloat16, torch.float16) else None
        if store.manager is None:
            raise RuntimeError("OffloadedAdam needs a finalized TieredShardStore")
        self._threads = AdamThreads(threads)
        # The one runner of the update ([Note: shard updaters]): optimizer state homed in
        # host memory is updated in place; on NVMe (or placed by the planner) it streams
        # through the buffer sets, allocated once for the run.
        self._runner: ShardUpdater
        if store.state_in_host():
            self._runner = InPlaceStep(store, self._keys, shadow=shadow,
                                       threads=self._threads)
        else:
            self._runner = StreamedStep(store, self._keys, order=self.order.keys,
                                        buffer_bytes=buffer_bytes, shadow=shadow,
                                        threads=self._threads)

    @property
    def store(self) -> TieredShardStore:
        """The store whose shards this optimizer updates."""
        return self._store

    @property
    def keys(self) -> list[str]:
        """The trainable group keys, in construction order."""
        return list(self._keys)

    def step(self, closure: Callable[[], float] | None = None, *,  # type: ignore[override]
             grad_scale: float = 1.0, defer: Sequence[str] | None = None) -> None:
        """One Adam step over every shard; gradients are multiplied by `grad_scale` on the
        fly (clipping coefficient, fp16 unscale), so no extra pass over them is needed.
        A step begun during backward (begin_step) is finished here. `defer`: the worker
        runs the step group by group in this order while the caller goes on ([Note:
        deferred step]; `wait_groups` before a group is used, `drain` before anything
        else touches shards; only where `can_defer`)."""
        if closure is not None:
            raise ValueError("OffloadedAdam.step() takes no closure; the engine steps it")
        self.drain()  # a deferred update of the last step runs to the end first
        if defer is not None:
            self._runner.defer(self._hyper(), float(self.steps + 1), grad_scale, defer)
            self.steps += 1
            return
        if self.step_open:
            if grad_scale != 1.0:
                raise RuntimeError("OffloadedAdam: a step begun during backward cannot scale "
                                   "its gradients (clipping / fp16 disable begin_step)")
            self.last_stats = self._runner.finish()
            return
        hyper = self._hyper()
        self.steps += 1
        self.last_stats = self._runner.run_all(hyper, float(self.steps), grad_scale)

    # -- a step started while backward runs ([Note: streamed optimizer step],
    # [Note: in-place early step]) ----------------------------------------------------------
    @property
    def step_open(self) -> bool:
        return self._runner.is_open

    def begin_step(self) -> None:
        """Start a step (unscaled gradients) with the current hyper-parameters; shards are
        updated as `groups_final` reports them, the rest by `step()`."""
        self._runner.begin(self._hyper(), float(self.steps + 1))
        self.steps += 1

    def groups_final(self, keys: Sequence[str]) -> None:
        """These groups' gradients are final for this step: update what can be updated
        (streamed: now, on this thread; in place: handed to the step's worker thread)."""
        self._runner.groups_final(keys)

    def abort_step(self) -> int:
        """Abandon a step begun early (its backward failed): shards updated so far stay
        updated, each whole; returns their number."""
        return self._runner.abort()

    @property
    def step_order(self) -> list[str]:
        """Group keys in the order the step updates them (the construction order for
        state updated in place, which has no order)."""
        return self._runner.order

    def apply_step_order(self) -> bool:
        """The streamed step takes `order`'s current order from the next step on (state
        updated in place has no order). Returns whether the runner's order changed."""
        return self._runner.set_order(self.order.keys)

    def settle(self, *, deferred: bool = True) -> None:
        """Wait until no optimizer thread is updating a shard (the in-place step's worker
        has run everything handed to it; with `deferred` False, an update deferred into the
        next forward may go on, each group waited for before its gather); a no-op for the
        stream, which updates shards on the caller's thread."""
        self._runner.settle()
        if deferred:
            self.drain()

    # -- clipping / fp16 with overlap_step: [Note: deferred step] ---------------------------
    @property
    def can_measure(self) -> bool:
        """Gradients can be measured during backward, as each turns final (the update then
        runs in step() unless `can_defer`)."""
        return self._runner.measures

    @property
    def grads_in_host(self) -> bool:
        """The gradient shards are homed in host memory (offload.optimizer.grad_device cpu,
        [Note: gradient home]): reading them after backward costs no disk read."""
        return self._store.homes["grad"] == "cpu"

    @property
    def can_defer(self) -> bool:
        """Gradients can be measured during backward and the update run during the next
        forward (state updated in place)."""
        return self._runner.measures and self._runner.defers

    def begin_measure(self) -> None:
        """Backward begins on a boundary: gradients turning final are measured beside it."""
        self._runner.begin_measure()

    def measure(self, keys: Sequence[str]) -> None:
        self._runner.measure(keys)

    def forget_measured(self) -> None:
        self._runner.forget_measured()

    def grad_stats(self, redo: set[str]) -> Mapping[str, GradMeasure]:
        """Every group's gradient norm and finiteness (see InPlaceStep.grad_stats)."""
        return self._runner.grad_stats(redo)

    @property
    def deferred(self) -> bool:
        return self._runner.deferred

    def wait_groups(self, keys: Sequence[str]) -> None:
        """These groups' deferred updates have run (a failure is raised here)."""
        done = self._runner.wait_groups(keys)
        if done is not None:
            self.last_stats = done

    def drain(self) -> None:
        """Every deferred update has run (a failure is raised here)."""
        done = self._runner.drain()
        if done is not None:
            self.last_stats = done

    def watch_deferred(self) -> DeferredWatch | None:
        """A watch on the groups whose deferred update has not ended (None: none)."""
        return self._runner.watch_deferred()

    def worker_times(self) -> tuple[float, float]:
        """(seconds the optimizer's worker thread ran, of which hidden under compute),
        cumulative: measured as the worker's time outside every wait of the training
        thread on it (OverlapClock in engine/step/worker_time.py). (0, 0) for the streamed
        step, which updates shards on the training thread."""
        return self._runner.worker_times()

    def _hyper(self) -> AdamHyper:
        group = self.param_groups[0]
        return AdamHyper(lr=float(group["lr"]), beta1=float(group["betas"][0]),
                         beta2=float(group["betas"][1]), eps=float(group["eps"]),
                         weight_decay=float(group["weight_decay"]), adamw=self.adamw)

    def flush(self) -> None:
        """Wait for the optimizer's writes still in flight (a failure is raised here)."""
        self._runner.flush()

    def stats(self) -> dict[str, Any] | None:
        s = self.last_stats
        if s is None:
            return None
        return {"shards": s.shards, "total_s": s.total_s, "compute_s": s.compute_s,
                "fetch_wait_s": s.fetch_wait_s, "store_wait_s": s.store_wait_s,
                "buffer_bytes": s.buffer_bytes}

    def close(self) -> None:
        try:
            self._runner.close()
        finally:
            self._threads.close()
