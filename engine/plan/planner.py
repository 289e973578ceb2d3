"""Plan every offload choice for a model on a machine with the engine's own code.

For each choice (none, cpu, nvme, auto):
1. Placement: the engine's shard store (TieredShardStore, on the meta device)
   is given the config a run with this choice would use, budgets set to the
   machine's; each unit is declared as the engine declares it (this rank's
   shard of shard_numel(parameters, world size) elements; param in the
   compute dtype, master (none with master_precision bf16: [Note: bf16 master
   weights]) and moments in fp32 (or their state_precision), grad in fp32 or, with
   one rank and no accumulation, the compute dtype: [Note: gradient precision]) and
   finalize() runs what a run runs at start: the engine's homes per class
   (shards.tier_config.homes_from: with optimizer state on NVMe the gradient stays
   in host memory), the
   budgets, pool and prefetch windows (tier_settings, the CPU Adam's pipeline
   buffers taken from the host budget) and offload.plan_placement. A
   PlanError is "does not fit", with the short tier and by how much.
2. Traffic: for a choice that fits and offloads anything, the engine itself runs
   two optimizer steps on meta tensors (engine/plan/dry_run.py, [Note: plan
   from the engine]): NVMe bytes read and written, host<->device bytes and CPU
   Adam elements of the steady-state step are counted, not derived, and the
   per-tier peaks are the tier manager's. Offload none moves nothing between
   tiers (the engine keeps every shard on the device).
3. Time: from the step's traffic and the measured speeds, as below.

[Note: plan step time] Per phase of the dry-run step (forward, backward,
optimizer), NVMe, copies and CPU Adam overlap each other (prefetch and the
pipelined optimizer run them concurrently) but the NVMe reads and writes share
one drive: phase time = max(read/r + written/w, copied/c, adam/a). Phases run
one after the other, so the step is their sum. Compute is not modelled: this is
the step time the memory system allows.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from tierzero.engine.config import Config, load_config
from tierzero.engine.plan.dry_run import PHASES, DryRun, Traffic, dry_run
from tierzero.engine.plan.host import HostPeak, init_build_bytes, predict
from tierzero.engine.plan.shapes import ModelShape, model_shape
from tierzero.engine.shards.flat import shard_numel
from tierzero.engine.shards.grad_precision import grad_dtype
from tierzero.engine.shards.tiered import TieredShardStore
from tierzero.engine.step.precision import compute_dtype
from tierzero.offload import PlanError
from tierzero.offload.settings import TENSOR_CLASSES, TIERS, OffloadDevice, TensorClass, Tier

CHOICES: tuple[OffloadDevice, ...] = ("none", "cpu", "nvme", "auto")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Machine:
    """Budgets (bytes) and measured or given speeds (None = unknown)."""

    device_bytes: int
    host_bytes: int
    nvme_bytes: int
    cuda: bool
    nvme_read_gbps: float | None = None
    nvme_write_gbps: float | None = None
    copy_gbps: float | None = None  # host <-> device
    adam_params_per_s: float | None = None  # the run's own state layout's CPU Adam rate
    # every state layout's rate as `tierzero bench` measured it, ("int8+bf16master", rate)
    # pairs (engine/bench/measure.py adam_state_key): the state_precision table's steps
    adam_rates: tuple[tuple[str, float], ...] = ()

    def adam_rate(self, key: str) -> float | None:
        """The CPU Adam's elements per second for state layout `key`, if measured."""
        return dict(self.adam_rates).get(key)


@dataclass
class ChoicePlan:
    choice: OffloadDevice
    error: str | None  # PlanError message when it does not fit
    by_tier: dict[Tier, dict[TensorClass, int]] = field(default_factory=dict)
    overhead: dict[Tier, int] = field(default_factory=dict)  # device cache reserve, host pool
    phases: dict[str, Traffic] = field(default_factory=dict)  # the dry run's last step
    peak: dict[Tier, int] = field(default_factory=dict)  # the tier manager's, dry run
    step_s: float | None = None
    # why the dry run could not count traffic (the model's forward does not run on meta
    # tensors, say); the placement above still holds
    traffic_error: str | None = None
    host: HostPeak | None = None  # predicted host peak ([Note: plan host peak]), dry run
    schedule: str = "micro_step"  # batch.schedule of the dry run above (the run's own)
    # with gradient accumulation, each batch.schedule's step ([Note: layer-major schedule]):
    # schedule -> (its steady-state step's traffic, its predicted host peak)
    schedules: dict[str, tuple[Traffic, HostPeak]] = field(default_factory=dict)
    # the host tier budget placement ran with: the machine's host memory, or less so that
    # what lives outside the tiers fits beside it ([Note: plan within the host])
    host_budget: int | None = None
    device_budget: int | None = None  # the same for the device tier
    # device memory at the step's peak: the tier manager's device peak, plus with CUDA the
    # gathered units, saved activations and one unit's gradients (dry run; None: unknown)
    device_peak: int | None = None

    @property
    def grad_home(self) -> str:
        """Tiers the gradient shards live on ("host", "nvme", "device", joined by +)."""
        tiers = [t for t in TIERS if self.by_tier.get(t, {}).get("grad", 0)]
        return "+".join(tiers) if tiers else "-"

    @property
    def fits(self) -> bool:
        return self.error is None

    @property
    def traffic(self) -> Traffic:
        total = Traffic()
        for t in self.phases.values():
            total = total + t
        return total

    @property
    def nvme_read(self) -> int:  # bytes per step
        return self.traffic.nvme_read

    @property
    def nvme_written(self) -> int:
        return self.traffic.nvme_written

    @property
    def copied(self) -> int:
        return self.traffic.copied

    @property
    def adam_params(self) -> int:  # elements updated by the CPU Adam per step
        return self.traffic.adam_params

    def total(self, tier: Tier) -> int:
        return sum(self.by_tier.get(tier, {}).values()) + self.overhead.get(tier, 0)

    def checkpoint_bytes(self, tier: Tier) -> int:
        """The saved state (master and moments; tierzero train saves between steps, so no
        gradient) homed on `tier`: on NVMe, what a background checkpoint keeps as swap
        regions at most while it runs ([Note: shard snapshots] in offload/snapshot.py); on
        host, what it may copy before the steps change it (outputs.
        background_save_copy_bytes bounds that); on the device, what it copies at the save
        ([Note: snapshot parts] in engine/shards/snapshot.py). With a bf16 master the param
        is saved as the master ([Note: master precision in checkpoints])."""
        fp32 = any(self.by_tier.get(t, {}).get("master", 0) for t in TIERS)
        kinds: tuple[TensorClass, ...] = ("master" if fp32 else "param", "exp_avg",
                                          "exp_avg_sq")
        return sum(self.by_tier.get(tier, {}).get(c, 0) for c in kinds)

    def speculation_bytes(self) -> int | None:
        """What a speculated optimizer step keeps as swap regions at most until step()
        ([Note: speculated step] in engine/step/speculation.py): every state class the
        update writes (master, moments, param), when all of them are homed on NVMe; None
        where one is not (that layout runs the deferred update)."""
        kinds: tuple[TensorClass, ...] = ("master", "exp_avg", "exp_avg_sq", "param")
        off = [c for t in TIERS if t != "nvme" for c in kinds if self.by_tier.get(t, {}).get(c)]
        if off or not self.by_tier.get("nvme", {}).get("exp_avg"):
            return None
        return sum(self.by_tier["nvme"].get(c, 0) for c in kinds)


def engine_config(choice: OffloadDevice, machine: Machine, *, precision: str,
                  nvme_path: str | None, unit_classes: tuple[str, ...] = (),
                  max_in_cpu_bytes: int = 0, state_precision: str = "fp32",
                  grad_accum: int = 1, schedule: str = "auto",
                  master_precision: str = "fp32") -> Config:
    """The config a run with this choice would use, budgets set to the machine's.
    `max_in_cpu_bytes`: offload.params.max_in_cpu_bytes of the nvme choice (parameter
    shards homed in host memory instead of NVMe; the other choices do not use it).
    `state_precision`: offload.optimizer.state_precision of the choices that run the CPU
    Adam (the shard store sizes the moments by it, so placement uses their real bytes);
    offload none keeps fp32 moments on the device whatever it says; likewise
    `master_precision` (offload.optimizer.master_precision). `grad_accum`, `schedule`:
    batch.gradient_accumulation_steps and batch.schedule."""
    offload: dict[str, object] = {"device": choice, "budgets": {
        "device_bytes": machine.device_bytes, "host_bytes": machine.host_bytes,
        "nvme_bytes": machine.nvme_bytes}}
    if choice == "nvme" and max_in_cpu_bytes:
        offload["max_in_cpu_bytes"] = max_in_cpu_bytes
    optimizer = {k: v for k, v in (("state_precision", state_precision),
                                   ("master_precision", master_precision)) if v != "fp32"}
    if choice != "none" and optimizer:
        offload["optimizer"] = optimizer
    if choice in ("nvme", "auto"):  # the dry run writes nothing there (DrySwap)
        offload["path"] = nvme_path or tempfile.gettempdir()
    zero: dict[str, object] = {"stage": 3}
    if unit_classes:
        zero["units"] = list(unit_classes)
    batch = {"gradient_accumulation_steps": grad_accum, "schedule": schedule}
    return load_config({"zero": zero, "precision": precision, "offload": offload,
                        "batch": batch})


def plan_choice(shape: ModelShape, choice: OffloadDevice, machine: Machine, *,
                world_size: int, precision: str, nvme_path: str | None = None,
                max_in_cpu_bytes: int = 0, state_precision: str = "fp32",
                grad_accum: int = 1, master_precision: str = "fp32") -> ChoicePlan:
    """Placement only (step 1 of the module docstring), moments sized for
    `state_precision`, gradients in the dtype a run keeps them in ([Note: gradient
    precision]: the compute dtype's 2 bytes with one rank and `grad_accum` 1)."""
    config = engine_config(choice, machine, precision=precision, nvme_path=nvme_path,
                           unit_classes=shape.unit_classes, max_in_cpu_bytes=max_in_cpu_bytes,
                           state_precision=state_precision, grad_accum=grad_accum,
                           master_precision=master_precision)
    dtype = compute_dtype(config.precision.dtype)
    store = TieredShardStore(torch.device("meta"), config, grad_dtype(config, world_size))
    quiet = logging.getLogger("tierzero.offload")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # placement explains itself at INFO; the table says it all
    try:
        for name, numel in shape.units:
            store.declare(f"{name}/{str(dtype).removeprefix('torch.')}/trainable",
                          shard_numel(numel, world_size), dtype, True)
        store.finalize()
        if store.manager is None:
            raise PlanError("internal: the shard store has no tier manager after finalize()")
        plan = store.manager.plan
        out = ChoicePlan(choice, None)
        out.by_tier = {t: dict.fromkeys(TENSOR_CLASSES, 0) for t in TIERS}
        for key, spec in plan.specs.items():
            out.by_tier[plan.homes[key]][spec.cls] += spec.nbytes
        out.overhead = {"device": plan.device_reserve,
                        "host": plan.pool_bytes + store.layout.pipeline_bytes(), "nvme": 0}
        return out
    except (PlanError, ValueError) as exc:  # ValueError: host budget below the pipeline's
        return ChoicePlan(choice, str(exc))
    finally:
        store.close()
        quiet.setLevel(level)


def host_peak(run: DryRun, config: Config, *, device_is_host: bool) -> HostPeak:
    """The predicted host peak of a dry run of `config` ([Note: plan host peak] in
    engine/plan/host.py)."""
    # tierzero train builds a stage-3 model under engine.Init (engine/train/loop.py)
    init = (init_build_bytes(run.model_bytes, world_size=run.world_size,
                             max_live=config.zero.init_live_bytes,
                             params_on_nvme=config.offload.params.device == "nvme")
            if config.zero.stage == 3 else None)
    return predict(model=run.model_bytes, init_peak=run.init_peak, peak=run.peak,
                   pipeline=run.pipeline_bytes, init_outside=run.init_outside,
                   saved=run.saved_bytes, init_build=init, gathered=run.gathered_peak,
                   largest_unit=run.largest_unit, largest_group=run.largest_group,
                   compute_bytes=torch.finfo(compute_dtype(config.precision.dtype)).bits // 8,
                   device_is_host=device_is_host)


def predict_run(model: str, config: Config | str, *, seq_len: int, micro_batch: int = 1,
                device_is_host: bool | None = None) -> dict[str, object]:
    """The host peak of `tierzero train` with this model spec and config (a run on this
    machine: the device tier is host memory when there is no CUDA), and the NVMe bytes of
    its steady-state optimizer step."""
    cfg = config if isinstance(config, Config) else load_config(config)
    shape = model_shape(model)
    host = device_is_host if device_is_host is not None else not torch.cuda.is_available()
    run = dry_run(shape.fresh_module(), cfg, seq_len=seq_len, micro_batch=micro_batch,
                  device_is_host=host)
    step = run.step()  # the steady-state optimizer step, in the config's batch.schedule
    return {**host_peak(run, cfg, device_is_host=host).as_dict(), "schedule": run.schedule,
            "nvme_read_per_step": step.nvme_read, "nvme_written_per_step": step.nvme_written}


def add_traffic(out: ChoicePlan, shape: ModelShape, machine: Machine, *, world_size: int,
                precision: str, nvme_path: str | None, max_in_cpu_bytes: int = 0,
                seq_len: int = 8, micro_batch: int = 1, state_precision: str = "fp32",
                grad_accum: int = 1, master_precision: str = "fp32") -> None:
    """Steps 2 and 3: run the engine dry and time its counted traffic. With `grad_accum`
    > 1 the run's own batch.schedule (auto) is counted, and each schedule's step kept in
    `out.schedules`."""
    if out.choice == "none" or not out.fits:
        out.phases = dict.fromkeys(PHASES, Traffic())
        out.step_s = 0.0 if out.fits else None
        return
    runs: dict[str, DryRun] = {}
    for schedule in ("auto", "layer_major", "micro_step") if grad_accum > 1 else ("auto",):
        if schedule in runs:
            continue  # auto ran it already
        config = engine_config(out.choice, machine, precision=precision, nvme_path=nvme_path,
                               unit_classes=shape.unit_classes,
                               max_in_cpu_bytes=max_in_cpu_bytes,
                               state_precision=state_precision, grad_accum=grad_accum,
                               schedule=schedule, master_precision=master_precision)
        try:
            run = dry_run(shape.fresh_module(), config, world_size=world_size,
                          seq_len=seq_len, micro_batch=micro_batch,
                          device_is_host=not machine.cuda)
        except PlanError as exc:  # the engine's own budget checks (pipeline buffers, ...)
            out.error = str(exc)
            return
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            # a model whose forward needs real values (data-dependent control flow, .item())
            out.traffic_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            return
        runs[run.schedule] = run
        host = host_peak(run, config, device_is_host=not machine.cuda)
        if grad_accum > 1:
            out.schedules[run.schedule] = (run.step(), host)
        if schedule == "auto":
            out.phases = run.steps[-1]
            out.peak = run.peak
            out.step_s = step_time(out.phases, machine)
            out.host = host
            out.schedule = run.schedule
            out.host_budget = machine.host_bytes
            out.device_budget = machine.device_bytes
            outside = 0
            if machine.cuda:  # on the device beside its tier (without CUDA: out.host)
                compute = torch.finfo(compute_dtype(config.precision.dtype)).bits // 8
                outside = (run.gathered_peak + run.saved_bytes
                           + run.largest_unit * (compute + 4))
            out.device_peak = run.peak.get("device", 0) + outside


# [Note: plan within the host]
# A choice's host tier budget is not the whole host: the process holds more than the tier
# manager counts (the CPU Adam ring, gathered units and activations without CUDA, the
# model being built and placed: [Note: plan host peak]). Placement fills an explicit host
# budget (gradients homed in host memory as far as it has room, [Note: gradient home];
# auto's placement), so planned with the whole host a choice can fit its tiers and still
# peak above the host. `fit_host` plans such a choice again with the host budget lowered
# by the excess (and HOST_MARGIN of the host), up to HOST_TRIES times, while that brings
# the peak down (a peak from building the model does not move with the budget); likewise
# the device budget when the device peak (its tier + gathered units, activations and a
# unit's gradients with CUDA) is above the device. The recommended config carries the
# budgets it was planned with (offload.budgets.host_bytes / device_bytes), so a run
# places what the plan predicted. `over_budget` then says which choices still
# peak above the host or the device; `recommend` never picks one.
HOST_MARGIN = 0.01
HOST_TRIES = 3


def fit_host(p: ChoicePlan, shape: ModelShape, machine: Machine, **kw: Any) -> ChoicePlan:
    """`p` (with its dry run), or the same choice planned with a host (then device) tier
    budget low enough for its predicted host (device) peak to stay within the machine's
    ([Note: plan within the host]); `kw`: plan_choice's and add_traffic's keywords."""
    best = p
    for _ in range(HOST_TRIES):
        if best.host_budget is None or best.device_budget is None or best.host is None:
            return best
        budgets = {"host_bytes": best.host_budget, "device_bytes": best.device_budget}
        if best.host.peak > machine.host_bytes:
            tier, peak, have = "host_bytes", best.host.peak, machine.host_bytes
        elif best.device_peak is not None and best.device_peak > machine.device_bytes:
            tier, peak, have = "device_bytes", best.device_peak, machine.device_bytes
        else:
            return best
        budgets[tier] -= peak - have + int(HOST_MARGIN * have)
        if budgets[tier] <= 0:
            return best
        lower = dataclasses.replace(machine, host_bytes=budgets["host_bytes"],
                                    device_bytes=budgets["device_bytes"])
        again = plan_choice(shape, p.choice, lower, **{
            k: v for k, v in kw.items() if k not in ("seq_len", "micro_batch")})
        add_traffic(again, shape, lower, **kw)
        new_peak = None if again.host is None else (
            again.host.peak if tier == "host_bytes" else again.device_peak)
        if not again.fits or new_peak is None or new_peak >= peak:
            return best  # the excess does not come from the tiers
        best = again
    return best


def over_budget(p: ChoicePlan, machine: Machine) -> str | None:
    """Why a choice that fits its tiers still does not fit the machine (its predicted host
    or device peak is above what was given), or None."""
    if p.host is not None and p.host.peak > machine.host_bytes:
        return (f"host peak {p.host.peak} bytes ({p.host.phase}) is above the host's "
                f"{machine.host_bytes}")
    if p.device_peak is not None and p.device_peak > machine.device_bytes:
        return (f"device peak {p.device_peak} bytes is above the device's "
                f"{machine.device_bytes}")
    return None


def step_time(phases: dict[str, Traffic], m: Machine, adam_rate: float | None = None
              ) -> float | None:
    """[Note: plan step time]; None when a speed the step needs is unknown. `adam_rate`:
    the CPU Adam's elements per second (default: the machine's, the run's own layout's)."""
    rate = m.adam_params_per_s if adam_rate is None else adam_rate
    total = 0.0
    for t in phases.values():
        parts: list[float] = []
        if t.nvme_read or t.nvme_written:
            if m.nvme_read_gbps is None or m.nvme_write_gbps is None:
                return None
            parts.append(t.nvme_read / (m.nvme_read_gbps * 1e9)
                         + t.nvme_written / (m.nvme_write_gbps * 1e9))
        if t.copied:
            if m.copy_gbps is None:
                return None
            parts.append(t.copied / (m.copy_gbps * 1e9))
        if t.adam_params:
            if rate is None:
                return None
            parts.append(t.adam_params / rate)
        total += max(parts, default=0.0)
    return total


def plan_all(shape: ModelShape, machine: Machine, *, world_size: int, precision: str,
             nvme_path: str | None = None, traffic: bool = True,
             max_in_cpu_bytes: int = 0, seq_len: int = 8,
             micro_batch: int = 1, state_precision: str = "fp32",
             grad_accum: int = 1, master_precision: str = "fp32") -> list[ChoicePlan]:
    """Every choice; `traffic=False` stops after placement (no dry run).
    `max_in_cpu_bytes`: the nvme choice's offload.params.max_in_cpu_bytes; `seq_len`,
    `micro_batch`: the dry run's batch (what its saved activations are counted for);
    `state_precision`, `master_precision`: the run's offload.optimizer.state_precision and
    master_precision (placement and the dry run use their bytes)."""
    plans = [plan_choice(shape, choice, machine, world_size=world_size, precision=precision,
                         nvme_path=nvme_path, max_in_cpu_bytes=max_in_cpu_bytes,
                         state_precision=state_precision, grad_accum=grad_accum,
                         master_precision=master_precision)
             for choice in CHOICES]
    if traffic:
        kw: dict[str, Any] = {
            "world_size": world_size, "precision": precision, "nvme_path": nvme_path,
            "max_in_cpu_bytes": max_in_cpu_bytes, "seq_len": seq_len,
            "micro_batch": micro_batch, "state_precision": state_precision,
            "grad_accum": grad_accum, "master_precision": master_precision}
        for p in plans:
            add_traffic(p, shape, machine, **kw)
        plans = [fit_host(p, shape, machine, **kw) if p.fits else p for p in plans]
    return plans


def recommend(plans: list[ChoicePlan], machine: Machine | None = None) -> ChoicePlan | None:
    """The fitting choice with the shortest predicted step, then the fewest bytes moved,
    then the simplest (none, cpu, auto, nvme); with `machine`, never one whose predicted
    host or device peak is above it (over_budget)."""
    order = {"none": 0, "cpu": 1, "auto": 2, "nvme": 3}
    fitting = [p for p in plans if p.fits and (machine is None or over_budget(p, machine)
                                               is None)]
    return min(fitting, key=lambda p: (p.step_s if p.step_s is not None else math.inf,
                                       p.copied + p.nvme_read + p.nvme_written,
                                       order[p.choice]), default=None)


