"""The gather/release scheduler: what the module and autograd hooks delegate to.

Per training micro-step:
  forward   root gathered by the engine; each block unit gathered by its
            pre-hook, released by its post-hook (unless persistent), and
            given a pre-backward hook on its outputs;
  backward  a unit is re-gathered when the first gradient reaches its
            outputs; once every trainable parameter of the unit has its
            `.grad`, the gradients are reduce-scattered into the fp32 shard
            and the unit is released; `end_backward` reduces what is left,
            reduces again the groups that got late gradients ([Note: late
            gradients] in late_grads.py) and releases everything that is not
            persistent.

[Note: reduction order] With several ranks every reduction is a collective,
so all ranks must reduce the same groups in the same order. Early reductions
follow autograd's completion order, identical on every rank when the ranks
run the same graph (as in DDP and DeepSpeed, control flow must not differ
across ranks within a step); the end-of-backward pass reduces every group
not yet reduced in fixed unit order, including groups without gradients,
then the groups that had late gradients, in the same fixed order.

[Note: unit order trace] The order of unit forwards in the first micro-step
is recorded; every later forward is checked against it and, on a change
(dynamic control flow), logged and re-recorded. Correctness never depends
on the trace; the prefetch queue (offload/) is driven by it: each forward
hands the tier manager the order of the coming param fetches.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tierzero.engine.boundary import BoundaryStats
from tierzero.engine.collectives import Comm, PendingReduce
from tierzero.engine.grad_sums import GradSums
from tierzero.engine.hooks import output_tensors, register_pre_backward
from tierzero.engine.host_heap import HeapTrim
from tierzero.engine.late_grads import LateGrads
from tierzero.engine.reuse import KeepRule, step_uses
from tierzero.engine.shards.flat import (
    FlatGroup,
    reduce_flat_grad,
    reduce_group_grads,
    settle_group,
)
from tierzero.engine.shards.lent import MAX_LENT_UNITS
from tierzero.engine.shards.spares import GatherSpares
from tierzero.engine.shards.store import ShardStore
from tierzero.engine.unit import Unit
from tierzero.offload.step_seam import StepDriver, transition
from tierzero.swap import trace

if TYPE_CHECKING:
    from tierzero.engine.layer_major import LayerMajorPass

log = logging.getLogger(__name__)


class PassState(enum.Enum):
    """Which pass the scheduler is in; the transitions are `PASS_TRANSITIONS`."""

    IDLE = enum.auto()  # between passes
    FORWARD = enum.auto()  # begin_forward .. end_forward (or abort)
    BACKWARD = enum.auto()  # begin_backward .. end_backward (or abort); forwards inside it
    # are recomputations (activation checkpointing), not new passes


PASS_TRANSITIONS: dict[PassState, frozenset[PassState]] = {
    PassState.IDLE: frozenset({PassState.FORWARD, PassState.BACKWARD}),
    PassState.FORWARD: frozenset({PassState.IDLE}),
    PassState.BACKWARD: frozenset({PassState.IDLE}),
}


class Scheduler:
    def __init__(self, units: list[Unit], comm: Comm, store: ShardStore, *,
                 overlap_comm: bool, inflight_reduce_bytes: int,
                 max_live_bytes: int = 0, max_reuse_distance_bytes: int = 0,
                 spares: GatherSpares | None = None) -> None:
        self.units = units
        # the units' released gather buffers, held only inside a pass: [Note: gather buffers
        # kept for the next gather] in shards/spares.py (None: none kept)
        self.spares = spares
        self.comm = comm
        self.store = store
        self._keep = KeepRule(max_live_bytes, max_reuse_distance_bytes)  # [Note: reuse
        # distance] in reuse.py
        self._trim = HeapTrim(64 << 20, "step")
        self.kept = 0  # forwards after which a unit stayed gathered for its backward
        # Gradient reductions run asynchronously behind backward (overlap_comm); their
        # buffers (the full fp32 gradient of a group) stay alive until waited, so the
        # bytes in flight are bounded (zero.reduce_bucket_bytes): before a reduction
        # starts, the oldest are waited for until it fits. One reduction is always
        # allowed, whatever its size.
        self._overlap = overlap_comm
        self._inflight_bound = inflight_reduce_bytes
        self._inflight: deque[PendingReduce] = deque()
        self.inflight_peak = 0  # most reductions in flight at once (overlap evidence)
        self.trace: list[int] | None = None  # unit indices in forward order, first micro-step
        self.trace_changes = 0
        self._order: list[int] = []
        self.state = PassState.IDLE  # checked transitions: PASS_TRANSITIONS
        self._backward_hooks: list[torch.utils.hooks.RemovableHandle] = []
        # The optimizer-step driver ([Note: the optimizer-step seam] in
        # offload/step_seam.py), subscribed once: told of the groups whose gradient shards
        # are final (reduced, and waited for) while it listens, so it can start on them
        # while backward goes on ([Note: streamed optimizer step], [Note: in-place early
        # step]); its update deferred into the next forward is waited for per unit before
        # the unit is gathered ([Note: deferred step]). None: nobody listens.
        self._driver: StepDriver | None = None
        self.late = LateGrads()  # [Note: late gradients]
        # Trainable group keys in the order their gradients turned final in the last
        # complete backward (each at its last reduction: a late-gradient group where it
        # was reduced again); the engine's optimizer stream follows it ([Note: step order
        # learned from backward] in offload/step_seam.py).
        self.final_order: list[str] = []
        self._finals: dict[str, None] = {}
        # Trainable groups reduced more than once in this backward (late gradients): a
        # measurement taken at their first reduction is stale ([Note: deferred step]).
        self.reissued: set[str] = set()
        self.update_wait_s = 0.0  # seconds gathers waited for those updates (cumulative)
        self.gathers = 0  # unit gathers issued (for tests and the memory report)
        # gathers that viewed the store's buffer, the most units viewing at once, and the
        # groups copied out of it to stay gathered ([Note: a gather viewing the pool's
        # buffer] in shards/lent.py)
        self.lent_gathers = 0
        self.lent_peak = 0
        self.lent_copies = 0
        # seconds the training thread spent gathering units (forward and backward, NVMe
        # reads, copies and collectives included): the "wait" of `tierzero train`
        self.gather_s = 0.0
        self.gathered_peak_bytes = 0
        # [Note: layer-major schedule] in layer_major.py: the pass in progress, and per
        # trainable group its gradient summed in fp32 over the pass's micro-batches
        self.layer_major: LayerMajorPass | None = None
        self.sums = GradSums(units)
        self.boundary_stats = BoundaryStats()  # where they waited ([Note: boundary tensors])

    def subscribe(self, driver: StepDriver) -> None:
        """The optimizer-step driver listens from now on (once, when the engine is built).
        A late gradient on a group handed over is an error only where the driver updates
        it then; where it only measures, the group is measured again ([Note: deferred
        step])."""
        if self._driver is not None:
            raise RuntimeError("Scheduler.subscribe: an optimizer-step driver is subscribed "
                               "already; the engine chooses one when it is built")
        self._driver = driver
        self.late.strict = driver.updates_in_backward

    # -- residency -------------------------------------------------------------
    def wait_updates(self, unit: Unit | None = None) -> None:
        """The deferred optimizer update of `unit`'s groups (None: of every group) has run."""
        driver = self._driver
        if driver is None or not driver.defers:
            return
        start = time.perf_counter()
        if unit is None:
            driver.drain()
        else:
            driver.wait_groups([g.key for g in unit.groups if g.trainable])
        self.update_wait_s += time.perf_counter() - start

    def forward_keys(self) -> list[str]:
        """Trainable group keys in the order the next forward gathers them: the root's,
        then the units of the recorded trace, then any unit the trace does not hold."""
        by_index = {u.index: u for u in self.units}
        root = [u for u in self.units if u.is_root]
        traced = [by_index[i] for i in dict.fromkeys(self.trace or []) if i in by_index]
        return list(dict.fromkeys(g.key for u in [*root, *traced, *self.units]
                                  for g in u.groups if g.trainable))

    def ensure_gathered(self, unit: Unit) -> None:
        self.wait_updates(unit)  # before the shard is read, and before its old copy is used
        if unit.current:
            return
        start = time.perf_counter()
        # inside a pass, a unit released as its backward ends may view the store's buffer
        # ([Note: a gather viewing the pool's buffer] in shards/lent.py)
        lend = (self.state is not PassState.IDLE and unit.lendable
                and sum(u.lent for u in self.units) < MAX_LENT_UNITS)
        with trace.span("gather", unit.label):
            unit.gather(self.comm, self.store, lend=lend)
        self.gather_s += time.perf_counter() - start
        self.gathers += 1
        if unit.lent:
            self.lent_gathers += 1
            self.lent_peak = max(self.lent_peak, sum(u.lent for u in self.units))
        self.gathered_peak_bytes = max(self.gathered_peak_bytes, self.gathered_bytes())

    def release(self, unit: Unit) -> None:
        if unit.persistent or not unit.gathered_bytes():
            return
        with trace.span("release", unit.label):
            nbytes = unit.release()
        if self.state is PassState.IDLE:  # a release between passes (GatheredParameters)
            self.clear_spares()
        self._heap_freed(unit, nbytes)

    def _heap_freed(self, unit: Unit, nbytes: int) -> None:
        """Gathered buffers and gradients freed in host memory (the compute device is the
        CPU) go back to the system as the step goes ([Note: returning freed host memory]
        in engine/host_heap.py): glibc would keep them resident, beyond every budget."""
        if unit.groups and unit.groups[0].full.device.type == "cpu":
            self._trim.freed(nbytes)

    # -- forward ---------------------------------------------------------------
    def _to(self, new: PassState, call: str) -> None:
        self.state = self._allowed(new, call)
        if new is PassState.IDLE:
            self.clear_spares()

    def clear_spares(self) -> None:
        """Free the gather buffers kept for the next gather: a pass ended, nothing it
        released is held beyond it ([Note: gather buffers kept for the next gather])."""
        if self.spares is not None:
            self.spares.clear()

    def _allowed(self, new: PassState, call: str) -> PassState:
        return transition("the scheduler", PASS_TRANSITIONS, self.state, new, call=call,
                          fix="forward and backward passes run one at a time, each to its end "
                          "(eng(...) returns before eng.backward(loss) is called)")

    def begin_forward(self, root: Unit) -> None:
        new = self._allowed(PassState.FORWARD, "begin_forward()")  # before anything changes
        self._order = []
        self.late.begin_forward()
        self._prefetch_from_trace(root)
        self.ensure_gathered(root)
        self.state = new  # a failed gather above leaves the scheduler idle

    def _prefetch_from_trace(self, root: Unit) -> None:
        """Hand the shard store this step's param uses, in order, from the recorded trace:
        root, each non-persistent unit's forward, then the same units in reverse for
        backward. The tier manager starts NVMe reads and host->device copies within its
        byte windows (zero.prefetch_bytes) ahead of each use ([Note: unit order trace])."""
        if self.trace is None or not self.store.prefetches:
            return
        self.store.set_order(step_uses(self.units, self.trace, root, self._keep))

    def pre_forward(self, unit: Unit, args: tuple[Any, ...] = (),
                    kwargs: dict[str, Any] | None = None) -> None:
        if self.state is not PassState.BACKWARD:
            lm = self.layer_major
            # a layer-major pass waits here for every micro-batch to reach the unit; the
            # trace follows micro-batch 0 ([Note: layer-major schedule])
            leader = lm.before_unit(unit, args, kwargs or {}) if lm is not None else True
            if leader:
                self._order.append(unit.index)
            self.late.unit_forward()
        self.ensure_gathered(unit)

    def after_forward(self, unit: Unit, output: Any) -> Any:
        """The unit post-hook: what `post_forward` does; in a layer-major pass the output
        is cut from the unit's graph (returned in its place), and the unit is released
        after the last micro-batch."""
        lm = self.layer_major
        if lm is None or self.state is PassState.BACKWARD:
            self.post_forward(unit, output_tensors(output))
            return None
        cut, last = lm.after_unit(unit, output)
        if last:
            self._release_or_keep(unit)
        return cut

    def post_forward(self, unit: Unit, tensors: list[torch.Tensor]) -> None:
        if self.state is PassState.BACKWARD:
            return  # recomputation inside backward: the unit's backward still needs it
        needs_grad = [t for t in tensors if t.requires_grad]
        if needs_grad and torch.is_grad_enabled():
            self._backward_hooks.append(register_pre_backward(needs_grad, self, unit))
            self._release_or_keep(unit)
            return
        self.release(unit)

    def _release_or_keep(self, unit: Unit) -> None:
        """After the forward of a unit whose backward follows: release it, unless its
        backward comes soon enough to keep it gathered ([Note: reuse distance])."""
        if self._keep.keeps(unit, self.gathered_bytes()):
            self.kept += 1
            return
        self.release(unit)

    def end_forward(self, root: Unit, grad_enabled: bool) -> None:
        self._to(PassState.IDLE, "end_forward()")
        order = self._order
        if self.trace is None:
            self.trace = order
        elif order != self.trace:
            self.trace_changes += 1
            pairs = enumerate(zip(order, self.trace, strict=False))
            first = next((i for i, (a, b) in pairs if a != b), min(len(order), len(self.trace)))
            log.info("unit order changed at position %d (recorded %d units, now %d); "
                     "re-recording the trace", first, len(self.trace), len(order))
            self.trace = order
            self._keep.learn(self.units, order)
            self.late.retraced()
        if not self._keep.distance and self.trace:
            self._keep.learn(self.units, self.trace)
        if not grad_enabled:
            for unit in self.units:  # no backward will follow this forward
                self.release(unit)

    # -- backward --------------------------------------------------------------
    def begin_backward(self) -> None:
        self._to(PassState.BACKWARD, "begin_backward()")
        self._finals = {}
        self.reissued.clear()

    def pre_backward(self, unit: Unit) -> None:
        self.ensure_gathered(unit)
        trace.begin("compute", unit.label, phase="backward")  # ends when its grads reduce

    def post_accumulate(self, unit: Unit, param: nn.Parameter) -> None:
        if self.layer_major is not None:
            if unit.late_group(param) is not None:  # its sum would never reach the shard
                raise RuntimeError(
                    f"internal: a layer-major pass got a gradient of a parameter of "
                    f"{unit.label!r} after its group was reduced ([Note: layer-major "
                    "schedule]); the step is abandoned rather than run without it")
            self.sums.fold(unit, param)
            return
        late = unit.late_group(param)
        if late is not None:
            self.late.arrive(unit, late, param)  # [Note: late gradients]
            return
        complete = unit.fire(param)
        if unit.has_frozen or unit.dynamic or unit.reduced:
            return  # units with frozen params or a leaf module wait for end_backward
        if unit.is_root:
            self._reduce_root_groups(unit)
            return
        if complete:
            trace.end("compute", unit.label)
            with trace.span("reduce", unit.label, groups=_trainable_keys(unit.groups)):
                self._reduce(unit, release_lent=True)
            self.release(unit)

    def reduce_unit(self, unit: Unit) -> None:
        """A layer-major pass is done with `unit`: reduce its trainable groups' sums into
        their shards (once per step) and release it."""
        rest = unit.unreduced(trainable_only=True)
        if rest:
            with trace.span("reduce", unit.label, groups=_trainable_keys(rest)):
                self._reduce(unit, rest, release_lent=True)
        self.release(unit)

    def reduce_root_groups_but(self, reached: set[int]) -> None:
        """Layer-major, as backward begins: reduce each root group summed so far none of
        whose parameters `reached` (ids) names, i.e. none gets a gradient in backward:
        its fp32 sum is complete and need not be held ([Note: layer-major schedule])."""
        for root in (u for u in self.units if u.is_root):
            done = [g for g in root.groups if g.key in self.sums
                    and not any(id(s.param) in reached for s in g.slots)]
            if done:
                with trace.span("reduce", root.label, groups=_trainable_keys(done)):
                    self._reduce(root, done)

    def drop_sums(self) -> None:
        """Forget the fp32 sums of an abandoned layer-major pass."""
        self.sums.clear()
        for unit in self.units:
            for p in unit.trainable:
                p.grad = None

    def _reduce_root_groups(self, root: Unit) -> None:
        """The root stays gathered through backward, but each of its groups (the engine
        cuts a large root into pieces: head, embedding, ...) is final once every parameter
        in it has its gradient: reduce that group then, so the optimizer step begun during
        backward can take it while backward goes on (the head's gradient is among the
        first of backward, the embedding's the last)."""
        ready = root.groups_complete()
        if ready:
            with trace.span("reduce", root.label, groups=_trainable_keys(ready)):
                self._reduce(root, ready)

    def end_backward(self) -> None:
        """Reduce every group not yet reduced (fixed order), release, reset per-pass state."""
        try:
            for unit in self.units:
                if unit.trainable and not unit.reduced:
                    trace.end("compute", unit.label)
                    rest = unit.unreduced()
                    with trace.span("reduce", unit.label, groups=_trainable_keys(rest)):
                        self._reduce(unit, rest)
            for unit, groups in self.late.take(self.units):  # [Note: late gradients]
                with trace.span("reduce", unit.label, groups=_trainable_keys(groups),
                                late=True):
                    for g in groups:
                        self._issue(g)
            self.wait_reductions()
            self.final_order = list(self._finals)
            for unit in self.units:
                self.release(unit)
                unit.reset_for_pass()
        finally:
            self.late.end_backward()
            for h in self._backward_hooks:
                h.remove()
            self._backward_hooks.clear()
            self._to(PassState.IDLE, "end_backward()")

    def abort(self) -> None:
        """A forward failed: release and forget this pass, with no collective (the other
        ranks may not have failed) and no gradients touched. From any state."""
        for h in self._backward_hooks:
            h.remove()
        self._backward_hooks.clear()
        self.state = PassState.IDLE
        self.wait_reductions()  # already issued on every rank: complete them
        self.late.reset()
        for unit in self.units:
            self.release(unit)
            unit.reset_for_pass()
        self.clear_spares()

    def _reduce(self, unit: Unit, groups: list[FlatGroup] | None = None, *,
                release_lent: bool = False) -> None:
        """Reduce `groups` of `unit` (default: all), then tell the listening driver.
        `release_lent`: the caller releases `unit` next; a unit viewing a store's buffer
        is released before the driver hears of its groups instead."""
        groups = unit.groups if groups is None else groups
        for g in groups:
            self._issue(g)
        self._heap_freed(unit, sum(g.numel * g.full.element_size() for g in groups))  # .grad
        unit.mark_reduced(groups)
        if release_lent and unit.lent:
            # the driver may update the shard the unit views now ([Note: a gather viewing
            # the pool's buffer]); released, its update reads the buffer as a cache
            self.release(unit)
        if self._driver is not None and self._driver.listening:
            final = self.late.hand_over(groups)  # not those that may get late gradients
            if final:
                self._settle(final)  # viewing a store's buffer, staying gathered: a copy
                self.wait_reductions()  # the shard holds the reduced gradient after wait()
                self._driver.groups_final([g.key for g in final])

    def _settle(self, groups: list[FlatGroup]) -> None:
        """Groups viewing a store's buffer get their own copies (settle_group)."""
        for g in groups:
            if g.lent_from is not None:
                settle_group(g)
                self.lent_copies += 1

    def _issue(self, g: FlatGroup) -> None:
        """Start reducing `g`'s gradients into its shard, within the in-flight bound."""
        if not g.trainable:
            return
        if g.key in self._finals:  # reduced again: final where it is last
            self.reissued.add(g.key)
            del self._finals[g.key]
        self._finals[g.key] = None
        need = (g.padded_numel + g.shard_numel) * 4  # fp32 input + output buffers
        while self._inflight and (
                sum(p.nbytes for p in self._inflight) + need > self._inflight_bound):
            self._inflight.popleft().wait()
        summed = self.sums.pop(g.key)  # layer-major: the pass's fp32 sum
        pending = (reduce_group_grads(g, self.comm, self.store) if summed is None
                   else reduce_flat_grad(g, summed, self.comm, self.store))
        if pending is None:
            return
        if not self._overlap:
            pending.wait()
            return
        self._inflight.append(pending)
        self.inflight_peak = max(self.inflight_peak, len(self._inflight))

    def wait_reductions(self) -> None:
        """Every gradient reduction started so far has landed in its shard."""
        while self._inflight:
            self._inflight.popleft().wait()

    # -- step ------------------------------------------------------------------
    # [Note: persistent units after the step]
    # A unit that stays gathered between steps (every unit at stage 1 and 2, a stage-3 unit
    # under zero.persistence_threshold_bytes) holds a full copy of its parameters, and the
    # optimizer step changes only the shards. Any read of that copy before the unit's own
    # forward pre-hook would see pre-step values with no error: user code between steps
    # (an EMA, parameter norms, model.state_dict()), or a parent module reading a block's
    # weight before calling the block. So every shard change that every rank makes at the
    # same point (the optimizer step, a skipped step that had begun updating during
    # backward, load_checkpoint) ends with `after_step`: gathered copies are gathered
    # again at once (a collective, as in DeepSpeed, which all-gathers its persistent
    # parameters after the step). The gathers move from the next forward to the step's end;
    # there are no more of them. A change one rank makes on its own (load_pretrained) calls
    # `drop_stale` instead: the stale copies are released locally, so a read before the next
    # forward sees a released (size-0) parameter, never an old value.
    def after_step(self) -> None:
        """Shards changed on every rank: gathered copies are gathered again now (a
        collective: every rank calls it at the same point)."""
        self.mark_stale()
        self.refresh()

    def mark_stale(self) -> None:
        """Shards changed: every gathered copy predates them."""
        for unit in self.units:
            unit.mark_stale()

    def refresh(self) -> None:
        """Gather every stale unit again, in unit order (a collective)."""
        for unit in self.units:
            if unit.stale:
                self.ensure_gathered(unit)

    def drop_stale(self) -> None:
        """Release every stale gathered copy, persistent or not (local, no collective); the
        next forward gathers them ([Note: persistent units after the step])."""
        for unit in self.units:
            if unit.stale:
                with trace.span("release", unit.label):
                    unit.drop()
        self.clear_spares()  # between passes: nothing kept

    def gathered_bytes(self) -> int:
        return sum(u.gathered_bytes() for u in self.units)


def _trainable_keys(groups: list[FlatGroup]) -> list[str]:
    """The keys a "reduce" trace span carries (the dry run counts their bytes)."""
    return [g.key for g in groups if g.trainable]
