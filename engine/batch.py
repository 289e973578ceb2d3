"""`ZeroEngine.train_batch`: one optimizer step over a list of micro-batches.

With `batch.schedule: layer_major` every unit is gathered once for forward and once for
backward over all micro-batches ([Note: layer-major schedule] in layer_major.py); else
(or when the pass falls back) it is `eng(mb); eng.backward(loss); eng.step()` per
micro-batch.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tierzero.engine import boundary
from tierzero.engine.layer_major import LayerMajorFallback, LayerMajorPass
from tierzero.engine.replay import RngState
from tierzero.offload.step_seam import TrainingStateError
from tierzero.swap import trace

if TYPE_CHECKING:
    from tierzero.engine.engine import ZeroEngine

log = logging.getLogger(__name__)


def takes_use_cache(module: nn.Module) -> bool:
    """A Hugging Face model (or a peft wrapper of one) whose forward takes `use_cache`."""
    if not hasattr(getattr(module, "config", None), "use_cache"):
        return False
    params = inspect.signature(module.forward).parameters.values()
    return any(p.name == "use_cache" or p.kind is p.VAR_KEYWORD for p in params)


def train_batch(eng: ZeroEngine, micro_batches: Sequence[Any],
                loss_fn: Callable[[Any], torch.Tensor] | None, *,
                check_losses: Callable[[list[torch.Tensor]], None] | None,
                on_phase: Callable[[str], None] | None) -> list[torch.Tensor]:
    """See ZeroEngine.train_batch."""
    phase = on_phase or (lambda _name: None)
    if len(micro_batches) != eng.grad_accum:
        raise ValueError(f"train_batch: {len(micro_batches)} micro-batches given; the "
                         "step takes batch.gradient_accumulation_steps = "
                         f"{eng.grad_accum}")
    if eng.micro_steps % eng.grad_accum:
        raise TrainingStateError(
            f"train_batch: {eng.micro_steps % eng.grad_accum} micro-step(s) of this "
            "accumulation were run with backward(); finish it with step() first")
    fn = loss_fn or (lambda mb: default_loss(eng, mb))
    if eng.schedule == "layer_major":
        rng = RngState.capture(eng.device)  # CPU and, on a GPU, the device's
        try:
            return _layer_major(eng, micro_batches, fn, check_losses, phase)
        except LayerMajorFallback as exc:
            rng.restore()  # the micro-steps draw what the pass drew
            eng.schedule = "micro_step"
            log.warning("batch.schedule layer_major: %s; running micro_step from now on",
                        exc.reason)
    losses = []
    for i, mb in enumerate(micro_batches):
        with trace.span("forward", f"forward {i}"):
            loss = fn(mb)
        if check_losses is not None:
            check_losses([loss.detach()])
        phase("forward")
        with trace.span("backward", f"backward {i}"):
            eng.backward(loss)
        phase("backward")
        timed_step(eng)
        phase("optimizer")
        losses.append(loss.detach())
    return losses


def timed_step(eng: ZeroEngine) -> None:
    """step(), in a trace span; its seconds are added to `optimizer_step_s` less its unit
    gathers (persistent units gathered again after the update), which the scheduler's
    `gather_s` counts already: the two add up to no more than the step's time."""
    start = time.perf_counter()
    gathers = eng.scheduler.gather_s
    boundary = eng.is_gradient_accumulation_boundary()
    with trace.span("optimizer", "step" if boundary else "accumulate"):
        eng.step()
    eng.optimizer_step_s += time.perf_counter() - start - (eng.scheduler.gather_s - gathers)


def default_loss(eng: ZeroEngine, mb: Any) -> torch.Tensor:
    out = eng(**mb) if isinstance(mb, Mapping) else eng(mb)
    loss = out.loss if hasattr(out, "loss") else out
    if not isinstance(loss, torch.Tensor):
        raise TypeError("train_batch: the model's output has no loss; pass loss_fn")
    return loss


def _layer_major(eng: ZeroEngine, micro_batches: Sequence[Any],
                 fn: Callable[[Any], torch.Tensor],
                 check_losses: Callable[[list[torch.Tensor]], None] | None,
                 phase: Callable[[str], None]) -> list[torch.Tensor]:
    """The layer-major pass and the step ([Note: layer-major schedule])."""
    scale = 1.0 / eng.grad_accum
    if eng.loss_scaler is not None:
        scale *= eng.loss_scaler.scale
    eng.step_driver.before_use()  # [Note: speculated step]: forward reads the params
    eng.settle_optimizer(deferred=False)
    sched = eng.scheduler
    lm = LayerMajorPass(sched, len(micro_batches), eng.device,
                        boundary.store_for(eng, sched.boundary_stats), eng.compute_mode)
    with eng.wall.phase("forward"), trace.span("forward", "forward (layer-major)"):
        sched.begin_forward(eng.root)
        sched.layer_major = lm
        try:
            losses = lm.forward(micro_batches, fn, scale)
            if check_losses is not None:
                check_losses(losses)
        except BaseException:
            sched.layer_major = None
            sched.drop_sums()
            sched.abort()
            lm.close()
            raise
        sched.end_forward(eng.root, True)
    phase("forward")
    with eng.wall.phase("backward"), trace.span("backward", "backward (layer-major)"):
        eng.settle_optimizer()
        eng.micro_steps += len(micro_batches) - 1  # this backward is the boundary
        eng.step_driver.begin(boundary=True, unscale=eng.grad_unscale())
        sched.begin_backward()
        ok = False
        try:
            with eng.compute_mode():  # the units' forwards are recomputed here
                lm.backward()
            ok = True
        finally:
            sched.layer_major = None
            if not ok:
                sched.drop_sums()
                eng.step_driver.abandon()
            lm.close()
            try:
                sched.end_backward()
            except BaseException:
                eng.step_driver.abandon()
                raise
    phase("backward")
    timed_step(eng)
    phase("optimizer")
    return losses
