"""OffloadedStep: the offloaded CPU Adam behind the optimizer-step seam.

The driver of the offloaded step ([Note: the optimizer-step seam] in offload/step_seam.py):
it holds the one runner that updates the shards (`ShardUpdater`, [Note: shard updaters] in
offload/shard_updater.py: in place for state in host memory, streamed for state off it),
keeps the one state of the step (`StepState`), decides when the update runs (during
backward as gradients turn final, after it, or during the next forward), follows the
order backward finalises groups in (`StepOrder`), and saves and loads the CPU Adam's part
of a checkpoint. `OffloadedAdam` (step/offloaded_adam.py) is only the torch.optim face:
the param group the lr schedule changes and the step count.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from tierzero.engine.checkpoint.layout import CheckpointError
from tierzero.engine.config.schema import OptimizerConfig
from tierzero.engine.shards.tiered import TieredShardStore
from tierzero.engine.step.device import (
    hyper_params,
    load_hyper_params,
    load_store_moments,
    store_moments,
)
from tierzero.engine.step.in_place import InPlaceStep
from tierzero.engine.step.offloaded_adam import OffloadedAdam
from tierzero.engine.step.speculation import SpeculationPolicy
from tierzero.engine.step.streamed import HeldParam, StreamedStep
from tierzero.offload import AdamHyper, AdamThreads, PipelineStats
from tierzero.offload.shard_updater import ShardUpdater
from tierzero.offload.speculation import SpeculationSpaceError
from tierzero.offload.step_seam import (
    STEP_TRANSITIONS,
    DeferredWatch,
    GradMeasure,
    GroupState,
    StepOrder,
    StepState,
    transition,
)

log = logging.getLogger(__name__)


def threads_per_rank(world_size: int) -> int:
    """Kernel threads for this rank: its CPUs shared by the ranks on this host (the kernel's
    default, all CPUs, oversubscribes the cores with several ranks per host)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or 1)
    return max(1, len(os.sched_getaffinity(0)) // max(1, local))


def offloaded_step(store: TieredShardStore, keys: Sequence[str], blocks: Sequence[Sequence[str]],
                   root: Sequence[str], optimizer: OptimizerConfig, *, world_size: int,
                   overlap: bool, fp16: bool, clipping: bool, speculate: bool = True,
                   held: HeldParam | None = None) -> tuple[OffloadedAdam, OffloadedStep]:
    """The CPU Adam's torch.optim face and its driver over the trainable groups `keys`;
    blocks, root: the group keys of each block unit and of the root, for the first step
    order ([Note: step order learned from backward] in offload/step_seam.py); held: a
    group's param shard where the engine holds it ([Note: a param held in host memory]
    in offload/shard_inputs.py)."""
    order = StepOrder.backward_guess(keys, blocks, root)
    face = OffloadedAdam(keys, adamw=optimizer.type == "adamw", lr=optimizer.lr,
                         betas=optimizer.betas, eps=optimizer.eps,
                         weight_decay=optimizer.weight_decay)
    driver = OffloadedStep(store, face, order, threads=threads_per_rank(world_size),
                           buffer_bytes=store.layout.ring_bytes(), overlap=overlap, fp16=fp16,
                           clipping=clipping, speculate=speculate, held=held)
    return face, driver


class StepMode(enum.Enum):
    """When the offloaded update runs, decided once from the settings and the runner."""

    AFTER = enum.auto()  # in step(), after backward
    EARLY = enum.auto()  # begun during backward, each group as its gradient turns final
    MEASURE = enum.auto()  # backward measures each final gradient; the update in step()
    DEFER = enum.auto()  # backward measures; the update runs during the next forward


def step_mode(runner: ShardUpdater, *, overlap: bool, needs_every_grad: bool,
              grads_in_host: bool) -> StepMode:
    """overlap: offload.optimizer.overlap_step; needs_every_grad: clipping's global norm or
    fp16's overflow check must see every gradient before any update.

    The gradient norm is measured on every boundary ([Note: the gradient norm on every
    step]): with the early step, each group right before it is handed over; else during
    backward where the runner can measure and either runs beside backward (overlap_step)
    or has gradients that may leave host memory. Clipping's norm or fp16's overflow check
    then updates during the next forward ([Note: deferred step]) where the runner can."""
    if overlap and not needs_every_grad:
        return StepMode.EARLY
    if not runner.measures or not (overlap or not grads_in_host):
        return StepMode.AFTER
    return StepMode.DEFER if overlap and runner.defers else StepMode.MEASURE


class OffloadedStep:
    """The offloaded CPU Adam behind the step seam ([Note: the optimizer-step seam] in
    offload/step_seam.py): the runner updates the shards; this decides when.

    EARLY (offload.optimizer.overlap_step on, nothing that needs every gradient first):
    on an accumulation boundary the step begins when backward starts and each group is
    updated once its gradient shard is reduced (`groups_final`, from the scheduler; not a
    group that may still get late gradients, [Note: late gradients]), while backward runs
    on the others: state streamed from NVMe on the compute thread ([Note: streamed
    optimizer step]), state in host memory in place on one worker thread ([Note: in-place
    early step]). `finish()` does the rest. `lr` and the other hyper-parameters are taken
    when backward starts. With clipping or fp16 (MEASURE, DEFER) the gradients are
    measured during backward and, with overlap_step, the update runs during the next
    forward, in place ([Note: deferred step]) or streamed ([Note: deferred streamed step]
    in step/deferred_stream.py); without it, in step().
    """

    def __init__(self, store: TieredShardStore, face: OffloadedAdam, order: StepOrder, *,
                 threads: int, buffer_bytes: int, overlap: bool, fp16: bool,
                 clipping: bool, speculate: bool = True, held: HeldParam | None = None
                 ) -> None:
        """order: the streamed step's group order ([Note: step order learned from
        backward]); threads: kernel threads (threads_per_rank); buffer_bytes: the stream's
        host ring (StateLayout.ring_bytes()); overlap: offload.optimizer.overlap_step;
        speculate: offload.optimizer.speculate_step ([Note: speculated step]); held: as
        offloaded_step's."""
        if store.manager is None:
            raise RuntimeError("OffloadedStep needs a finalized TieredShardStore")
        self.optimizer = face
        self.store = store
        self.order = order
        keys = face.keys
        dtype = store.param_dtype(keys[0]) if keys else torch.float32
        # With fp32 compute the kernel's low-precision shadow does not apply: param is
        # the master itself (written from it).
        shadow = dtype if dtype in (torch.bfloat16, torch.float16) else None
        self._threads = AdamThreads(threads)
        # The one runner of the update ([Note: shard updaters]): optimizer state homed in
        # host memory is updated in place; on NVMe (or placed by the planner) it streams
        # through the buffer sets, allocated once for the run.
        self.runner: ShardUpdater
        if store.state_in_host():
            self.runner = InPlaceStep(store, keys, shadow=shadow, threads=self._threads)
        else:
            self.runner = StreamedStep(store, keys, order=order.keys,
                                       buffer_bytes=buffer_bytes, shadow=shadow,
                                       threads=self._threads, held=held)
        self.mode = step_mode(self.runner, overlap=overlap, needs_every_grad=clipping or fp16,
                              grads_in_host=store.homes["grad"] == "cpu")
        # the early step also measures each group right before it updates it
        self._measures_early = self.mode is StepMode.EARLY and self.runner.measures
        self.state = StepState.IDLE  # checked transitions: STEP_TRANSITIONS
        self.last_stats: PipelineStats | None = None
        # [Note: speculated step] in step/speculation.py: the streamed update of a deferring
        # step, where every key it writes is on NVMe
        self._speculator = (self.runner if speculate and self.mode is StepMode.DEFER
                            and self.runner.speculates else None)
        self.policy = SpeculationPolicy(enabled=self._speculator is not None)
        self._reserved = False  # the swap room of the kept regions was reserved
        self._unscale = 1.0  # the factor of this boundary's step if nothing is clipped
        self._spec_hyper: AdamHyper | None = None  # what the speculated update used
        self._handed: set[str] = set()  # groups the speculated update may have updated
        self._late = False  # one of those was reduced again after it was handed over
        self.last_update: str | None = None  # how the last boundary's update ran (StepDriver)
        self.partial_step: str | None = None  # [Note: a partial step]

    def _to(self, new: StepState, call: str) -> None:
        self.state = transition(
            "the optimizer step (offload.optimizer.overlap_step)", STEP_TRANSITIONS,
            self.state, new, call=call, fix="call eng.step() once after each backward() on an "
            "accumulation boundary, also after a backward() that failed (it skips the step)")

    @property
    def listening(self) -> bool:
        return self.state in (StepState.MEASURING, StepState.OPEN, StepState.SPECULATING)

    @property
    def updates_in_backward(self) -> bool:
        return self.mode is StepMode.EARLY

    @property
    def defers(self) -> bool:
        return self.mode is StepMode.DEFER

    @property
    def step_open(self) -> bool:
        return self.state is StepState.OPEN

    @property
    def step_order(self) -> list[str]:
        return self.runner.order

    def begin(self, *, boundary: bool, unscale: float = 1.0) -> None:
        if boundary:
            self.last_update = None  # until this boundary's step() runs it
        if self.state is StepState.SPECULATING:  # a second backward changes the gradients
            self._undo("a second backward() before step()", to=StepState.MEASURING)
        if self.mode in (StepMode.MEASURE, StepMode.DEFER):
            if boundary:
                self._unscale = unscale
                if self._may_speculate():
                    self._speculate(unscale)
                    return
                self._to(StepState.MEASURING, "backward() on an accumulation boundary")
                self.runner.begin_measure()
            else:
                if self.state is StepState.MEASURING:
                    self._to(StepState.IDLE, "backward() within an accumulation")
                self.runner.forget_measured()  # the gradients change again
            return
        if not (self.mode is StepMode.EARLY and boundary):
            return
        self._to(StepState.OPEN, "backward() on an accumulation boundary")
        self.runner.begin(self.optimizer.hyper(), float(self.optimizer.steps + 1))
        self.optimizer.count_step()
        if self._measures_early:
            self.runner.begin_measure()

    def groups_final(self, keys: Sequence[str]) -> None:
        if self.state is StepState.MEASURING:
            self.runner.measure(keys)
            return
        if self.state is StepState.SPECULATING and self._speculator is not None:
            self.runner.measure(keys)  # before the update, as the early step measures
            self._handed.update(keys)
            self._speculator.groups_final(keys)
            return
        if self._measures_early:
            # before the update: the streamed step consumes a gradient it has used
            self.runner.measure(keys)
        self.runner.groups_final(keys)

    def grad_stats(self, redo: set[str]) -> Mapping[str, GradMeasure] | None:
        """The gradients measured during this boundary's backward (consumed), or None. In
        an open step the groups not handed over are measured here, before finish()
        updates them."""
        if self.state is StepState.OPEN and self._measures_early:
            return self.runner.grad_stats(redo)
        if self.state is StepState.SPECULATING:
            self._late = bool(redo & self._handed)  # updated from part of its gradient
            return self.runner.grad_stats(redo)
        if self.state is not StepState.MEASURING:
            return None
        self._to(StepState.IDLE, "step()")
        return self.runner.grad_stats(redo)

    def finish(self, grad_scale: float, *, next_forward: Sequence[str],
               seen: Sequence[str]) -> None:
        """The step, unscale and clip folded into the CPU Adam's one pass over the
        gradients (`grad_scale`). next_forward: trainable group keys in the order the next
        forward gathers them (a deferred update runs in it); seen: the order the last
        backward finalised them in ([Note: step order learned from backward])."""
        self._settle_deferred()  # a deferred update of the last step runs to the end first
        face = self.optimizer
        exact = grad_scale == self._unscale  # clipping did not fire
        if self.state is StepState.SPECULATING:
            self.policy.observe(exact=exact, speculated=True)
            why = self._commit_refused(grad_scale)
            if why is None:
                self._commit()
                self.last_update = "speculated"
                self._follow_backward_order(seen)
                return
            self._undo(why, to=StepState.IDLE)  # then the exact update, deferred
            undone = True
        else:
            undone = False
            if self.policy.enabled:
                self.policy.observe(exact=exact, speculated=False)
        if self.mode is StepMode.DEFER:
            self.runner.defer(face.hyper(), float(face.steps + 1), grad_scale, next_forward)
            face.count_step()
            self.last_update = "undone" if undone else "deferred"
            return
        if self.state is StepState.OPEN:
            if grad_scale != 1.0:
                raise RuntimeError("OffloadedStep: a step begun during backward cannot scale "
                                   "its gradients (clipping / fp16 disable the early step)")
            try:
                with self._tears():
                    self.last_stats = self.runner.finish()
            finally:
                self._to(StepState.IDLE, "step()")  # finished, or failed and closed
            self.last_update = "backward"
        else:
            hyper = face.hyper()
            face.count_step()
            with self._tears():
                self.last_stats = self.runner.run_all(hyper, float(face.steps), grad_scale)
            self.last_update = "step"
        self._follow_backward_order(seen)

    def abandon(self) -> None:
        """Backward failed with a step begun early: groups updated so far keep their update
        (each whole: master, moments and param together); the step of this boundary is
        skipped, never applied twice. Measurements (clipping / fp16) are dropped: nothing
        was updated, and step() measures what the gradients hold then. A speculated update
        is undone, then as the measuring step."""
        if self.state is StepState.SPECULATING:
            self._undo("backward() failed or the gradients were zeroed", to=StepState.MEASURING)
        if self.state is StepState.MEASURING:
            self._to(StepState.IDLE, "abandon()")
            self.runner.forget_measured()
        if self.state is StepState.OPEN:
            if self._measures_early:
                self.runner.forget_measured()
            done = self.runner.abort()
            self._to(StepState.ABANDONED, "abandon()")
            if done and self.partial_step is None:  # [Note: a partial step]
                self.partial_step = (f"backward failed after the optimizer step begun in it "
                                     f"(overlap_step) had updated {done} of "
                                     f"{len(self.optimizer.keys)} parameter groups; that "
                                     f"step was skipped")
            log.error("backward failed after the optimizer step had updated %d of %d "
                      "parameter groups (overlap_step); those keep their update, the step "
                      "of this boundary is skipped", done, len(self.optimizer.keys))

    def take_abandoned(self) -> bool:
        if self.state is not StepState.ABANDONED:
            return False
        self._to(StepState.IDLE, "step()")
        return True

    def gradients_zeroed(self) -> None:
        if self.state in (StepState.MEASURING, StepState.SPECULATING):
            if self.policy.enabled:  # a skipped step (fp16 overflow, a non-finite norm)
                self.policy.observe(exact=False,
                                    speculated=self.state is StepState.SPECULATING)
            self.abandon()  # measured gradients are gone: step() measures zeros

    def before_use(self) -> None:
        if self.state is StepState.SPECULATING:  # the measurements stay: gradients unchanged
            self._undo("the shards are used between backward() and step()",
                       to=StepState.MEASURING)

    # -- [Note: speculated step] in step/speculation.py ----------------------------------
    def _may_speculate(self) -> bool:
        if self._speculator is None or not self.policy.should():
            return False
        if not self._reserved:
            try:
                ready = self._speculator.reserve_speculation()
            except SpeculationSpaceError as exc:
                log.warning("%s; the optimizer update is not speculated into backward in "
                            "this run (offload.optimizer.speculate_step)", exc)
                ready = False
            if not ready:  # this layout cannot: the deferred update from now on
                self.policy.enabled = False
                return False
            self._reserved = True
        return True

    def _speculate(self, unscale: float) -> None:
        if self._speculator is None:
            raise RuntimeError("OffloadedStep: this runner cannot speculate")
        self._to(StepState.SPECULATING, "backward() on an accumulation boundary")
        self.policy.speculated += 1
        self._handed.clear()
        self._late = False
        self._spec_hyper = self.optimizer.hyper()
        try:
            self._speculator.begin_speculation(self._spec_hyper,
                                               float(self.optimizer.steps + 1), unscale,
                                               order=self.order.keys)
        except BaseException:
            self._undo("its start failed", to=StepState.IDLE)
            raise

    def _commit_refused(self, grad_scale: float) -> str | None:
        """Why the speculated update is not this step's exact one (None: it is)."""
        if grad_scale != self._unscale:
            return f"clipping scales the gradients by {grad_scale / self._unscale:.6g}"
        if self._late:
            return "a group was reduced again after its update (a late gradient)"
        if self.optimizer.hyper() != self._spec_hyper:
            return "the hyper-parameters changed between backward() and step()"
        return None

    def _commit(self) -> None:
        if self._speculator is None:
            raise RuntimeError("OffloadedStep: no speculation to commit")
        try:
            self.last_stats = self._speculator.commit_speculation()
        except BaseException:
            self._undo("its commit failed", to=StepState.IDLE)  # every group untouched
            raise
        self.optimizer.count_step()
        self._to(StepState.IDLE, "step()")

    def _undo(self, why: str, *, to: StepState) -> None:
        """Back to the state before the speculated update; `to`: IDLE, or MEASURING where
        its measurements still hold."""
        if self._speculator is None:
            raise RuntimeError("OffloadedStep: no speculation to undo")
        self.policy.undone += 1
        try:
            done = self._speculator.undo_speculation()
        finally:
            if to is StepState.IDLE:
                self.runner.forget_measured()
            self._to(to, "undo of the speculated update")
        log.info("speculated optimizer update undone (%s): %d groups had been updated; "
                 "%s", why, done, "the step runs exactly after it" if to is StepState.IDLE
                 else "the step() that follows runs it exactly")

    def settle(self, *, deferred: bool = True) -> None:
        """No optimizer thread is updating a shard after this (with `deferred` False, an
        update deferred into the next forward may go on, each group waited for before its
        gather)."""
        with self._tears():
            self.runner.settle()
        if deferred:
            self._settle_deferred()

    def wait_groups(self, keys: Sequence[str]) -> None:
        """These groups' deferred updates have run (a failure is raised here)."""
        with self._tears():
            done = self.runner.wait_groups(keys)
        if done is not None:
            self.last_stats = done

    def drain(self) -> None:
        """Every deferred update has run (a failure is raised here)."""
        self._settle_deferred()

    def _settle_deferred(self) -> None:
        with self._tears():
            done = self.runner.drain()
        if done is not None:
            self.last_stats = done

    # [Note: a partial step]
    # An update that fails partway (a swap write or read fails, the kernel raises) leaves
    # the groups it reached updated and the rest not: the deferred update keeps each group
    # before the failed one ([Note: deferred streamed step]), the step in step() and the
    # early step's worker likewise. Training may go on from that state (the next step
    # updates every group), but it is no state of any run: saved, a resume would continue
    # neither the run before the step nor the one after it, silently. So the first failure
    # an update raises is kept here with its step, and the engine's save_checkpoint refuses
    # while it is kept, naming it and the fixes: load a checkpoint (load_state_dict, which
    # replaces every group's state, forgets it) or save it knowingly
    # (save_checkpoint(allow_partial_step=True)). An export writes it with a warning. Any
    # failure an update raises counts, also one before its first group was written: the
    # runners do not say how far they got, and a refusal too many costs a load, a partial
    # state saved costs a resume that continues no run. The early step abandoned because
    # backward failed (abandon()) is kept too once it had updated a group: its step is
    # skipped, the groups it reached keep their update.
    # Not kept: an interrupt (KeyboardInterrupt) that stops a wait while the worker runs
    # on (tierzero train saves nothing after an abandoned step anyway, [Note: stopping a
    # run]), and a write that fails after a whole update (its key is refused on read:
    # [Note: a lost write] in offload/core.py).
    @contextlib.contextmanager
    def _tears(self) -> Iterator[None]:
        """An update runs inside: an Exception it raises is kept as the partial step."""
        try:
            yield
        except Exception as exc:
            if self.partial_step is None:
                self.partial_step = (f"optimizer step {self.optimizer.steps}'s update failed "
                                     f"partway ({type(exc).__name__}: {exc})")
            raise

    def flush(self) -> None:
        """Wait for the optimizer's writes still in flight (a failure is raised here)."""
        self.runner.flush()

    def watch_deferred(self) -> DeferredWatch | None:
        return self.runner.watch_deferred()

    def worker_times(self) -> tuple[float, float]:
        """(seconds the optimizer's worker thread ran, of which hidden under compute),
        cumulative (OverlapClock in engine/step/worker_time.py); the streamed step's worker
        runs only a deferred update (during backward it runs on the training thread)."""
        return self.runner.worker_times()

    def stats(self) -> dict[str, Any] | None:
        s = self.last_stats
        if s is None:
            return None
        return {"shards": s.shards, "total_s": s.total_s, "compute_s": s.compute_s,
                "fetch_wait_s": s.fetch_wait_s, "store_wait_s": s.store_wait_s,
                "buffer_bytes": s.buffer_bytes,
                # [Note: speculated step]: steps updated during backward, and of those undone
                "speculated_steps": self.policy.speculated,
                "undone_steps": self.policy.undone}

    def close(self) -> None:
        try:
            self.runner.close()
        finally:
            self._threads.close()

    # -- checkpoints ([Note: the optimizer-step seam]) -----------------------------------
    # The CPU Adam keeps no per-tensor torch state: its moments are the store's shards
    # (streamed from their tiers when saved and loaded) and its step count is the face's
    # (OffloadedAdam.step_scalars: torch AdamW's form, so a checkpoint of either loads
    # into the other).
    def state_dict(self) -> dict[str, Any]:
        face = self.optimizer
        return {"param_groups": hyper_params(face),
                "state": {key: GroupState(shards=store_moments(self.store, key),
                                          scalars=face.step_scalars())
                          for key in face.keys}}

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
        for key, group in groups.items():  # checked before anything changes
            unknown = sorted({*group.scalars, *group.tensors} - {"step"})
            if unknown:
                raise CheckpointError(
                    f"optimizer state {unknown} of group {key!r} has no place in the engine's "
                    "CPU Adam (offload.optimizer.device cpu/nvme); it was saved by another "
                    "optimizer type: load with offload.optimizer.device 'none' and that "
                    "optimizer")
        steps = OffloadedAdam.saved_steps({k: g.scalars for k, g in groups.items()})
        for key, group in groups.items():
            load_store_moments(self.store, key, group)  # one shard at a time
        self.optimizer.load_steps(steps)
        load_hyper_params(self.optimizer, saved_groups, known_only=True)
        if groups.keys() >= set(self.optimizer.keys):  # every group replaced: whole again
            self.partial_step = None

    def _follow_backward_order(self, seen: Sequence[str]) -> None:
        """After a step: the order decides on the last backward's final order ([Note: step
        order learned from backward] in offload/step_seam.py); the runner applies it (the
        streamed step's changes drain it once; state updated in place has no order)."""
        if not self.order.learn(seen):
            return
        try:
            changed = self.runner.set_order(self.order.keys)
        except Exception as exc:
            # the step has been applied (and counted): a failure the runner settles while
            # it drains is logged, not raised into step()'s bookkeeping; its data is kept
            # by a cache or refused wherever read ([Note: a lost write] in offload/core.py).
            # The runner keeps its old order, which the next speculation sets again.
            log.warning("after the optimizer step, applying the step order failed: %s", exc)
            return
        if changed:
            log.debug("optimizer step order follows backward: %s ... %s", seen[:2], seen[-2:])
