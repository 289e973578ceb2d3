"""Layer-major micro-batching: every micro-batch of an optimizer step through each unit
while it is gathered, its gradient summed in fp32 while it stays gathered.

[Note: layer-major schedule]
With gradient accumulation k, the micro-step schedule (`eng(mb); eng.backward(loss);
eng.step()` k times) gathers every unit 2k times and, with the gradient homed below the
device, moves the fp32 gradient shard across its tier on every micro-step. The
layer-major schedule (`eng.train_batch(micro_batches, loss_fn)`) runs the same k
micro-batches so that each unit is gathered once for forward and once for backward:

  forward   Each micro-batch's forward runs on a thread of its own (the model code
            stays unchanged), and one thread runs at a time: at every unit's forward
            pre-hook the running thread hands the turn to the next micro-batch, in
            micro-batch order (`_Baton`). So micro-batch 0 reaches unit u, then 1, ...,
            then k-1; then each in turn runs unit u while it is gathered once, and the
            last one's post-hook releases it. A unit's output tensors that need a
            gradient are cut from its graph: the post-hook returns detached leaves in
            their place, and the unit's own activations are freed at once. What stays
            for backward, per unit call and micro-batch, is only the unit's inputs (the
            previous leaves), its output leaves and the RNG state it ran with
            (`_Call`). Each micro-batch's loss is computed on its thread and its
            backward runs at once down to the last unit's output leaves (the head's
            activations never pile up over micro-batches).
  backward  On the training thread, the recorded unit calls in reverse order: for each,
            every micro-batch in order recomputes the unit from its saved inputs (same
            RNG state, same autocast) and backpropagates its output leaves' gradients,
            which fills the previous units' leaves and each trainable parameter's
            `.grad`. The scheduler folds each `.grad` into the group's fp32 accumulator
            (`GradSums.fold`, engine/grad_sums.py) and clears it; after the unit's last
            call the accumulator is reduced across ranks into the gradient shard once
            (`reduce_flat_grad`) and the unit is released. The root's groups reduce at
            the end of backward as in the micro-step schedule.

Results equal k micro-steps of ordinary accumulation: each micro-batch's gradient is
computed by the same operations, each loss scaled by 1/k (and the fp16 loss scale)
as `backward()` does, and summed in fp32 in micro-batch order. With one rank each
untied parameter's sum is the micro-step sum bit for bit; with several ranks the sum is
reduced once instead of once per micro-batch, and a weight used in two places (tied
embeddings) has its two parts summed in fp32 instead of the compute dtype: both differ
from the micro-step result by fp32 summation order only. Dropout draws from the global
generator in layer-major order, so its masks differ from a micro-step run's (each mask
is recomputed exactly in backward).

When a model cannot run layer-major, the pass stops before any gradient reaches a
shard, the generator is put back where the step began, and the engine runs the same
micro-batches in the micro-step schedule from then on, with one log line naming the
reason (`LayerMajorFallback`):
  - a tensor computed inside a unit outlives the unit's forward (a KV cache, recorded
    router logits or hidden states kept by a hook): its gradient could not reach the
    unit. Detected with saved-tensor hooks: what the unit's graph saved must be freed
    once its outputs are cut. (Hugging Face models get `use_cache=False` when the call
    does not set it.)
  - a unit runs with gradients off inside a forward with gradients on (reentrant
    activation checkpointing around it): layer-major already recomputes each unit.
  - a micro-batch runs another unit order than micro-batch 0 (data-dependent control
    flow), or a unit returns a tensor that needs a gradient inside a container that
    cannot be rebuilt.
Under ZeRO-3 with several ranks every rank must run the same unit order per micro-batch
(as in the micro-step schedule, [Note: reduction order] in schedule.py), so every rank
meets the same fallback at the same unit, before any collective differs.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tierzero.engine.boundary import BoundaryStore
from tierzero.engine.host_heap import release_free_heap
from tierzero.engine.replay import RngState, autocast, autocast_state, rng_as
from tierzero.engine.shards.tier_config import grad_home, offload_wanted
from tierzero.swap import trace

if TYPE_CHECKING:
    from tierzero.engine.config import Config
    from tierzero.engine.schedule import Scheduler
    from tierzero.engine.unit import Unit

_END = -1  # the label of a micro-batch's arrival at the end of its forward


def train_schedule(config: Config, grad_accum: int) -> str:
    """`batch.schedule` resolved: auto is layer_major when a step accumulates several
    micro-batches and parameters or gradients live below the device (where each extra
    gather or gradient round trip crosses a slower tier), else micro_step."""
    chosen = config.batch.schedule
    if chosen != "auto":
        return chosen
    if grad_accum <= 1 or not offload_wanted(config):
        return "micro_step"
    params = config.offload.params.device if config.zero.stage == 3 else "none"
    below = params != "none" or grad_home(config) != "none"
    return "layer_major" if below else "micro_step"


class LayerMajorFallback(Exception):
    """This model cannot run the layer-major schedule; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Aborted(BaseException):
    """Raised in a waiting micro-batch thread when another one failed: unwinds its forward
    (a BaseException so that the model's own `except Exception` does not swallow it)."""


class _Saved:
    """Stands in for a tensor a unit's forward graph saved for backward, and is freed with
    that graph. It holds no tensor: the forward graph of a unit is never backpropagated
    (its outputs are cut), so nothing it saved is kept, and no reference cycle forms
    through a saved output (a node saving its own output would hold itself)."""

    __slots__ = ("__weakref__",)


def _unpack(_saved: _Saved) -> torch.Tensor:
    raise RuntimeError("internal: the forward graph of a unit in a layer-major pass was "
                       "backpropagated; its outputs should have been cut ([Note: "
                       "layer-major schedule])")


@dataclass
class _Call:
    """One unit call of one micro-batch, kept from its forward to its backward."""

    unit: Unit
    args: tuple[Any, ...]  # as the model passed them (graphs back to earlier leaves)
    kwargs: dict[str, Any]
    rng: RngState
    autocast: tuple[bool, torch.dtype]
    leaves: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (flat index, leaf)
    saved: list[weakref.ref[_Saved]] = field(default_factory=list)
    hooks: Any = None  # the saved-tensor hooks open during the unit's forward


class _Baton:
    """Micro-batch threads of which exactly one runs at a time, handing the turn on in
    micro-batch order (cyclic, over the threads still running)."""

    def __init__(self, n: int) -> None:
        self._cv = threading.Condition()
        self._turn = 0
        self.live = list(range(n))
        self.error: BaseException | None = None

    def _next(self, j: int) -> int:
        after = [i for i in self.live if i > j]
        return after[0] if after else self.live[0]

    def wait(self, j: int) -> None:
        with self._cv:
            while self._turn != j and self.error is None:
                self._cv.wait()
            if self.error is not None:
                raise _Aborted

    def hand_on(self, j: int) -> None:
        """Thread j gives the turn to the next micro-batch and waits for its own again."""
        with self._cv:
            self._turn = self._next(j)
            self._cv.notify_all()
        self.wait(j)

    def abort(self, error: BaseException) -> None:
        """Every waiting thread raises _Aborted when it wakes (the running one at its next
        hand-on)."""
        with self._cv:
            if self.error is None:
                self.error = error
            self._cv.notify_all()

    def leave(self, j: int, error: BaseException | None = None) -> None:
        with self._cv:
            if error is not None and self.error is None:
                self.error = error
            nxt = self._next(j) if len(self.live) > 1 else -1
            self.live.remove(j)
            self._turn = nxt
            self._cv.notify_all()


def _leaves_reached(outputs: list[torch.Tensor]) -> set[int]:
    """ids of the leaf tensors whose AccumulateGrad the graphs of `outputs` reach (a
    unit's parameters, a root parameter used in or before the unit).

    A graph node's Python object lives only while something refers to it (`next_functions`
    makes one when none is alive), and a freed object's id is reused by the next one made:
    the walk keeps every node it visited, else a node met for the first time could carry a
    visited node's id and be skipped with everything behind it, and a root group that
    waits for backward reduced before its gradient came."""
    seen: dict[int, object] = {}  # id -> the node, held so that no id is reused
    out: set[int] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        var = getattr(node, "variable", None)  # an AccumulateGrad node
        if isinstance(var, torch.Tensor):
            out.add(id(var))
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return out


def _glue_hooks(store: BoundaryStore) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks for a micro-batch thread outside its units: a tensor the glue
    between units saves is read in backward, so a boundary leaf among them stays put."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        store.saved_by_glue(t)
        # a detached alias: the saved values without the tensor object, so an op that saves
        # its own output forms no reference cycle through its graph
        return t.detach()

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


class LayerMajorPass:
    """One optimizer step's micro-batches through the model layer-major ([Note:
    layer-major schedule]): `forward` on micro-batch threads, then `backward` here."""

    def __init__(self, scheduler: Scheduler, n: int, device: torch.device,
                 boundary: BoundaryStore | None = None,
                 compute_mode: Callable[[], contextlib.AbstractContextManager[object]]
                 = contextlib.nullcontext) -> None:
        """compute_mode: entered on each micro-batch thread around its forward and loss
        backward (the engine's, [Note: low-precision matmul on CPU]: modes are per thread)."""
        self.scheduler = scheduler
        self.compute_mode = compute_mode
        self.n = n
        self.device = device
        # where the unit-boundary leaves wait for backward ([Note: boundary tensors] in
        # boundary.py); None: where they were made
        self.boundary = boundary
        self._baton = _Baton(n)
        self._local = threading.local()  # .index: the micro-batch this thread runs
        self._labels: list[int] = []  # per round: the unit index micro-batch 0 reached
        self._arrivals = [0] * n  # rounds each micro-batch has reached
        self._calls: list[list[_Call | None]] = []  # [round][micro-batch]
        self._last: list[_Call | None] = [None] * n  # each micro-batch's last unit call
        self.grad_enabled = torch.is_grad_enabled()
        # ids of the leaves (parameters) a unit call's graph reaches: their gradients arrive
        # in backward; the root's other groups are final when the forward ends
        self._reached: set[int] = set()

    # -- on the micro-batch threads (from the scheduler's hooks) ----------------------
    def in_pass(self) -> bool:
        """The calling thread runs one of this pass's micro-batches."""
        return getattr(self._local, "index", None) is not None

    def before_unit(self, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Unit pre-hook: wait for every micro-batch to reach `unit`, then record the call.
        Returns whether this is micro-batch 0 (the one whose unit order is the trace)."""
        j = self._local.index
        self._arrive(j, unit.index, unit.label)
        call = _Call(unit, args, dict(kwargs), RngState.capture(self.device),
                     autocast_state(self.device))
        r = self._arrivals[j] - 1
        self._calls[r][j] = call
        self._last[j] = call

        def pack(_t: torch.Tensor) -> _Saved:
            saved = _Saved()
            call.saved.append(weakref.ref(saved))
            return saved

        call.hooks = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        call.hooks.__enter__()
        return bool(j == 0)

    def after_unit(self, unit: Unit, output: Any) -> tuple[Any, bool]:
        """Unit post-hook: cut the output tensors that need a gradient from the unit's
        graph. Returns (the output to hand on, or None to keep it; whether this was the
        last micro-batch through this call)."""
        j = self._local.index
        call = self._last[j]
        if call is None or call.unit is not unit:
            raise LayerMajorFallback(f"unit {unit.label!r} ended a forward it did not begin")
        call.hooks.__exit__(None, None, None)
        call.hooks = None
        if self.grad_enabled and not torch.is_grad_enabled():
            raise LayerMajorFallback(
                f"unit {unit.label!r} runs with gradients off inside a forward with "
                "gradients on (activation checkpointing around it, e.g. "
                "gradient_checkpointing_enable() with use_reentrant=True); layer_major "
                "recomputes each unit itself: turn the model's checkpointing off to use it")
        flat, spec = tree_flatten(output)
        self._reached.update(_leaves_reached(
            [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]))
        new = list(flat)
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                leaf = t.detach().requires_grad_()
                new[i] = leaf
                call.leaves.append((i, leaf))
                if self.boundary is not None:
                    self.boundary.track(leaf)
        last = j == max(self._baton.live)
        return (tree_unflatten(new, spec) if call.leaves else None), last

    def _arrive(self, j: int, label: int, name: str) -> None:
        """Micro-batch j reached `label` (a unit's index, or _END): check it against
        micro-batch 0's order and its last unit's graph, then wait for its turn."""
        self._check_freed(j)
        done = self._last[j]
        if self.boundary is not None and done is not None:
            # j's last unit call has run: its inputs wait only for backward now
            self.boundary.consumed(done.args, done.kwargs)
        r = self._arrivals[j]
        self._arrivals[j] += 1
        if r == len(self._labels):
            self._labels.append(label)
            self._calls.append([None] * self.n)
        elif self._labels[r] != label:
            raise LayerMajorFallback(
                f"micro-batch {j} reached {name!r} where micro-batch 0 reached "
                f"{self._label_name(self._labels[r])!r} (its unit order differs: "
                "data-dependent control flow)")
        if label != _END:
            self._baton.hand_on(j)

    def _label_name(self, label: int) -> str:
        if label == _END:
            return "the end of its forward"
        return next(u.label for u in self.scheduler.units if u.index == label)

    def _check_freed(self, j: int) -> None:
        call = self._last[j]
        if call is None:
            return
        alive = sum(1 for ref in call.saved if ref() is not None)
        call.saved.clear()
        if alive:
            raise LayerMajorFallback(
                f"unit {call.unit.label!r} keeps {alive} tensor(s) of its forward graph "
                "alive after it returned (something outside the unit holds a tensor "
                "computed inside it, e.g. a KV cache, recorded router logits or hidden "
                "states, or an output inside a container that cannot be rebuilt); "
                "layer_major recomputes each unit in backward and could not send "
                "gradients through them")

    # -- on the training thread --------------------------------------------------------
    def forward(self, micro_batches: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor],
                scale: float) -> list[torch.Tensor]:
        """Run every micro-batch's forward and loss on its own thread, layer-major, and
        each loss's backward (times `scale`) down to the last unit's output leaves.
        Returns the detached losses. Raises what a micro-batch thread raised (its
        LayerMajorFallback included) after every thread has ended."""
        losses: list[torch.Tensor | None] = [None] * self.n
        grad = torch.is_grad_enabled()
        autocasts = {t: autocast_state(torch.device(t)) for t in ("cpu", "cuda")}

        def run(j: int) -> None:
            try:
                if self.device.type == "cuda":  # the current device is per thread
                    torch.cuda.set_device(self.device)
                self._baton.wait(j)
                self._local.index = j
                with contextlib.ExitStack() as stack:
                    stack.enter_context(torch.set_grad_enabled(grad))
                    stack.enter_context(self.compute_mode())
                    if self.boundary is not None:  # what glue between units saves stays put
                        stack.enter_context(_glue_hooks(self.boundary))
                    for dev, state in autocasts.items():
                        stack.enter_context(autocast(torch.device(dev), state))
                    loss = loss_fn(micro_batches[j])
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise ValueError("train_batch: loss_fn must return a scalar loss "
                                         f"tensor; got {type(loss).__name__}")
                    self._arrive(j, _END, "the end of its forward")
                    if loss.requires_grad:
                        (loss.float() * scale).backward()  # type: ignore[no-untyped-call]
                    losses[j] = loss.detach()
                self._baton.leave(j)
            except _Aborted:
                self._baton.leave(j)
            except BaseException as exc:  # handed to the training thread below
                self._baton.leave(j, exc)
            finally:
                self._local.index = None

        threads = [threading.Thread(target=run, args=(j,), name=f"tierzero-microbatch-{j}",
                                    daemon=True) for j in range(self.n)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException as exc:  # KeyboardInterrupt on this thread: stop them first
            self._baton.abort(exc)
            for t in threads:
                t.join()
            raise
        if self.device.type == "cpu":
            # each micro-batch thread allocated in a malloc arena of its own; what it freed
            # there the training thread cannot reuse: hand it back ([Note: returning freed
            # host memory] in engine/host_heap.py)
            release_free_heap("a layer-major forward")
        if self._baton.error is not None:
            raise self._baton.error
        if self.boundary is not None:
            self.boundary.forward_done()
            held = self.boundary.stats.held_peak_bytes
        else:
            held = sum(leaf.nbytes for calls in self._calls for c in calls if c is not None
                       for _, leaf in c.leaves)
        self.scheduler.sums.boundary_held(held)
        return [x for x in losses if x is not None]

    def backward(self) -> None:
        """Every recorded unit call in reverse order, each micro-batch in order; a unit's
        gradient is reduced after its last call ([Note: layer-major schedule])."""
        units = {u.index: u for u in self.scheduler.units}
        # the root's groups the tails alone fed (a head) are reduced now, not held in fp32
        # through backward
        self.scheduler.reduce_root_groups_but(self._reached)
        rounds = [r for r, label in enumerate(self._labels) if label != _END]
        remaining = Counter(self._labels[r] for r in rounds)
        order = list(reversed(rounds))
        for at, r in enumerate(order):
            unit = units[self._labels[r]]
            if self.boundary is not None and at + 1 < len(order):
                # the next round's parked inputs come back while this one runs
                self.boundary.prefetch((c.args, c.kwargs) for c in self._calls[order[at + 1]]
                                       if c is not None)
            with trace.span("compute", unit.label, phase="backward"):
                for j in range(self.n):
                    call = self._calls[r][j]
                    self._calls[r][j] = None
                    if call is not None:
                        if self.boundary is not None:
                            self.boundary.restore(call.args, call.kwargs)
                        self._backward_call(call)
            remaining[unit.index] -= 1
            if remaining[unit.index] == 0:
                self.scheduler.reduce_unit(unit)
        self._calls.clear()

    def close(self) -> None:
        """The pass ended, finished or failed: the boundary store's swap keys deleted."""
        if self.boundary is not None:
            self.boundary.close()

    def _backward_call(self, call: _Call) -> None:
        """Recompute the call's unit and backpropagate its output leaves' gradients."""
        pairs = [(i, leaf.grad) for i, leaf in call.leaves if leaf.grad is not None]
        if self.boundary is not None:  # the leaves' last use
            self.boundary.done(leaf for _, leaf in call.leaves)
        call.leaves.clear()
        if not pairs:
            return
        with rng_as(call.rng, self.device), torch.enable_grad(), \
                autocast(self.device, call.autocast):
            out = call.unit.module(*call.args, **call.kwargs)
        flat, _ = tree_flatten(out)
        outs = [flat[i] for i, _ in pairs]
        grads = [g for _, g in pairs]
        # glue between units (a tensor several units read) may be traversed again by an
        # earlier unit's call: keep it; everything is freed with the pass
        torch.autograd.backward(outs, grads, retain_graph=True)
