"""The optimizer step when optimizer state is offloaded (cpu or nvme): CPU Adam, streamed.

`OffloadedAdam` is the `torch.optim.Optimizer` that `initialize()` returns in
that case. Its one param group carries the hyper-parameters (so the lr
schedule and user code change `lr` as usual); its "params" are size-0 handles,
one per trainable flat group, because the fp32 masters, moments and gradients
live in the tier manager, not in tensors it could hold. When the state is
homed off the host (NVMe, or placed by the planner) `step()` runs an
`offload.AdamStream` over every group ([Note: streamed optimizer step]): each
shard's state is read once into a host ring (offload.optimizer.buffer_count x
buffer_bytes), updated, and written once, with the new compute-dtype `param16` written
in the same pass to its home tier; the last writes drain, and the next step's
first reads run, behind the next forward and backward. When the state is
homed in host memory (offload.optimizer.device = cpu) the kernel runs in place
on it instead, group by group (no staging copies; engine/step/in_place.py). Either
way the step can begin during backward (OffloadedStep in step/offloaded.py,
offload.optimizer.overlap_step).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tierzero.engine.shards.tiered import TieredShardStore
from tierzero.engine.step.in_place import InPlaceStep
from tierzero.engine.step.precision import GradStat
from tierzero.offload import AdamHyper, AdamStream, AdamThreads, PipelineStats
from tierzero.offload.settings import TensorClass
from tierzero.offload.step_seam import StepOrder

log = logging.getLogger(__name__)


def threads_per_rank(world_size: int) -> int:
    """Kernel threads for this rank: its CPUs shared by the ranks on this host (the kernel's
    default, all CPUs, oversubscribes the cores with several ranks per host)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or 1)
    return max(1, len(os.sched_getaffinity(0)) // max(1, local))


def _zip_pieces(store: TieredShardStore, key: str
                ) -> list[tuple[int, int, tuple[tuple[str, int, int], ...]]]:
    """(lo, hi, the master / exp_avg / exp_avg_sq piece) for each piece of group ``key``."""
    per = [store.pieces(key, kind) for kind in ("master", "exp_avg", "exp_avg_sq")]
    return [(m[1], m[2], (m, a, v)) for m, a, v in zip(*per, strict=True)]


class OffloadedAdam(torch.optim.Optimizer):
    """Adam/AdamW over offloaded flat shards; the engine calls `step()` at the boundary."""

    def __init__(self, store: TieredShardStore, keys: Sequence[str], *, adamw: bool,
                 lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 threads: int, buffer_bytes: int = 0, order: StepOrder | None = None
                 ) -> None:
        """buffer_bytes: the stream's host ring (TieredShardStore.pipeline_bytes()); order:
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
        self._index = {k: i for i, k in enumerate(self._keys)}
        self.order = StepOrder(self._keys) if order is None else order
        dtype = store.param16_dtype(self._keys[0]) if self._keys else torch.float32
        # With fp32 compute the kernel's low-precision shadow does not apply: param16 is
        # the master itself (written from it).
        self._shadow = dtype if dtype in (torch.bfloat16, torch.float16) else None
        names: tuple[TensorClass, ...] = ("master", "exp_avg", "exp_avg_sq", "grad", "param16")
        manager = store.manager
        if manager is None:
            raise RuntimeError("OffloadedAdam needs a finalized TieredShardStore")
        self._threads = AdamThreads(threads)
        # Optimizer state homed in host memory is updated in place; on NVMe (or placed by
        # the planner) it streams through the buffer sets, allocated once for the run.
        self._in_place: InPlaceStep | None = None
        self._stream: AdamStream | None = None
        if store.state_in_host():
            self._in_place = InPlaceStep(store, self._keys, shadow=self._shadow,
                                         threads=self._threads)
        else:
            # master and moments in pieces of offload.optimizer.chunk_numel ([Note: optimizer
            # state in chunks] in offload/adam_stream.py): one list of pieces per group
            chunks = [[(lo, hi, {str(c): mkey for c, (mkey, _, _) in zip(
                          names[:3], pieces, strict=True)})
                       for lo, hi, pieces in _zip_pieces(store, k)] for k in self._keys]
            self._stream = AdamStream(
                manager, [{n: store.manager_key(k, n) for n in ("grad", "param16")}
                          for k in self._keys],
                [store.numel(k) for k in self._keys], order=self.order.indices(),
                buffer_bytes=buffer_bytes,
                chunks=chunks,
                shadow=self._shadow, threads=self._threads,
                # zero_grad() follows every step: a consumed gradient is never read again
                # ([Note: gradient home] in engine/shards/tiered.py)
                consume_grads=True, state=store.state_precision)

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
        else touches shards)."""
        if closure is not None:
            raise ValueError("OffloadedAdam.step() takes no closure; the engine steps it")
        self.drain()  # a deferred update of the last step runs to the end first
        if defer is not None:
            in_place = self._need_in_place()
            hyper = self._hyper()
            self.steps += 1
            in_place.defer(hyper, float(self.steps), grad_scale, defer)
            return
        if self.step_open:
            if grad_scale != 1.0:
                raise RuntimeError("OffloadedAdam: a step begun during backward cannot scale "
                                   "its gradients (clipping / fp16 disable begin_step)")
            self.last_stats = (self._in_place.finish() if self._in_place is not None
                               else self._need_stream().finish())
            return
        hyper = self._hyper()
        self.steps += 1
        if self._in_place is not None:
            self.last_stats = self._in_place.run_all(hyper, float(self.steps), grad_scale)
            return
        self.last_stats = self._need_stream().step(hyper, float(self.steps), grad_scale)

    # -- a step started while backward runs ([Note: streamed optimizer step],
    # [Note: in-place early step]) ----------------------------------------------------------
    @property
    def can_begin_early(self) -> bool:
        """Shards can be updated as they turn final (streamed, or in place on a worker)."""
        return self._stream is not None or self._in_place is not None

    @property
    def step_open(self) -> bool:
        if self._in_place is not None:
            return self._in_place.is_open
        return self._stream is not None and self._stream.is_open

    def begin_step(self) -> None:
        """Start a step (unscaled gradients) with the current hyper-parameters; shards are
        updated as `groups_final` reports them, the rest by `step()`."""
        hyper = self._hyper()
        if self._in_place is not None:
            self._in_place.begin(hyper, float(self.steps + 1))
        else:
            self._need_stream().begin(hyper, float(self.steps + 1))
        self.steps += 1

    def groups_final(self, keys: Sequence[str]) -> None:
        """These groups' gradients are final for this step: update what can be updated
        (streamed: now, on this thread; in place: handed to the step's worker thread)."""
        if self._in_place is not None:
            self._in_place.groups_final(keys)
            return
        self._need_stream().mark_final([self._index[k] for k in keys])

    def abort_step(self) -> int:
        """Abandon a step begun early (its backward failed): shards updated so far stay
        updated, each whole; returns their number."""
        if self._in_place is not None:
            return self._in_place.abort()
        return 0 if self._stream is None else self._stream.abort()

    @property
    def step_order(self) -> list[str]:
        """Group keys in the order the streamed step updates them (the construction
        order for state updated in place, which has no order)."""
        if self._stream is None:
            return list(self._keys)
        return [self._keys[i] for i in self._stream.order]

    def apply_step_order(self) -> bool:
        """The streamed step takes `order`'s current order from the next step on (state
        updated in place has no order). Returns whether the stream's order changed."""
        if self._stream is None:
            return False
        return self._stream.set_order(self.order.indices())

    def settle(self, *, deferred: bool = True) -> None:
        """Wait until no optimizer thread is updating a shard (the in-place step's worker
        has run everything handed to it; with `deferred` False, an update deferred into the
        next forward may go on, each group waited for before its gather); a no-op for the
        stream, which updates shards on the caller's thread."""
        if self._in_place is not None:
            self._in_place.settle()
            if deferred:
                self.drain()

    # -- clipping / fp16 with overlap_step: [Note: deferred step] ---------------------------
    @property
    def can_defer(self) -> bool:
        """The update can run during the next forward (state updated in place)."""
        return self._in_place is not None

    def begin_measure(self) -> None:
        """Backward begins on a boundary: gradients turning final are measured beside it."""
        self._need_in_place().begin_measure()

    def measure(self, keys: Sequence[str]) -> None:
        self._need_in_place().measure(keys)

    def forget_measured(self) -> None:
        if self._in_place is not None:
            self._in_place.forget_measured()

    def grad_stats(self, redo: set[str]) -> dict[str, GradStat]:
        """Every group's gradient norm and finiteness (see InPlaceStep.grad_stats)."""
        return self._need_in_place().grad_stats(redo)

    @property
    def deferred(self) -> bool:
        return self._in_place is not None and self._in_place.deferred

    def wait_groups(self, keys: Sequence[str]) -> None:
        """These groups' deferred updates have run (a failure is raised here)."""
        if self._in_place is not None and self._in_place.deferred:
            done = self._in_place.wait_groups(keys)
            if done is not None:
                self.last_stats = done

    def drain(self) -> None:
        """Every deferred update has run (a failure is raised here)."""
        if self._in_place is not None and self._in_place.deferred:
            done = self._in_place.drain()
            if done is not None:
                self.last_stats = done

    def worker_times(self) -> tuple[float, float]:
        """(seconds the optimizer's worker thread ran, of which hidden under compute),
        cumulative: measured as the worker's time outside every wait of the training
        thread on it (OverlapClock in engine/step/in_place.py). (0, 0) for the streamed
        step, which updates shards on the training thread."""
        return (0.0, 0.0) if self._in_place is None else self._in_place.clock.totals()

    def _need_in_place(self) -> InPlaceStep:
        if self._in_place is None:
            raise RuntimeError("OffloadedAdam: no in-place step (optimizer state streamed)")
        return self._in_place

    def _hyper(self) -> AdamHyper:
        group = self.param_groups[0]
        return AdamHyper(lr=float(group["lr"]), beta1=float(group["betas"][0]),
                         beta2=float(group["betas"][1]), eps=float(group["eps"]),
                         weight_decay=float(group["weight_decay"]), adamw=self.adamw)

    def _need_stream(self) -> AdamStream:
        if self._stream is None:
            raise RuntimeError("OffloadedAdam: no optimizer stream (state updated in place, "
                               "or closed)")
        return self._stream

    def flush(self) -> None:
        """Wait for the optimizer's writes still in flight (a failure is raised here)."""
        if self._stream is not None:
            self._stream.flush()

    def stats(self) -> dict[str, Any] | None:
        s = self.last_stats
        if s is None:
            return None
        return {"shards": s.shards, "total_s": s.total_s, "compute_s": s.compute_s,
                "fetch_wait_s": s.fetch_wait_s, "store_wait_s": s.store_wait_s,
                "buffer_bytes": s.buffer_bytes}

    def close(self) -> None:
        try:
            if self._in_place is not None:
                self._in_place.close()
            if self._stream is not None:
                self._stream.close()
        finally:
            self._stream = None
            self._threads.close()
