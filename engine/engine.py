"""ZeroEngine: the training API over partitioned units (forward, backward, step).

Composition happens in `ZeroEngine.__init__`, in order: ranks, units, flat
shards in the shard store, scheduler, hooks, optimizer, lr schedule, loss
scaler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_map

from tierzero.engine import boundary
from tierzero.engine.access import AccessGuard, register_owner, unregister_owner
from tierzero.engine.activations import HostActivations, HostActivationStats
from tierzero.engine.checkpoint import load as checkpoint_load
from tierzero.engine.checkpoint import save as checkpoint
from tierzero.engine.checkpoint.background import BackgroundSaver, PendingSave
from tierzero.engine.checkpoint.layout import CheckpointError
from tierzero.engine.collectives import Comm
from tierzero.engine.config import Config
from tierzero.engine.hooks import HookSet
from tierzero.engine.host_defaults import gather_bounds
from tierzero.engine.host_heap import release_free_heap
from tierzero.engine.layer_major import (
    LayerMajorFallback,
    LayerMajorPass,
    train_schedule,
)
from tierzero.engine.replay import RngState
from tierzero.engine.schedule import Scheduler
from tierzero.engine.shards.flat import (
    FlatGroup,
    build_group,
    release_group,
    shard_numel,
)
from tierzero.engine.shards.grad_precision import grad_dtype
from tierzero.engine.shards.store import ShardStore
from tierzero.engine.shards.tier_config import offload_wanted
from tierzero.engine.shards.tiered import TieredShardStore
from tierzero.engine.step.device import DeviceStep, OptimizerFactory, build_optimizer
from tierzero.engine.step.lr_schedules import build_scheduler
from tierzero.engine.step.offloaded import OffloadedStep, threads_per_rank
from tierzero.engine.step.offloaded_adam import OffloadedAdam
from tierzero.engine.step.precision import LossScaler, compute_dtype, grad_stat
from tierzero.engine.unit import Unit
from tierzero.engine.units import UnitSpec, check_parameters_supported, discover_units
from tierzero.engine.wall_clock import WallClock
from tierzero.offload.step_seam import GradMeasure, StepDriver, StepOrder, TrainingStateError
from tierzero.swap import trace

log = logging.getLogger(__name__)


def _cut(named: list[tuple[str, nn.Parameter]], cap: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive runs of `named` of at most `cap` elements (a larger parameter alone);
    cap 0: one run."""
    runs: list[list[tuple[str, nn.Parameter]]] = [[]]
    size = 0
    for qname, p in named:
        if cap and runs[-1] and size + p.numel() > cap:
            runs.append([])
            size = 0
        runs[-1].append((qname, p))
        size += p.numel()
    return runs


class OptimizerTimes(NamedTuple):
    """Cumulative seconds of the optimizer's work beside the training thread."""

    hidden_s: float  # worker seconds that ran while the training thread computed
    worker_s: float  # every second the optimizer's worker thread ran (hidden or waited for)
    update_wait_s: float  # forward's waits for a unit's deferred update ([Note: deferred step])


def _takes_use_cache(module: nn.Module) -> bool:
    """A Hugging Face model (or a peft wrapper of one) whose forward takes `use_cache`."""
    if not hasattr(getattr(module, "config", None), "use_cache"):
        return False
    params = inspect.signature(module.forward).parameters.values()
    return any(p.name == "use_cache" or p.kind is p.VAR_KEYWORD for p in params)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ZeroEngine:
    """Trains `module` with parameters, gradients and optimizer state partitioned over ranks."""

    def __init__(self, module: nn.Module, config: Config,
                 optimizer_factory: OptimizerFactory, comm: Comm | None = None,
                 device: torch.device | None = None) -> None:
        self.module = module
        self.comm = comm or Comm()
        # Batch sizes resolved for this world size (ConfigError when they do not fit).
        self.config = config.check_world_size(self.comm.world_size)
        self.device = device or _default_device()
        self.dtype = compute_dtype(config.precision.dtype)
        self.grad_accum = self.config.batch.gradient_accumulation_steps or 1
        check_parameters_supported(module)
        specs = discover_units(module, list(config.zero.units) or None,
                               config.zero.unit_min_bytes, list(config.zero.leaf_modules),
                               config.zero.auto_leaf_moe)
        # Validate on every rank before the first collective: a mismatch would hang.
        shape_sig = [len(specs)] + [sum(p.numel() for _, p in s.params) for s in specs]
        if not self.comm.all_equal(shape_sig):
            raise ValueError("ranks built different units (parameter counts per unit "
                             f"{shape_sig} on rank {self.comm.rank}); every rank must build "
                             "the same model with the same zero.units")
        self._move_buffers()
        # Largest block unit (elements): the root's flat groups are cut to this size.
        self._group_cap = max((sum(p.numel() for _, p in s.params) for s in specs
                               if not s.is_root), default=0)
        # Plain device-resident shards, or the tier manager when anything is offloaded:
        # chosen once; afterwards the store says what callers may do ([Note: shard
        # residency] in shards/store.py).
        # fp32 gradient shards, or the compute dtype's where exact ([Note: gradient precision])
        grads = grad_dtype(self.config, self.comm.world_size)
        tiered = (TieredShardStore(self.device, self.config, grads, rank=self.comm.rank)
                  if offload_wanted(self.config) else None)
        self.store: ShardStore = ShardStore(self.device, grads) if tiered is None else tiered
        self._declare_groups(specs)
        # each unit's module tensors (or Init slices) are freed once its shards are placed:
        # back to the system before the next ([Note: returning freed host memory])
        self.units = []
        for i, spec in enumerate(specs):
            self.units.append(self._build_unit(i, spec))
            release_free_heap("placement")
        self.root = self.units[-1]
        self.comm.know([g.key for u in self.units for g in u.groups])
        # [Note: CPU compute defaults]: unset gather bounds sized to the compute device
        max_live, max_reuse = gather_bounds(config, self.device, self.units)
        self.scheduler = Scheduler(self.units, self.comm, self.store,
                                   overlap_comm=config.zero.overlap_comm,
                                   inflight_reduce_bytes=config.zero.reduce_bucket_bytes,
                                   max_live_bytes=max_live, max_reuse_distance_bytes=max_reuse)
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
            lambda *_: self._settle_optimizer())
        self.global_steps = 0
        self.skipped_steps = 0
        self.optimizer_step_s = 0.0  # cumulative seconds in step() called by train_batch
        # logging.wall_clock_breakdown: per-step phase times logged by rank 0
        self._wall = WallClock(enabled=self.config.logging.wall_clock_breakdown,
                               every=self.config.logging.steps_per_print,
                               rank=self.comm.rank, counters=self._wall_counters)
        self.nonfinite_steps_in_row = 0  # optimizer steps skipped for a non-finite grad norm
        self.last_grad_norm: float | None = None  # get_global_grad_norm()
        self.last_clip_coef: float | None = None  # get_clip_coef()
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
        self._takes_use_cache = _takes_use_cache(module)
        self._closed = False

    def _build_step(self, factory: OptimizerFactory, tiered: TieredShardStore | None
                    ) -> tuple[torch.optim.Optimizer, StepDriver]:
        """The CPU Adam when the optimizer state is offloaded (its update may begin during
        backward), else the factory's optimizer over device-resident shards."""
        if tiered is not None and tiered.optimizer_offloaded:
            o = self.config.optimizer
            # [Note: step order learned from backward] in offload/step_seam.py
            order = StepOrder.backward_guess(
                self._train_keys, [[g.key for g in u.groups] for u in self.units[:-1]],
                [g.key for g in self.root.groups])
            adam = OffloadedAdam(self._train_keys, adamw=o.type == "adamw", lr=o.lr,
                                 betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
            driver: StepDriver = OffloadedStep(
                tiered, adam, order, threads=threads_per_rank(self.comm.world_size),
                buffer_bytes=tiered.layout.ring_bytes(),
                overlap=self.config.offload.optimizer.overlap_step,
                fp16=self.dtype == torch.float16, clipping=self.config.gradient_clipping > 0)
            self.scheduler.subscribe(driver)
            return adam, driver
        opt = build_optimizer(factory, self.store, self._train_keys)
        return opt, DeviceStep(opt, self.store, self._train_keys)

    # -- construction -------------------------------------------------------------
    def _move_buffers(self) -> None:
        for mod in self.module.modules():
            for name, buf in mod._buffers.items():
                if buf is not None and buf.device != self.device:
                    mod._buffers[name] = buf.to(self.device)

    def _group_plan(self, spec: UnitSpec) -> list[tuple[str, bool, list[tuple[str, nn.Parameter]]]]:
        """(store key, trainable, named params) of each flat group of a unit.

        The root's groups are cut, at parameter boundaries in module order, into pieces no
        larger than the largest block unit (`_group_cap`): a root of untied embeddings and
        head is often several blocks' worth, and every per-shard buffer (the CPU Adam's
        ring, NVMe staging) is sized by the largest shard. Pieces after the first get a
        "#i" suffix; a root within the cap keeps one group per kind."""
        by_kind: dict[bool, list[tuple[str, nn.Parameter]]] = {}
        for qname, p in spec.params:
            by_kind.setdefault(p.requires_grad, []).append((qname, p))
        label = spec.name or "<root>"
        dtype_name = str(self.dtype).removeprefix("torch.")
        out = []
        for trainable, named in sorted(by_kind.items(), reverse=True):
            key = f"{label}/{dtype_name}/{'trainable' if trainable else 'frozen'}"
            pieces = _cut(named, self._group_cap) if spec.is_root else [named]
            out += [(key if i == 0 else f"{key}#{i}", trainable, piece)
                    for i, piece in enumerate(pieces)]
        return out

    def _declare_groups(self, specs: list[UnitSpec]) -> None:
        """Tell the store every shard before any is created, so placement is planned over
        the whole model and each group's initial values are placed as it is built."""
        for spec in specs:
            for key, trainable, named in self._group_plan(spec):
                numel = shard_numel(sum(p.numel() for _, p in named), self.comm.world_size)
                self.store.declare(key, numel, self.dtype, trainable)
        self.store.finalize()

    def _build_unit(self, index: int, spec: UnitSpec) -> Unit:
        groups: list[FlatGroup] = [
            build_group(key, named, dtype=self.dtype, trainable=trainable, comm=self.comm,
                        store=self.store, device=self.device)
            for key, trainable, named in self._group_plan(spec)
        ]
        nbytes = sum(g.numel for g in groups) * torch.finfo(self.dtype).bits // 8
        # Stage 1/2: every unit, the root included, stays gathered between steps (as their
        # parameters do in DeepSpeed). Stage 3: blocks under the threshold; the root is
        # gathered around each forward and backward.
        persistent = self.config.zero.stage < 3 or (
            not spec.is_root and nbytes < self.config.zero.persistence_threshold_bytes)
        trainable = tuple(p for _, p in spec.params if p.requires_grad)
        return Unit(index, spec.name, spec.module, spec.is_root, persistent, groups,
                    trainable, has_frozen=len(trainable) < len(spec.params),
                    dynamic=spec.dynamic)

    # -- training API -------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward with its own signature. Tensor inputs move to the
        engine's device; floating ones are cast to the compute dtype."""
        self._check_open()
        with self._wall.phase("forward"):
            return self._forward(args, kwargs)

    def _forward(self, args: Any, kwargs: Any) -> Any:
        lm = self.scheduler.layer_major
        if lm is not None and lm.in_pass():  # a micro-batch of train_batch's pass
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
            if self._takes_use_cache and "use_cache" not in kwargs:
                kwargs["use_cache"] = False  # a KV cache would keep each unit's graph
            with AccessGuard():
                return self.module(*args, **kwargs)
        # a deferred update goes on: each unit waits for its own ([Note: deferred step])
        self._settle_optimizer(deferred=False)
        args, kwargs = tree_map(self._cast_input, (args, kwargs))
        grad_enabled = torch.is_grad_enabled()
        self.scheduler.begin_forward(self.root)
        try:
            with AccessGuard(), self._activation_hooks():
                out = self.module(*args, **kwargs)
        except BaseException:
            self.scheduler.abort()  # release everything; no backward will follow
            raise
        self.scheduler.end_forward(self.root, grad_enabled)
        return out

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
        with self._wall.phase("backward"):
            self._backward(loss)

    def _backward(self, loss: torch.Tensor) -> None:
        scale = 1.0 / self.grad_accum
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        self._settle_optimizer()  # reductions write gradient shards a deferred update reads
        # the driver first: a begin it refuses (TrainingStateError) leaves no pass open
        self.step_driver.begin(boundary=self.is_gradient_accumulation_boundary())
        self.scheduler.begin_backward()
        ok = False
        try:
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
        phase = on_phase or (lambda _name: None)
        self._check_open()
        if len(micro_batches) != self.grad_accum:
            raise ValueError(f"train_batch: {len(micro_batches)} micro-batches given; the "
                             "step takes batch.gradient_accumulation_steps = "
                             f"{self.grad_accum}")
        if self.micro_steps % self.grad_accum:
            raise TrainingStateError(
                f"train_batch: {self.micro_steps % self.grad_accum} micro-step(s) of this "
                "accumulation were run with backward(); finish it with step() first")
        fn = loss_fn or self._default_loss
        if self.schedule == "layer_major":
            rng = RngState.capture(self.device)  # CPU and, on a GPU, the device's
            try:
                return self._layer_major(micro_batches, fn, check_losses, phase)
            except LayerMajorFallback as exc:
                rng.restore()  # the micro-steps draw what the pass drew
                self.schedule = "micro_step"
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
                self.backward(loss)
            phase("backward")
            self._timed_step()
            phase("optimizer")
            losses.append(loss.detach())
        return losses

    def _timed_step(self) -> None:
        """step(), its seconds added to `optimizer_step_s`, in a trace span."""
        start = time.perf_counter()
        boundary = self.is_gradient_accumulation_boundary()
        with trace.span("optimizer", "step" if boundary else "accumulate"):
            self.step()
        self.optimizer_step_s += time.perf_counter() - start

    def _default_loss(self, mb: Any) -> torch.Tensor:
        out = self(**mb) if isinstance(mb, Mapping) else self(mb)
        loss = out.loss if hasattr(out, "loss") else out
        if not isinstance(loss, torch.Tensor):
            raise TypeError("train_batch: the model's output has no loss; pass loss_fn")
        return loss

    def _layer_major(self, micro_batches: Sequence[Any], fn: Callable[[Any], torch.Tensor],
                     check_losses: Callable[[list[torch.Tensor]], None] | None,
                     phase: Callable[[str], None]) -> list[torch.Tensor]:
        """The layer-major pass and the step ([Note: layer-major schedule])."""
        scale = 1.0 / self.grad_accum
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        self._settle_optimizer(deferred=False)
        sched = self.scheduler
        lm = LayerMajorPass(sched, len(micro_batches), self.device,
                            boundary.store_for(self, sched.boundary_stats))
        with self._wall.phase("forward"), trace.span("forward", "forward (layer-major)"):
            sched.begin_forward(self.root)
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
            sched.end_forward(self.root, True)
        phase("forward")
        with self._wall.phase("backward"), trace.span("backward", "backward (layer-major)"):
            self._settle_optimizer()
            self.micro_steps += len(micro_batches) - 1  # this backward is the boundary
            self.step_driver.begin(boundary=True)
            sched.begin_backward()
            ok = False
            try:
                lm.backward()
                ok = True
            finally:
                sched.layer_major = None
                if not ok:
                    sched.drop_sums()
                    self.step_driver.abandon()
                lm.close()
                try:
                    sched.end_backward()
                except BaseException:
                    self.step_driver.abandon()
                    raise
        phase("backward")
        self._timed_step()
        phase("optimizer")
        return losses

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum == 0

    def step(self) -> None:
        """Call once per micro-step; the optimizer runs every gradient_accumulation_steps."""
        self._check_open()
        boundary = self.is_gradient_accumulation_boundary()
        with self._wall.phase("step"):
            self._step(boundary)
        if boundary:
            self._wall.step_done()

    def _wall_counters(self) -> dict[str, float]:
        """Cumulative seconds the wall-clock log reports per step (logging.wall_clock_breakdown)."""
        times = self.optimizer_times()
        stall = (self.store.tier_report() or {}).get("stall_s", 0.0)
        return {"gathers": self.scheduler.gather_s, "deferred-update waits": times.update_wait_s,
                "optimizer hidden": times.hidden_s,
                "io stall": float(stall) if isinstance(stall, (int, float)) else 0.0}

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
        self._settle_optimizer()
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
            unscale = 1.0 / self.loss_scaler.scale
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
        # fp32 norm per shard (as torch's clip_grad_norm_ per tensor; no fp64 copy of the
        # shard), squares summed in fp64 in fixed group order (precision.grad_stat)
        total = 0.0
        for k in self._train_keys:
            total += stats[k].sq_norm
        sq = torch.tensor([total], dtype=torch.float64, device=self.device)
        self.comm.all_reduce_sum(sq, "the squared gradient norm")
        norm = math.sqrt(float(sq.item())) * unscale
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

    def _settle_optimizer(self, *, deferred: bool = True) -> None:
        """No optimizer thread is writing a shard after this ([Note: in-place early step]);
        with `deferred` False, an update deferred into the next forward goes on ([Note:
        deferred step]: each unit waits for its groups before it is gathered)."""
        self.step_driver.settle(deferred=deferred)

    def zero_grad(self) -> None:
        """Gradients to zero: the fp32 shards are marked, not written ([Note: gradients
        zeroed on first use] in engine/shards/store.py). A deferred update may go on
        reading them: the mark changes no byte of a shard."""
        self._settle_optimizer(deferred=False)
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

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def optimizer_times(self) -> OptimizerTimes:
        """Cumulative seconds of the optimizer beside compute (see OptimizerTimes)."""
        worker, hidden = self.step_driver.worker_times()
        return OptimizerTimes(hidden, worker, self.scheduler.update_wait_s)

    def memory_report(self) -> dict[str, Any]:
        """Bytes on this rank, from element counts: shards by kind, gathered params now and
        at peak, and what the unpartitioned model would hold."""
        shards = self.store.nbytes()
        full_params = sum(g.numel for u in self.units for g in u.groups) * (
            torch.finfo(self.dtype).bits // 8)
        return {
            "rank": self.comm.rank,
            "world_size": self.comm.world_size,
            "shard_bytes": shards,
            # the gradient shards' dtype ([Note: gradient precision])
            "grad_dtype": str(self.store.grad_dtype).removeprefix("torch."),
            "shard_bytes_total": sum(shards.values()),
            "gathered_bytes": self.scheduler.gathered_bytes(),
            "gathered_peak_bytes": self.scheduler.gathered_peak_bytes,
            "full_model_param_bytes": full_params,
            "units": len(self.units),
            "persistent_units": sum(u.persistent for u in self.units),
            "trace_changes": self.scheduler.trace_changes,
            # gradients that arrived after their group was reduced ([Note: late gradients])
            "late_gradients": self.scheduler.late.arrivals,
            "reductions_in_flight_peak": self.scheduler.inflight_peak,
            "units_kept_for_backward": self.scheduler.kept,  # [Note: reuse distance]
            # fp32 gradient sums of a layer-major pass held at once ([Note: layer-major
            # schedule]): the root's groups and the unit in backward
            "layer_major_accum_peak_bytes": self.scheduler.accum_peak_bytes,
            # where its unit-boundary tensors waited ([Note: boundary tensors])
            "layer_major_boundary": self.scheduler.boundary_stats.as_dict(),
            "loss_scale": self.loss_scaler.scale if self.loss_scaler else None,
            "skipped_steps": self.skipped_steps,
            # offload: the tier manager's bytes per tier, peaks, moved bytes (None: no offload)
            "tiers": self.store.tier_report(),
            "activations_to_host": dataclasses.asdict(self.activation_stats),
            "optimizer_step": self.step_driver.stats(),
        }

    # -- checkpoints (engine/checkpoint*.py) ---------------------------------------
    def save_checkpoint(self, directory: str | Path, tag: str | None = None,
                        client_state: Any = None, *,
                        background: bool = False) -> Path | PendingSave:
        """Save every rank's shards and state to `directory/tag` and point `latest` at it.
        `background`: record the state now, write it while training goes on ([Note:
        background save] in engine/checkpoint/background.py); returns a PendingSave whose
        `stats.held_s` is the time this call held the caller (waiting for an earlier save
        included), `stats.settle_s` the part spent waiting for optimizer work (for a
        deferred update only when the ranks fell back to a synchronous save: it is read as
        it lands, [Note: saving a deferred step] in engine/checkpoint/deferred.py)."""
        start = time.perf_counter()
        self._check_open()
        self._check_checkpointable("save_checkpoint", deferred=not background)
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
        self._settle_optimizer()

    def _check_checkpointable(self, what: str, *, deferred: bool = True) -> None:
        # deferred updates end first (False: a background save reads each group as it lands)
        self._settle_optimizer(deferred=deferred)
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
        """Remove hooks and leave every parameter gathered (usable as a plain module).

        `restore_params=False`: leave every parameter released (size 0; the module is not
        usable afterwards) instead of gathering each unit back from its tier: what a
        process about to exit wants (tierzero train), since with parameters on NVMe the
        gather reads the whole model, and with several ranks it is a collective that a
        rank stopping alone would hang in. Idempotent."""
        if self._closed:
            return
        self._saver.close()  # a background save finishes (or raises) first
        self._settle_optimizer()
        for unit in self.units:
            if restore_params:
                self.scheduler.ensure_gathered(unit)
            for g in unit.groups:
                owned = [s.param.data.clone() if restore_params else None for s in g.slots]
                release_group(g)
                for s, data in zip(g.slots, owned, strict=True):
                    if data is not None:
                        s.param.data = data
                    unregister_owner(s.param)
        self._hooks.close()
        self._state_dict_hook.remove()
        self._closed = True
        self.step_driver.close()
        self.store.close()
        self.comm.close()
