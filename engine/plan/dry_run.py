"""A dry run of the engine's training step on meta tensors: what `tierzero plan` counts.

[Note: plan from the engine] The plan does not model the engine; it runs it.
`dry_run` builds the model on the meta device and hands it to the real
ZeroEngine with device=meta: the same units and flat shards, the same
scheduler and hooks (gather, release, reuse distance, the prefetch order from
the unit trace), the TieredShardStore over the real TierManager (placement,
staging pool, prefetch windows, eviction, write-backs, budgets) and the
OffloadedAdam's pipelined CPU Adam. Only the bottom is replaced: buffers are
meta tensors (nothing is allocated or computed), swap I/O goes to a DrySwap
that counts bytes, and the collectives of a world size this machine does not
have are shape checks (DryComm). So the bytes counted are the bytes the
engine moves, and they follow any change to the engine's schedule.

Counted per optimizer step and phase (forward, backward, optimizer): NVMe bytes
read and written (DrySwap), host<->device bytes the tier manager moved (its
moved counters), gradient bytes the reduce path sends to a host gradient shard
(per "reduce" trace event: shards.flat.reduce_group_grads copies each
parameter's gradient in the compute dtype with one rank, the reduced fp32
shard with several, to the shard's device; a plain tensor copy, not a tier
manager transfer), and CPU Adam elements (the "adam" trace events).
The first step records the unit trace (no prefetch yet) and the first
optimizer step; the plan reports the last, steady-state step.

Differences from a real run, by design: gradient clipping and fp16 loss
scaling read values (a norm, an overflow flag) that meta tensors do not have. The
dry run keeps clipping on (fp16 runs as bf16 with clipping, the same bytes, so that
its update still needs every gradient first) and the engine's clip factor on meta
is 1: the driver takes the step the real run takes. With overlap_step and state on
NVMe that is the update deferred into the next forward, each unit's groups updated
just before its gather, which finds the param the update wrote in host memory
([Note: deferred streamed step] in engine/step/deferred_stream.py). On a dry run
no worker runs it ahead: the training thread updates each group when the gather
waits for it, so the counts do not depend on a thread's timing (the real run's
worker may run a little ahead; at 2.07B the two read the same param bytes within
2 %: benchmarks/RESULTS.md). A run whose clipping does not fire speculates the
update into backward instead and moves fewer bytes (no gradient read back: [Note:
speculated step] in engine/step/speculation.py); the dry run never speculates, so
for such a run it counts the deferred step's bytes, an upper bound.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tierzero.engine.config import Config
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.host_defaults import GPU_GATHER_BYTES
from tierzero.engine.plan.dry_comm import DryComm
from tierzero.engine.plan.host import model_bytes, saved_bytes
from tierzero.engine.shards.tiered import TieredShardStore
from tierzero.engine.step.device import torch_adam_factory
from tierzero.engine.step.streamed import StreamedStep
from tierzero.offload import Plan, TierManager
from tierzero.offload.settings import TIERS, Tier
from tierzero.swap import DrySwap, trace

log = logging.getLogger(__name__)

PHASES = ("forward", "backward", "optimizer")
META = torch.device("meta")


@dataclass(frozen=True)
class Traffic:
    """Bytes moved (and CPU Adam elements) in one phase of a step, on one rank."""

    nvme_read: int = 0
    nvme_written: int = 0
    host_to_device: int = 0  # tier manager copies
    device_to_host: int = 0
    grads_to_host: int = 0  # the reduce path's gradient copies to a host gradient shard
    adam_params: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(a + b for a, b in zip(dataclasses.astuple(self),
                                               dataclasses.astuple(other), strict=True)))

    @property
    def copied(self) -> int:
        return self.host_to_device + self.device_to_host + self.grads_to_host


@dataclass
class DryRun:
    """What the engine did: placement, per-step per-phase traffic, per-tier peaks."""

    placement: Plan | None  # None: nothing offloaded (the engine's plain device store)
    steps: list[dict[str, Traffic]] = field(default_factory=list)
    peak: dict[Tier, int] = field(default_factory=dict)
    units: int = 0
    # [Note: plan host peak] in engine/plan/host.py: what the host prediction adds up
    init_peak: dict[Tier, int] = field(default_factory=dict)  # tier manager, after placement
    init_outside: int = 0  # host buffers outside the tiers already taken at placement
    pipeline_bytes: int = 0  # host buffers outside the tiers (CPU Adam ring), peak
    saved_bytes: int = 0  # tensors autograd saved in one forward (largest micro-batch)
    # elements of the most gradients held at once before their reduction: a block unit's
    # trainable elements (reduced together), or one of the root's trainable groups (each
    # reduced once its own gradients are complete: Scheduler._reduce_root_groups)
    largest_unit: int = 0
    largest_group: int = 0  # elements of the largest flat group (placed one at a time)
    gathered_peak: int = 0  # most gathered parameter bytes at once (root, kept units, one)
    model_bytes: int = 0  # every parameter and buffer of the module as built
    world_size: int = 1
    schedule: str = "micro_step"  # batch.schedule the steps ran ([Note: layer-major schedule])

    def step(self, index: int = -1) -> Traffic:
        """One step's traffic, all phases; default the last (steady state)."""
        total = Traffic()
        for t in self.steps[index].values():
            total = total + t
        return total


class _Counters:
    """Reads the DrySwap and tier manager counters and the trace events recorded into `rec`;
    deltas between phases."""

    def __init__(self, store: TieredShardStore | None, rec: trace.Recorder,
                 grad_bytes: dict[str, int]) -> None:
        self.manager: TierManager | None = store.manager if store is not None else None
        self.swap = store.swap if store is not None else None
        self.rec = rec
        self.grad_bytes = grad_bytes  # grad_bytes_to_host
        self.last = self._read()
        self.mark = len(rec.events)

    def _read(self) -> tuple[int, int, int, int]:
        read = written = h2d = d2h = 0
        if isinstance(self.swap, DrySwap):
            s = self.swap.stats()
            read, written = s.read.bytes, s.write.bytes
        if self.manager is not None:
            moved = self.manager.memory_report().moved
            h2d, d2h = moved.get("host_to_device", 0), moved.get("device_to_host", 0)
        return read, written, h2d, d2h

    def delta(self) -> Traffic:
        """Counters and trace events since the last call."""
        now = self._read()
        d = [a - b for a, b in zip(now, self.last, strict=True)]
        self.last = now
        events = self.rec.events[self.mark:]
        self.mark = len(self.rec.events)
        adam = sum(int(e.get("args", {}).get("numel", 0)) for e in events if e["cat"] == "adam")
        grads = sum(self.grad_bytes.get(str(k), 0) for e in events if e["cat"] == "reduce"
                    for k in e.get("args", {}).get("groups", ()))
        return Traffic(nvme_read=d[0], nvme_written=d[1], host_to_device=d[2],
                       device_to_host=d[3], grads_to_host=grads, adam_params=adam)


def grad_bytes_to_host(eng: ZeroEngine) -> dict[str, int]:
    """Per trainable group key: bytes one reduction of the group copies to its host
    gradient shard (see the Note; none when the gradient shard lives on the device).
    A "reduce" trace span names the groups it reduced (a root's groups are reduced one
    by one as they turn final)."""
    store = eng.store
    out: dict[str, int] = {}
    for u in eng.units:
        for g in u.groups:
            if not (g.trainable and isinstance(store, TieredShardStore)
                    and store.tier_for(g.key, "grad") == "host"):
                continue
            out[g.key] = (g.numel * g.full.element_size() if eng.comm.world_size == 1
                          else g.shard_numel * 4)
    return out


class MetaTruth(TorchFunctionMode):
    """`bool()` of a one-element meta tensor is True: the checks a model's forward makes
    on its inputs' values ("no padding", "no packed sequences": Hugging Face's mask code in
    a training forward without a KV cache, as layer-major runs it) take the branch of the
    plain batch the dry run stands for. Thread-local, as every torch function mode: entered
    around each micro-batch's forward, on whichever thread runs it."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if (func is torch.Tensor.__bool__ and args and isinstance(args[0], torch.Tensor)
                and args[0].is_meta and args[0].numel() == 1):
            return True
        return func(*args, **(kwargs or {}))


def default_micro(eng: ZeroEngine, seq_len: int, batch: int = 1) -> torch.Tensor:
    """One micro-batch of token ids through the model; the loss (a mean, on meta)."""
    x = torch.zeros(batch, seq_len, dtype=torch.long, device=META)  # (B, T)
    with MetaTruth():
        out = eng(input_ids=x)
    logits: torch.Tensor = out.logits if hasattr(out, "logits") else out[0]  # (B, T, V)
    return logits.float().mean()


def dry_config(config: Config, *, device_is_host: bool = True) -> Config:
    """The config a dry run can execute: fp16 as bf16, with clipping on where fp16 had
    none, so that the update still waits for every gradient and the driver takes the
    real run's step (see the Note; on meta the clip factor is 1).
    The engine on meta sizes unset bounds as on a CPU ([Note: CPU compute defaults] in
    engine/host_defaults.py); planning a CUDA machine (`device_is_host` False) they get
    the CUDA defaults."""
    precision = config.precision
    offload = config.offload
    zero = config.zero
    if not device_is_host:
        z = zero
        zero = dataclasses.replace(
            z, max_live_bytes=GPU_GATHER_BYTES if z.max_live_bytes is None else z.max_live_bytes,
            max_reuse_distance_bytes=(GPU_GATHER_BYTES if z.max_reuse_distance_bytes is None
                                      else z.max_reuse_distance_bytes))
    clip = config.gradient_clipping
    if precision.dtype == "fp16":
        precision = dataclasses.replace(precision, dtype="bf16")
        clip = clip or 1.0  # every gradient before the update, as fp16's overflow check
    return dataclasses.replace(config, gradient_clipping=clip, precision=precision,
                               offload=offload, zero=zero)


def dry_run(module: nn.Module, config: Config, *, world_size: int = 1, steps: int = 2,
            seq_len: int = 8, micro_batch: int = 1,
            micro: Callable[[ZeroEngine, int, int], torch.Tensor] = default_micro,
            device_is_host: bool = True) -> DryRun:
    """Run `steps` optimizer steps of the engine on `module` (built on meta) and count.

    `device_is_host`: the planned machine has no CUDA (its compute device is host memory).
    Raises offload.PlanError when the shards do not fit the config's budgets (the
    placement the engine runs at start), as a real run would.
    """
    config = dry_config(config, device_is_host=device_is_host)
    built_bytes = model_bytes(module)  # before the engine re-points the parameters
    eng = _build_engine(module, config, world_size, device_is_host)
    try:
        store = eng.store if isinstance(eng.store, TieredShardStore) else None
        out = _placed(eng, store, built_bytes, world_size)
        accum = config.batch.gradient_accumulation_steps or 1
        rec = trace.Recorder(process="tierzero plan (dry run)")
        counters = _Counters(store, rec, grad_bytes_to_host(eng))
        with trace.recording(rec):
            for _ in range(steps):
                out.steps.append(_one_step(eng, out, counters, accum=accum, micro=functools.partial(
                    micro, eng, seq_len, micro_batch)))
        _record_peaks(eng, store, out)
    finally:
        eng.close()
    return out


def _build_engine(module: nn.Module, config: Config, world_size: int,
                  device_is_host: bool) -> ZeroEngine:
    """The real engine on `module`, on meta, its collectives shape checks for `world_size`
    ranks, its params gathered as on the planned machine ([Note: params gathered from host
    memory] in shards/tiered.py); placement and pool logging (INFO) kept quiet while it
    builds."""
    opt = config.optimizer
    factory = torch_adam_factory(opt.type, opt.lr, opt.betas, opt.eps, opt.weight_decay)
    quiet = logging.getLogger("tierzero.offload")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # placement and pool explain themselves at INFO
    try:
        return ZeroEngine(module, config, factory, comm=DryComm(world_size), device=META,
                          host_compute=device_is_host)
    finally:
        quiet.setLevel(level)


def _placed(eng: ZeroEngine, store: TieredShardStore | None, built_bytes: int,
            world_size: int) -> DryRun:
    """The DryRun of what the engine holds after placement, before the first step."""
    out = DryRun(store.manager.plan if store is not None and store.manager else None,
                 units=len(eng.units), model_bytes=built_bytes, world_size=world_size,
                 largest_unit=max((max((g.numel for g in u.groups if g.trainable), default=0)
                                   if u.is_root else
                                   sum(g.numel for g in u.groups if g.trainable)
                                   for u in eng.units), default=0),
                 largest_group=max((g.numel for u in eng.units for g in u.groups), default=0))
    if store is not None and store.manager is not None:
        init = store.manager.memory_report()
        out.init_peak = {t: int(init.peak.get(t, 0)) for t in TIERS}
        out.init_outside = init.outside_peak
        if store.layout.coarse and init.outside_peak:  # [Note: dry-run pieces]
            out.init_outside = store.layout.pipeline_bytes()
        out.pipeline_bytes = store.layout.pipeline_bytes()  # allocated at the first step
    return out


def _one_step(eng: ZeroEngine, out: DryRun, counters: _Counters, *, accum: int,
              micro: Callable[[], torch.Tensor]) -> dict[str, Traffic]:
    """One optimizer step of `accum` micro-batches; its traffic per phase. Raises
    `out.saved_bytes` to the most this step saved for backward."""
    phases = dict.fromkeys(PHASES, Traffic())
    runner = getattr(eng.step_driver, "runner", None)
    stream = runner.stream if isinstance(runner, StreamedStep) else None

    def loss_fn(_mb: object) -> torch.Tensor:
        with saved_bytes() as saved:  # on this micro-batch's thread
            loss = micro()
        out.saved_bytes = max(out.saved_bytes, saved.nbytes)
        return loss

    def phase_done(name: str) -> None:
        if name == "backward":
            # the in-place step begun during backward runs on a worker: what
            # it was handed during backward counts there, deterministically
            eng.step_driver.settle()
        if stream is not None:
            # the streamed step's read-ahead runs on its own thread: the reads issued
            # in this phase land in it, not in whichever phase the thread reached them
            stream.wait_idle()
        if name == "optimizer" and counters.manager is not None:
            counters.manager.synchronize()  # write-backs issued by the step land
        phases[name] += counters.delta()

    # the run's own schedule (batch.schedule): per micro-step or layer-major
    with saved_bytes() as recompute:  # layer-major: one unit's recomputation
        eng.train_batch([None] * accum, loss_fn, on_phase=phase_done)
    # layer-major keeps every micro-batch's unit-boundary tensors and the fp32
    # gradient sums beside one unit's recomputed activations
    lm = eng.scheduler.sums.held_peak_bytes()
    out.saved_bytes = max(out.saved_bytes, recompute.nbytes + lm)
    return phases


def _record_peaks(eng: ZeroEngine, store: TieredShardStore | None, out: DryRun) -> None:
    """The run's schedule and peaks, after the last step."""
    out.schedule = eng.schedule
    out.gathered_peak = eng.scheduler.gathered_peak_bytes
    if store is not None and store.manager is not None:
        report = store.manager.memory_report()
        out.peak = {t: int(report.peak.get(t, 0)) for t in TIERS}
        # what the stream really took through TierManager.host_empty, at its peak;
        # with coarse pieces its ring on meta is not a real run's ([Note: dry-run
        # pieces] in engine/shards/state_layout.py): _placed's pipeline_bytes() is
        if not store.layout.coarse:
            out.pipeline_bytes = max(out.pipeline_bytes, report.outside_peak)
