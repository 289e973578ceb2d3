"""ZeroEngine: the training API over partitioned units (forward, backward, step).

Composition happens in `ZeroEngine.__init__`, in order: ranks, units, flat shards in the
shard store, scheduler, hooks, optimizer, lr schedule, loss scaler.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from tierzero.engine import batch, report
from tierzero.engine.access import AccessGuard, register_owner, unregister_owner
from tierzero.engine.activations import HostActivations, HostActivationStats
from tierzero.engine.checkpoint import load as checkpoint_load
from tierzero.engine.checkpoint import save as checkpoint
from tierzero.engine.checkpoint.background import BackgroundSaver, PendingSave
from tierzero.engine.checkpoint.layout import CheckpointError
from tierzero.engine.collectives import Comm
from tierzero.engine.config import Config
from tierzero.engine.cpu_matmul import LowPrecisionMatmul, upcast_matmul
from tierzero.engine.hooks import HookSet
from tierzero.engine.host_defaults import engine_device, gather_bounds
from tierzero.engine.host_heap import release_free_heap
from tierzero.engine.layer_major import train_schedule
from tierzero.engine.schedule import Scheduler
from tierzero.engine.shards.flat import held_shard
from tierzero.engine.shards.grad_precision import grad_dtype
from tierzero.engine.shards.store import ShardStore
from tierzero.engine.shards.tier_config import offload_wanted
from tierzero.engine.shards.tiered import TieredShardStore
from tierzero.engine.step.device import DeviceStep, OptimizerFactory, build_optimizer
from tierzero.engine.step.lr_schedules import build_scheduler
from tierzero.engine.step.offloaded import offloaded_step
from tierzero.engine.step.precision import LossScaler, compute_dtype, global_grad_norm, grad_stat
from tierzero.engine.unit_build import UnitBuilder, unit_specs
from tierzero.engine.wall_clock import WallClock
from tierzero.offload.step_seam import GradMeasure, StepDriver

log = logging.getLogger(__name__)


# The step counters a checkpoint saves and restores (counters_state / load_counters).
COUNTERS = ("micro_steps", "global_steps", "skipped_steps", "last_grad_norm")


class ZeroEngine:
    """Trains `module` with parameters, gradients and optimizer state partitioned over ranks."""

    def __init__(self, module: nn.Module, config: Config,
                 optimizer_factory: OptimizerFactory, comm: Comm | None = None,
                 device: torch.device | None = None, *, host_compute: bool | None = None) -> None:
        """host_compute: TieredShardStore's (a dry run on meta planning CUDA says False)."""
        self.module = module
        self.comm = comm or Comm()
        # Batch sizes resolved for this world size (ConfigError when they do not fit).
        self.config = config.check_world_size(self.comm.world_size)
        self.device = engine_device(device)
        self.dtype = compute_dtype(config.precision.dtype)
        # bf16/fp16 products in fp32 where the CPU's native kernel is the scalar fallback
        # ([Note: low-precision matmul on CPU])
        self.upcast_matmul = upcast_matmul(config.precision.cpu_matmul, self.device, self.dtype)
        if self.upcast_matmul and self.comm.rank == 0:
            log.info("precision.cpu_matmul %s: %s matrix products computed in fp32 and rounded "
                     "once%s", config.precision.cpu_matmul, str(self.dtype).removeprefix("torch."),
                     " (torch has no fast native kernel for them on this CPU)"
                     if config.precision.cpu_matmul == "auto" else "")
        self.grad_accum = self.config.batch.gradient_accumulation_steps or 1
        specs = unit_specs(module, config.zero, self.comm)
        self._move_buffers()
        # Plain device-resident shards, or the tier manager when anything is offloaded, chosen
        # once ([Note: shard residency] in shards/store.py); fp32 gradient shards, or the
        # compute dtype's where exact ([Note: gradient precision])
        grads = grad_dtype(self.config, self.comm.world_size)
        tiered = (TieredShardStore(self.device, self.config, grads, rank=self.comm.rank,
                                   world_size=self.comm.world_size, host_compute=host_compute)
                  if offload_wanted(self.config) else None)
        self.store: ShardStore = ShardStore(self.device, grads) if tiered is None else tiered
        builder = UnitBuilder.for_specs(specs, dtype=self.dtype, comm=self.comm,
                                        store=self.store, device=self.device,
                                        zero=self.config.zero)
        builder.declare_groups(specs)
        # each unit's module tensors (or Init slices) are freed once its shards are placed:
        # back to the system before the next ([Note: returning freed host memory])
        self.units = []
        for i, spec in enumerate(specs):
            self.units.append(builder.build_unit(i, spec))
            release_free_heap("placement")
        self.root = self.units[-1]
        self.comm.know([g.key for u in self.units for g in u.groups])
        # [Note: CPU compute defaults]: unset gather bounds sized to the compute device
        max_live, max_reuse = gather_bounds(config.zero, self.device, self.units)
        self.scheduler = Scheduler(self.units, self.comm, self.store,
                                   overlap_comm=config.zero.overlap_comm,
                                   inflight_reduce_bytes=config.zero.reduce_bucket_bytes,
                                   max_live_bytes=max_live, max_reuse_distance_bytes=max_reuse,
                                   spares=builder.spares)
        for unit in self.units:
            for g in unit.groups:
                for s in g.slots:
                    register_owner(s.param, self.scheduler, unit, s.qname, s.numel)
        self._hooks = HookSet(self.scheduler)
        # Units that stay gathered are gathered now, so a read before their first forward
        # (user code, a parent module) sees their values ([Note: persistent units after the
        # step] in schedule.py). A collective, in unit order on every rank.
        for unit in self.units:
            if unit.persistent:
                self.scheduler.ensure_gathered(unit)
        self._train_groups = [g for u in self.units for g in u.groups if g.trainable]
        self._train_keys = [g.key for g in self._train_groups]
        self._train_by_key = {g.key: g for g in self._train_groups}
        # The optimizer the user sees (lr schedule, param groups) and the driver the engine
        # steps it through, chosen once ([Note: the optimizer-step seam]).
        self.optimizer, self.step_driver = self._build_step(optimizer_factory, tiered)
        self.lr_scheduler = build_scheduler(self.optimizer, config.scheduler)
        self.loss_scaler = (LossScaler(config.precision.loss_scale)
                            if self.dtype == torch.float16 else None)
        self.micro_steps = 0
        # module.state_dict() between steps sees whole steps (a persistent unit's
        # parameters may view the shards a deferred update writes)
        self._state_dict_hook = module.register_state_dict_pre_hook(  # type: ignore[no-untyped-call]
            lambda *_: self.settle_optimizer())
        self._init_run(module)

    def _init_run(self, module: nn.Module) -> None:
        """Per-run state beside the step: step counters, the last gradient norm, wall-clock
        log, background saver, host activations, the schedule train_batch runs."""
        self.global_steps = 0
        self.skipped_steps = 0
        self.optimizer_step_s = 0.0  # cumulative seconds in step() called by train_batch
        self.nonfinite_steps_in_row = 0  # optimizer steps skipped for a non-finite grad norm
        self.last_grad_norm: float | None = None  # get_global_grad_norm()
        self.last_clip_coef: float | None = None  # get_clip_coef()
        config = self.config
        # logging.wall_clock_breakdown: per-step phase times logged by rank 0
        self.wall = WallClock(enabled=self.config.logging.wall_clock_breakdown,
                              every=self.config.logging.steps_per_print,
                              rank=self.comm.rank, counters=lambda: report.wall_counters(self))
        self._saver = BackgroundSaver(self.comm.world_size)
        # activations.cpu_offload: saved activations wait in host memory
        self.activation_stats = HostActivationStats()
        self._host_activations = (config.activations.cpu_offload
                                  and self.device.type == "cuda")
        if config.activations.cpu_offload and not self._host_activations:
            log.info("activations.cpu_offload: the device is %s, whose memory is "
                     "host memory already; saved activations stay where they are (no-op)",
                     self.device)
        # [Note: layer-major schedule] in layer_major.py: how train_batch runs a step
        self.schedule = train_schedule(self.config, self.grad_accum)
        # a Hugging Face model builds a KV cache unless told not to ([Note: layer-major
        # schedule]: the cache would keep every unit's graph alive)
        self._takes_use_cache = batch.takes_use_cache(module)
        self._closed = False

    def _build_step(self, factory: OptimizerFactory, tiered: TieredShardStore | None
                    ) -> tuple[torch.optim.Optimizer, StepDriver]:
        """The CPU Adam when the optimizer state is offloaded (its update may begin during
        backward), else the factory's optimizer over device-resident shards."""
        if tiered is not None and tiered.optimizer_offloaded:
            adam, driver = offloaded_step(
                tiered, self._train_keys, [[g.key for g in u.groups] for u in self.units[:-1]],
                [g.key for g in self.root.groups], self.config.optimizer,
                world_size=self.comm.world_size,
                overlap=self.config.offload.optimizer.overlap_step,
                fp16=self.dtype == torch.float16, clipping=self.config.gradient_clipping > 0,
                speculate=self.config.offload.optimizer.speculate_step,
                held=self._held_param)
            self.scheduler.subscribe(driver)
            return adam, driver
        opt = build_optimizer(factory, self.store, self._train_keys)
        return opt, DeviceStep(opt, self.store, self._train_keys)

    def _held_param(self, key: str) -> torch.Tensor | None:
        """Group `key`'s param shard as its gathered buffer holds it now, if that is a copy
        of the shard as it is ([Note: a param held in host memory] in
        offload/shard_inputs.py)."""
        return held_shard(self._train_by_key[key], self.comm.rank,
                          self.store.version(key, "param"))

    # -- construction -------------------------------------------------------------
    def _move_buffers(self) -> None:
        for mod in self.module.modules():
            for name, buf in list(mod.named_buffers(recurse=False)):
                if buf.device != self.device:
                    setattr(mod, name, buf.to(self.device))  # stays a buffer, persistent or not

    # -- training API -------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward with its own signature. Tensor inputs move to the
        engine's device; floating ones are cast to the compute dtype."""
        self._check_open()
        with self.wall.phase("forward"):
            return self._forward(args, kwargs)

    def _forward(self, args: Any, kwargs: Any) -> Any:
        lm = self.scheduler.layer_major
        if lm is not None and lm.in_pass():  # a micro-batch of train_batch's pass
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
            if self._takes_use_cache and "use_cache" not in kwargs:
                kwargs["use_cache"] = False  # a KV cache would keep each unit's graph
            with AccessGuard(), self.compute_mode():
                return self.module(*args, **kwargs)
        self.step_driver.before_use()  # [Note: speculated step]: forward reads the params
        # a deferred update goes on: each unit waits for its own ([Note: deferred step])
        self.settle_optimizer(deferred=False)
        args, kwargs = tree_map(self._cast_input, (args, kwargs))
        grad_enabled = torch.is_grad_enabled()
        self.scheduler.begin_forward(self.root)
        try:
            with AccessGuard(), self.compute_mode(), self._activation_hooks():
                out = self.module(*args, **kwargs)
        except BaseException:
            self.scheduler.abort()  # release everything; no backward will follow
            raise
        self.scheduler.end_forward(self.root, grad_enabled)
        return out

    def compute_mode(self) -> contextlib.AbstractContextManager[object]:
        """Entered wherever the engine runs the model or its backward (recomputation
        included): the matrix products in fp32 where `upcast_matmul`."""
        if not self.upcast_matmul or LowPrecisionMatmul.active():
            return contextlib.nullcontext()
        return LowPrecisionMatmul(self.dtype)

    def _activation_hooks(self) -> contextlib.AbstractContextManager[object]:
        if not self._host_activations:
            return contextlib.nullcontext()
        return HostActivations(self.activation_stats, pin_memory=True)

    def _cast_input(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        dtype = self.dtype if x.is_floating_point() else x.dtype
        return x.to(device=self.device, dtype=dtype, non_blocking=True)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` / gradient_accumulation_steps (times the fp16 loss scale);
        gradients land, averaged over ranks, in this rank's gradient shards."""
        self._check_open()
        if loss.numel() != 1:
            raise ValueError(f"backward() needs a scalar loss; got shape {tuple(loss.shape)}")
        with self.wall.phase("backward"):
            self._backward(loss)

    def _backward(self, loss: torch.Tensor) -> None:
        scale = 1.0 / self.grad_accum
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        self.settle_optimizer()  # reductions write gradient shards a deferred update reads
        # the driver first: a begin it refuses (TrainingStateError) leaves no pass open
        self.step_driver.begin(boundary=self.is_gradient_accumulation_boundary(),
                               unscale=self.grad_unscale())
        self.scheduler.begin_backward()
        ok = False
        try:
            with self.compute_mode():
                (loss.float() * scale).backward()  # type: ignore[no-untyped-call]
            ok = True
        finally:
            if not ok:
                self.step_driver.abandon()
            try:
                self.scheduler.end_backward()
            except BaseException:
                self.step_driver.abandon()
                raise

    def grad_unscale(self) -> float:
        """The factor step() unscales the gradients by if nothing overflows (1.0 without
        fp16 loss scaling): computed as _step computes it."""
        return 1.0 if self.loss_scaler is None else 1.0 / self.loss_scaler.scale

    def train_batch(self, micro_batches: Sequence[Any],
                    loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
                    check_losses: Callable[[list[torch.Tensor]], None] | None = None,
                    on_phase: Callable[[str], None] | None = None) -> list[torch.Tensor]:
        """One optimizer step over `micro_batches` (gradient_accumulation_steps of them):
        `loss_fn(mb)` calls `eng(...)` on a micro-batch and returns its scalar loss
        (default: `eng(**mb).loss` for a mapping, `eng(mb)` otherwise). Each loss is
        scaled as `backward()` scales it. With `batch.schedule: layer_major` every unit is
        gathered once for forward and once for backward ([Note: layer-major schedule]);
        else it is `eng(mb); eng.backward(loss); eng.step()` per micro-batch.
        `check_losses(losses)` may raise before any of their gradients reach a shard;
        `on_phase(name)` is called as each "forward", "backward" and "optimizer" phase
        ends (per micro-batch in micro_step; once each in layer_major), for whoever
        counts per phase (tierzero plan's dry run). Returns the detached losses."""
        self._check_open()
        return batch.train_batch(self, micro_batches, loss_fn, check_losses=check_losses,
                                 on_phase=on_phase)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum == 0

    def step(self) -> None:
        """Call once per micro-step; the optimizer runs every gradient_accumulation_steps."""
        self._check_open()
        boundary = self.is_gradient_accumulation_boundary()
        with self.wall.phase("step"):
            self._step(boundary)
        if boundary:
            self.wall.step_done()

    def _step(self, boundary: bool) -> None:
        self.micro_steps += 1
        if not boundary:
            return
        if self.step_driver.take_abandoned():  # see OffloadedStep.abandon
            self.last_grad_norm = self.last_clip_coef = None
            self.skipped_steps += 1
            self.zero_grad()
            # some groups were updated before the step was abandoned
            self.scheduler.after_step()  # [Note: persistent units after the step]
            return
        # a deferred update may still read a gradient shard that zero_grad() marked and
        # this step's readers zero ([Note: gradients zeroed on first use] in shards/store.py)
        self.settle_optimizer()
        stats = self._grad_stats()
        unscale = 1.0
        if self.loss_scaler is not None:
            overflow = not all(st.finite for st in stats.values())
            flag = torch.tensor([1.0 if overflow else 0.0], device=self.device)
            self.comm.all_reduce_sum(flag, "the fp16 overflow flag")
            if flag.item() > 0:
                self.loss_scaler.update(overflow=True)
                self.last_grad_norm = self.last_clip_coef = None  # no norm of this step
                self.skipped_steps += 1
                self.zero_grad()
                return
            unscale = self.grad_unscale()
            self.loss_scaler.update(overflow=False)
        coef = self._clip(unscale, stats)
        if self.last_grad_norm is not None and not math.isfinite(self.last_grad_norm):
            # A NaN/inf gradient would make every parameter it reaches NaN: skip the step
            # as an fp16 overflow does; the caller decides when too many in a row is fatal.
            self.nonfinite_steps_in_row += 1
            self.skipped_steps += 1
            self.last_clip_coef = None
            log.warning("gradient norm is %s at optimizer step %d: step skipped (%d in a row)",
                        self.last_grad_norm, self.global_steps + 1, self.nonfinite_steps_in_row)
            self.zero_grad()
            return
        self.nonfinite_steps_in_row = 0
        self.step_driver.finish(unscale * coef, next_forward=self.scheduler.forward_keys(),
                                seen=self.scheduler.final_order)
        self.lr_scheduler.step()
        self.zero_grad()  # also waits for any optimizer thread (settle)
        self.scheduler.after_step()  # [Note: persistent units after the step] in schedule.py
        self.global_steps += 1

    def _grad_stats(self) -> Mapping[str, GradMeasure]:
        """Per trainable group, its gradient's norm and finiteness ([Note: the gradient norm
        on every step]): measured during backward where the gradients are touched (the
        worker, [Note: deferred step]; the streamed step, [Note: gradients measured where
        they are reduced]) or here, one pass over gradient shards in memory."""
        measured = self.step_driver.grad_stats(self.scheduler.reissued)
        if measured is not None:
            return measured
        return {k: grad_stat(self.store, k) for k in self._train_keys}

    def _clip(self, unscale: float, stats: Mapping[str, GradMeasure]) -> float:
        """Global L2 norm of the (unscaled) gradients over every shard on every rank, before
        clipping; sets `last_grad_norm` and `last_clip_coef` and returns the factor that
        brings the norm down to gradient_clipping (1.0 with clipping off)."""
        if self.device.type == "meta":  # a dry run: the measurements carry no values
            self.last_grad_norm = self.last_clip_coef = None
            return 1.0
        norm = global_grad_norm(stats, self._train_keys, self.comm, self.device) * unscale
        self.last_grad_norm = norm
        limit = self.config.gradient_clipping
        # same rule as torch's clip_grad_norm_ (which applies it only below 1)
        coef = min(1.0, limit / (norm + 1e-6)) if limit > 0 else 1.0
        self.last_clip_coef = coef
        return coef

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the gradients of the last optimizer step, before clipping
        and unscaled (as Hugging Face's Trainer logs `grad_norm`; DeepSpeed's name). None
        before the first step and after an fp16 overflow skipped one; NaN or inf when a
        non-finite gradient skipped it."""
        return self.last_grad_norm

    def get_clip_coef(self) -> float | None:
        """The factor gradient clipping applied to the last step's gradients (1.0: none;
        also with gradient_clipping 0); None when no step has been taken or it was
        skipped."""
        return self.last_clip_coef

    def settle_optimizer(self, *, deferred: bool = True) -> None:
        """No optimizer thread is writing a shard after this ([Note: in-place early step]);
        with `deferred` False, an update deferred into the next forward goes on ([Note:
        deferred step]: each unit waits for its groups before it is gathered)."""
        self.step_driver.settle(deferred=deferred)

    def zero_grad(self) -> None:
        """Gradients to zero: the fp32 shards are marked, not written ([Note: gradients
        zeroed on first use] in engine/shards/store.py). A deferred update may go on
        reading them: the mark changes no byte of a shard."""
        self.settle_optimizer(deferred=False)
        self.step_driver.gradients_zeroed()  # measured gradients are gone: step() measures zeros
        self.store.mark_grads_zeroed(self._train_keys)
        for u in self.units:
            for p in u.trainable:
                p.grad = None

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    def counters_state(self) -> dict[str, Any]:
        """The step counters a checkpoint keeps (COUNTERS), as JSON values."""
        return {c: getattr(self, c) for c in COUNTERS}

    def load_counters(self, state: Mapping[str, Any]) -> None:
        """Resume the counters saved by counters_state(); a name it does not keep raises."""
        if unknown := sorted(set(state) - set(COUNTERS)):
            raise CheckpointError(f"the checkpoint's engine counters {unknown} are not "
                                  f"kept by this engine (it keeps {list(COUNTERS)})")
        for c, v in state.items():
            setattr(self, c, v)

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def optimizer_times(self) -> report.OptimizerTimes:
        """Cumulative seconds of the optimizer beside compute (see OptimizerTimes)."""
        worker, hidden = self.step_driver.worker_times()
        return report.OptimizerTimes(hidden, worker, self.scheduler.update_wait_s)

    def memory_report(self) -> dict[str, Any]:
        """Bytes on this rank, from element counts: shards by kind, gathered params now and
        at peak, and what the unpartitioned model would hold (engine/report.py)."""
        return report.memory_report(self)

    # -- checkpoints (engine/checkpoint*.py) ---------------------------------------
    def save_checkpoint(self, directory: str | Path, tag: str | None = None,
                        client_state: Any = None, *,
                        background: bool = False,
                        allow_partial_step: bool = False) -> Path | PendingSave:
        """Save every rank's shards and state to `directory/tag` and point `latest` at it.
        `background`: record the state now, write it while training goes on ([Note:
        background save] in engine/checkpoint/background.py); the PendingSave's `stats`
        say how long this call held the caller (SaveStats). After an optimizer update
        failed partway the save is refused (CheckpointError) until a checkpoint is loaded,
        unless `allow_partial_step` ([Note: a partial step] in engine/step/offloaded.py)."""
        start = time.perf_counter()
        self._check_open()
        self._check_checkpointable("save_checkpoint", deferred=not background)
        partial = self.step_driver.partial_step
        if partial is not None:
            if not allow_partial_step:
                raise CheckpointError(
                    f"save_checkpoint refused: {partial}; the optimizer state holds that "
                    "step's update in the parameter groups it reached and not in the rest, "
                    "which a resume would not continue as any run. Load a checkpoint "
                    "(load_checkpoint) to go on from a whole step, or pass "
                    "save_checkpoint(..., allow_partial_step=True) to save this state as is")
            log.warning("saving a partial optimizer step on purpose (allow_partial_step): %s",
                        partial)
        settled = time.perf_counter()
        self._saver.wait()
        out = checkpoint.save_checkpoint(self, directory, tag, client_state,
                                         background=self._saver if background else None)
        if isinstance(out, PendingSave):
            out.stats.started = time.perf_counter()
            out.stats.held_s = out.stats.started - start
            out.stats.settle_s += settled - start
        return out

    def load_checkpoint(self, directory: str | Path, tag: str | None = None,
                        *, verify: bool = True) -> tuple[Path, Any]:
        """Resume from `directory/tag` (default `latest`); returns (path, client_state)."""
        self._check_open()
        self._check_checkpointable("load_checkpoint")
        self._saver.wait()
        return checkpoint_load.load_checkpoint(self, directory, tag, verify=verify)

    def quiesce(self, what: str) -> None:
        """Before reading every shard as one consistent state (an export, a consolidation):
        the engine is open, no optimizer step is half done, a background save has ended and
        no optimizer thread writes a shard. `what` names the caller in errors."""
        self._check_open()
        self._check_checkpointable(what)
        self._saver.wait()
        self.settle_optimizer()
        if self.step_driver.partial_step is not None:  # [Note: a partial step]
            log.warning("%s of a partial optimizer step: %s", what,
                        self.step_driver.partial_step)

    def _check_checkpointable(self, what: str, *, deferred: bool = True) -> None:
        self.step_driver.before_use()  # a speculated update is undone ([Note: speculated step])
        # deferred updates end first (False: a background save reads each group as it lands)
        self.settle_optimizer(deferred=deferred)
        if what == "load_checkpoint":
            self.step_driver.gradients_zeroed()  # the gradients measured in backward are replaced
        if self.step_driver.step_open:
            raise CheckpointError(
                f"{what} between backward() and step(): the optimizer step begun during "
                "backward (offload.optimizer.overlap_step) has updated some units and not "
                "others; call eng.step() first")

    # -- lifecycle ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine is closed; build a new one with engine.initialize()")

    def close(self, *, restore_params: bool = True) -> None:
        """Remove hooks and leave every parameter gathered (usable as a plain module); idempotent.
        `restore_params=False` leaves them released (size 0): for a process about to exit,
        where the gather would read the model from NVMe or hang in a collective. A background
        save's or deferred update's failure is raised once threads stop and swap files go."""
        if self._closed:
            return
        failure: BaseException | None = None
        for settle in (self._saver.close, self.settle_optimizer):  # a save finishes first
            try:
                settle()
            except BaseException as exc:  # raised below, once everything is closed
                failure, restore_params = failure or exc, False
        for unit in self.units:
            if restore_params:
                self.scheduler.ensure_gathered(unit)
            unit.hand_back(keep_values=restore_params)
            for s in (s for g in unit.groups for s in g.slots):
                unregister_owner(s.param)
        self.scheduler.clear_spares()  # what hand_back released: freed
        self._hooks.close()
        self._state_dict_hook.remove()
        self._closed = True
        with contextlib.ExitStack() as ends:  # each runs, whatever the ones before raise
            ends.callback(self.comm.close)
            ends.callback(self.store.close)  # threads stopped, swap files removed
            self.step_driver.close()  # may raise a write that failed in the update
        if failure is not None:
            raise failure
