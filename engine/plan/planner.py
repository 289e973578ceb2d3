"""Plan every offload choice for a model on a machine with the tier manager's placement.

For each choice (none, cpu, nvme, auto) the model's units become flat-shard
specs exactly as the engine partitions them (per unit, one shard per rank of
ceil(parameters / world size) elements per tensor class), and
offload.plan_placement decides their homes and the staging pool under the
machine's budgets: the same code a run executes, on sizes only.

[Note: plan traffic model] Bytes moved per optimizer step and rank, from the
homes: param16 is needed on the device in forward and in backward (2 reads
from NVMe if homed there, 2 host->device copies unless homed on the device);
the gradient leaves the device once (and, homed on NVMe, is written and read
back once); master and both Adam moments homed on NVMe are read and written
once; the updated param16 is written back to NVMe once. The predicted step
time is max(NVMe time, copy time, CPU Adam time): full overlap, compute not
modelled, so it is a lower bound set by the memory system.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from engine.plan.shapes import ModelShape
from offload import Budgets, PlanError, ShardSpec, TierBudgets, TierSettings, plan_placement
from offload.settings import TENSOR_CLASSES, TIERS, OffloadDevice, TensorClass, Tier

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
    adam_params_per_s: float | None = None


@dataclass
class ChoicePlan:
    choice: OffloadDevice
    error: str | None  # PlanError message when it does not fit
    by_tier: dict[Tier, dict[TensorClass, int]] = field(default_factory=dict)
    overhead: dict[Tier, int] = field(default_factory=dict)  # device cache reserve, host pool
    nvme_read: int = 0  # bytes per step (see [Note: plan traffic model])
    nvme_written: int = 0
    copied: int = 0
    adam_params: int = 0  # elements updated by the CPU Adam per step
    step_s: float | None = None

    @property
    def fits(self) -> bool:
        return self.error is None

    def total(self, tier: Tier) -> int:
        return sum(self.by_tier.get(tier, {}).values()) + self.overhead.get(tier, 0)


def shard_specs(shape: ModelShape, world_size: int, precision: str) -> list[ShardSpec]:
    """One spec per unit and tensor class, sized as this rank's flat shard."""
    dtype = DTYPES[precision]
    specs = []
    for name, numel in shape.units:
        if numel == 0:
            continue
        shard = math.ceil(numel / world_size)
        for cls in TENSOR_CLASSES:
            if cls == "param16" and dtype == torch.float32:
                continue  # fp32 compute: the master shard is the parameter shard
            specs.append(ShardSpec(f"{name}/{cls}", cls, shard,
                                   dtype if cls == "param16" else torch.float32))
    return specs


def plan_choice(specs: list[ShardSpec], choice: OffloadDevice, machine: Machine) -> ChoicePlan:
    budgets = TierBudgets(device=machine.device_bytes, host=machine.host_bytes,
                          nvme=machine.nvme_bytes)
    settings = TierSettings(homes=dict.fromkeys(TENSOR_CLASSES, choice),
                            budgets=Budgets(device=budgets.device, host=budgets.host,
                                            nvme=budgets.nvme))
    device = torch.device("cuda" if machine.cuda else "cpu")
    quiet = logging.getLogger("offload")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # placement explains itself at INFO; the table says it all
    try:
        plan = plan_placement(specs, settings, budgets, device)
    except PlanError as exc:
        return ChoicePlan(choice, str(exc))
    finally:
        quiet.setLevel(level)
    out = ChoicePlan(choice, None)
    out.by_tier = {t: dict.fromkeys(TENSOR_CLASSES, 0) for t in TIERS}
    for key, spec in plan.specs.items():
        out.by_tier[plan.homes[key]][spec.cls] += spec.nbytes
    out.overhead = {"device": plan.device_reserve, "host": plan.pool_bytes, "nvme": 0}
    for key, spec in plan.specs.items():
        _add_traffic(out, spec, plan.homes[key])
    out.step_s = _step_time(out, machine)
    return out


def _add_traffic(out: ChoicePlan, spec: ShardSpec, home: Tier) -> None:
    n = spec.nbytes
    if spec.cls == "param16":
        if home == "nvme":
            out.nvme_read += 2 * n
            out.nvme_written += n  # the updated parameters go back to their home
        if home != "device":
            out.copied += 2 * n
    elif spec.cls == "grad":
        if home != "device":
            out.copied += n
        if home == "nvme":
            out.nvme_written += n
            out.nvme_read += n
    else:  # master, exp_avg, exp_avg_sq
        if home == "nvme":
            out.nvme_read += n
            out.nvme_written += n
        if spec.cls == "master" and home != "device":
            out.adam_params += spec.numel


def _step_time(out: ChoicePlan, m: Machine) -> float | None:
    parts: list[float] = []
    if out.nvme_read or out.nvme_written:
        if m.nvme_read_gbps is None or m.nvme_write_gbps is None:
            return None
        parts.append(out.nvme_read / (m.nvme_read_gbps * 1e9)
                     + out.nvme_written / (m.nvme_write_gbps * 1e9))
    if out.copied:
        if m.copy_gbps is None:
            return None
        parts.append(out.copied / (m.copy_gbps * 1e9))
    if out.adam_params:
        if m.adam_params_per_s is None:
            return None
        parts.append(out.adam_params / m.adam_params_per_s)
    return max(parts, default=0.0)


def plan_all(shape: ModelShape, machine: Machine, *, world_size: int,
             precision: str) -> list[ChoicePlan]:
    specs = shard_specs(shape, world_size, precision)
    return [plan_choice(specs, choice, machine) for choice in CHOICES]


def recommend(plans: list[ChoicePlan]) -> ChoicePlan | None:
    """The fitting choice with the shortest predicted step, then the fewest bytes moved,
    then the simplest (none, cpu, auto, nvme)."""
    order = {"none": 0, "cpu": 1, "auto": 2, "nvme": 3}
    fitting = [p for p in plans if p.fits]
    return min(fitting, key=lambda p: (p.step_s if p.step_s is not None else math.inf,
                                       p.copied + p.nvme_read + p.nvme_written,
                                       order[p.choice]), default=None)
