"""`tierzero plan`: will this model fit on this machine, where, and how fast.

Machine figures come from flags, else detection (CUDA free memory, available
RAM, free space at the NVMe path), and speeds from flags, else the file
`tierzero bench` saved. A model that fits under no choice exits 1 naming, per
choice, the short tier and by how much.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import sys
from typing import Any

import psutil
import torch
import yaml

from tierzero.engine.bench.command import results_path
from tierzero.engine.bench.measure import adam_state_key
from tierzero.engine.config import ConfigError
from tierzero.engine.config.schema import OutputsConfig
from tierzero.engine.config.values import parse_bytes
from tierzero.engine.plan.planner import (
    DTYPES,
    ChoicePlan,
    Machine,
    over_budget,
    plan_all,
    recommend,
    step_time,
)
from tierzero.engine.plan.shapes import ModelShape, model_shape
from tierzero.engine.plan.state_precision import precision_placements, precision_rows
from tierzero.engine.train.metrics import human_bytes
from tierzero.engine.train.model_source import ModelError
from tierzero.offload.bf16_master import MASTER_PRECISIONS
from tierzero.offload.settings import TENSOR_CLASSES, TIERS
from tierzero.offload.state_codec import STATE_PRECISIONS
from tierzero.swap.safe_files import write_atomic

Subparsers = Any  # argparse's _SubParsersAction is private


def add_plan(sub: Subparsers) -> None:
    plan = sub.add_parser(
        "plan", help="bytes per tier for each offload choice, what fits, predicted step time",
        description="Run the tier manager's placement on the model's units (built on meta "
        "tensors) for offload none / cpu / nvme / auto and print bytes per tensor class per "
        "tier, which fit, NVMe traffic and a predicted step time from measured bandwidths.",
    )
    plan.add_argument("--model", required=True,
                      help="builtin:<size>, a Hugging Face config.json or its directory, or a "
                      "parameter count (7e9, 40B)")
    plan.add_argument("--layers", type=int, default=32,
                      help="blocks a parameter count is split into (default 32)")
    plan.add_argument("--precision", choices=sorted(DTYPES), default="bf16")
    plan.add_argument("--world-size", type=int, default=1, help="data-parallel ranks")
    plan.add_argument("--state-precision", choices=STATE_PRECISIONS, default="fp32",
                      help="offload.optimizer.state_precision of the run (default fp32): the "
                      "plan places and counts the step with its moment bytes, and recommends "
                      "it; bf16/int8 change the numbers a run computes, so they are only "
                      "recommended when set here (the table shows what each would need)")
    plan.add_argument("--master-precision", choices=MASTER_PRECISIONS, default="fp32",
                      help="offload.optimizer.master_precision of the run (default fp32): bf16 "
                      "keeps no fp32 master (the bf16 compute copy is the master, rounded "
                      "stochastically; needs --precision bf16); placed, counted and "
                      "recommended only when set here")
    for name, what in (("device-mem", "accelerator memory per rank (default: free CUDA memory)"),
                       ("host-mem", "host memory for tierzero per rank (default: available RAM)"),
                       ("nvme-size", "swap space per rank (default: free space at --nvme-path)")):
        plan.add_argument(f"--{name}", metavar="BYTES", help=what + "; e.g. 80GB, 512GiB")
    plan.add_argument("--nvme-path", default="/var/tmp", help="swap directory (default /var/tmp)")
    plan.add_argument("--max-in-cpu", metavar="BYTES", default="0",
                      help="offload.params.max_in_cpu_bytes of the nvme choice: parameter shard "
                      "bytes per rank homed in host memory instead of NVMe (default 0)")
    plan.add_argument("--seq-len", type=int, default=128,
                      help="tokens per sample of the run (train.seq_len; default 128): the "
                      "dry run's batch, whose saved activations count toward the host peak")
    plan.add_argument("--grad-accum", type=int, default=1, metavar="K",
                      help="gradient_accumulation_steps: with K > 1 both batch schedules "
                      "(layer_major, micro_step) are counted; the run's own is auto")
    plan.add_argument("--micro-batch", type=int, default=1,
                      help="samples per micro-batch (batch.micro_batch_size; default 1)")
    plan.add_argument("--bench", metavar="FILE",
                      help=f"bandwidths saved by tierzero bench (default {results_path()})")
    for name in ("nvme-read-gbps", "nvme-write-gbps", "copy-gbps", "adam-params-per-s"):
        plan.add_argument(f"--{name}", type=float, metavar="X")
    plan.add_argument("--write", metavar="FILE", help="write the recommended config here (YAML)")
    plan.set_defaults(run=run_plan)


def _bytes(flag: str, text: str | None) -> int | None:
    return None if text is None else parse_bytes(text, flag, int, {"unit": "bytes"})


def detect_machine(args: argparse.Namespace) -> tuple[Machine, list[str]]:
    notes: list[str] = []
    device = _bytes("--device-mem", args.device_mem)
    cuda = torch.cuda.is_available()
    if device is None:
        if not cuda:
            raise ConfigError("--device-mem", "no CUDA device here to measure; give the "
                              "accelerator memory of the machine to plan for, e.g. 80GB")
        device = int(torch.cuda.mem_get_info()[0])
        notes.append("device memory: detected (free CUDA memory)")
    host = _bytes("--host-mem", args.host_mem)
    if host is None:
        host = int(psutil.virtual_memory().available)
        notes.append("host memory: detected (available RAM)")
    nvme = _bytes("--nvme-size", args.nvme_size)
    if nvme is None:
        if not os.path.isdir(args.nvme_path):
            raise ConfigError("--nvme-path", f"'{args.nvme_path}' is not a directory; give an "
                              "existing swap directory or --nvme-size")
        nvme = int(shutil.disk_usage(args.nvme_path).free)
        notes.append(f"nvme space: detected (free at {args.nvme_path})")
    speeds = _bench_speeds(args, notes)
    return Machine(device, host, nvme, cuda or args.device_mem is not None, **speeds), notes


def _bench_speeds(args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    """Machine's speeds: the command line's, else the bench file's (`adam_rates`: every
    state layout's CPU Adam rate the file has, for the state_precision table)."""
    path = args.bench or results_path()
    saved: dict[str, Any] = {}
    if os.path.isfile(path):
        saved = _bench_file(path)
        notes.append(f"speeds not given on the command line: from {path}")
    elif args.bench:
        raise ConfigError("--bench", f"'{path}' does not exist; run tierzero bench first")
    pick = {"nvme_read_gbps": args.nvme_read_gbps or saved.get("nvme_read_gbps"),
            "nvme_write_gbps": args.nvme_write_gbps or saved.get("nvme_write_gbps"),
            # host <-> device: the measured PCIe copy with CUDA; the CPU stand-in's device
            # tier is host memory, so its copies run at memory copy speed
            "copy_gbps": args.copy_gbps or saved.get("h2d_gbps") or saved.get(
                "memory_copy_gbps"),
            "adam_params_per_s": args.adam_params_per_s or _adam_rate(args, saved, notes)}
    # the other layouts' rates only beside the run's own from the same file: a rate given
    # on the command line is not comparable with a bench file's
    rates = {} if args.adam_params_per_s else saved.get("adam_params_per_s_by_state") or {}
    return {**{k: (float(v) if v is not None else None) for k, v in pick.items()},
            "adam_rates": tuple(sorted((str(k), float(v)) for k, v in rates.items()))}


_SPEEDS = ("nvme_read_gbps", "nvme_write_gbps", "h2d_gbps", "memory_copy_gbps",
           "adam_params_per_s")


def _bench_file(path: str) -> dict[str, Any]:
    """A `tierzero bench` results file, its speeds checked: each one present a number > 0
    (or null), the per-layout CPU Adam rates a mapping of such numbers."""
    def bad(key: str, value: object) -> ConfigError:
        return ConfigError("--bench", f"'{path}': {key} is {value!r}; allowed: a number > 0 "
                           "(rerun tierzero bench)")

    def rate(value: object) -> bool:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and value > 0)

    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError("--bench", f"'{path}' is not a readable JSON file ({exc}); "
                          "rerun tierzero bench") from exc
    if not isinstance(saved, dict):
        raise ConfigError("--bench", f"'{path}' holds {type(saved).__name__}, not the JSON "
                          "object tierzero bench writes; rerun tierzero bench")
    for key in _SPEEDS:
        if saved.get(key) is not None and not rate(saved[key]):
            raise bad(key, saved[key])
    by_state = saved.get("adam_params_per_s_by_state")
    if by_state is not None:
        if not isinstance(by_state, dict):
            raise bad("adam_params_per_s_by_state", by_state)
        for key, value in by_state.items():
            if not rate(value):
                raise bad(f"adam_params_per_s_by_state[{key!r}]", value)
    return saved


def _adam_rate(args: argparse.Namespace, saved: dict[str, Any], notes: list[str]
               ) -> float | None:
    """The CPU Adam's elements per second for the run's own state layout
    (--state-precision, --master-precision) as `tierzero bench` measured it: int8 moments
    and a bf16 master update at about half fp32's rate, so a step the plan would time by
    fp32's may be the CPU's, not the drive's. A bench file without the per-layout rates
    (written before they were measured) gives fp32 AdamW's, said in a note."""
    key = adam_state_key(args.state_precision, args.master_precision)
    rate = (saved.get("adam_params_per_s_by_state") or {}).get(key)
    if rate is not None:
        notes.append(f"CPU Adam rate: the offloaded step's with state {key}, as measured")
        return float(rate)
    if saved.get("adam_params_per_s") is not None:
        notes.append(f"CPU Adam rate: fp32 AdamW's; the bench file has none for state {key} "
                     "(rerun tierzero bench)")
    return saved.get("adam_params_per_s")


def render(shape: ModelShape, plans: list[ChoicePlan], machine: Machine, args: argparse.Namespace,
           notes: list[str], *,
           placements: dict[tuple[str, str], ChoicePlan] | None = None) -> str:
    """The report; `placements`: the other state precisions' (precision_placements)."""
    out = [f"model: {shape.name}: {shape.parameters / 1e9:.2f}B parameters, "
           f"{len(shape.units)} units; {args.precision}, world size {args.world_size} "
           f"(bytes per rank); optimizer state_precision {args.state_precision}, "
           f"master_precision {args.master_precision}",
           f"machine: device {human_bytes(machine.device_bytes)}, host "
           f"{human_bytes(machine.host_bytes)}, nvme {human_bytes(machine.nvme_bytes)}"]
    out += [f"  {n}" for n in notes]
    out.append(_placement_table(plans, machine))
    out.append(_traffic_table(plans, machine))
    host = _host_peak_table(plans)
    if host is not None:
        out.append(host)
    out.append(_written_table(plans, shape.parameters / args.world_size))
    out.append(_background_save_table(plans, machine))
    spec = _speculation_table(plans, machine)
    if spec is not None:
        out.append(spec)
    out += _precision_table(plans, placements or {}, args.state_precision, machine,
                            args.master_precision)
    out += _schedule_table(plans, machine, args.grad_accum)
    out += _choice_lines(plans, machine)
    out.append("traffic: counted by running the engine's steps on meta tensors (steady-state "
               "step); peak: the tier manager's (without the CPU Adam's pipeline buffers, which "
               "reserve/pool includes). Host peak: predicted RSS growth of the run over its "
               "imports, the largest of its phases ([Note: plan host peak]: the model as "
               "built, placement, the step's tiers + CPU Adam ring + activations). "
               "Time per phase: max(NVMe, copies, CPU Adam), phases in "
               "sequence; compute is not modelled, so real steps are at least this long")
    return "\n".join(out)


def _placement_table(plans: list[ChoicePlan], machine: Machine) -> str:
    """Bytes per tensor class per tier of each choice, its peak and budget."""
    head = ["offload", "tier", *TENSOR_CLASSES, "reserve/pool", "total", "peak", "budget",
            "fits"]
    rows = [head]
    for p in plans:
        if not p.fits:
            rows.append([p.choice, "-", *["-"] * len(TENSOR_CLASSES), "-", "-", "-", "-", "no"])
            continue
        for tier in TIERS:
            budget = {"device": p.device_budget or machine.device_bytes,
                      "host": p.host_budget or machine.host_bytes,
                      "nvme": machine.nvme_bytes}[tier]
            rows.append([p.choice if tier == "device" else "", tier,
                         *[human_bytes(p.by_tier[tier][c]) for c in TENSOR_CLASSES],
                         human_bytes(p.overhead[tier]), human_bytes(p.total(tier)),
                         human_bytes(p.peak[tier]) if p.peak else "-",
                         human_bytes(budget), "yes" if tier == "device" else ""])
    return _table(rows)


def _traffic_table(plans: list[ChoicePlan], machine: Machine) -> str:
    """Bytes each phase of a steady-state step moves, and its predicted time."""
    rows = [["offload", "phase", "NVMe read", "NVMe written", "host->device",
             "device->host", "CPU Adam params", "time"]]
    for p in plans:
        if not p.fits or p.traffic_error:
            continue
        for i, (phase, t) in enumerate([*p.phases.items(), ("step", p.traffic)]):
            one = step_time({phase: t}, machine) if phase != "step" else p.step_s
            rows.append([p.choice if i == 0 else "", phase, human_bytes(t.nvme_read),
                         human_bytes(t.nvme_written), human_bytes(t.host_to_device),
                         human_bytes(t.device_to_host + t.grads_to_host),
                         f"{t.adam_params / 1e9:.2f}B" if t.adam_params >= 1e9
                         else f"{t.adam_params / 1e6:.1f}M",
                         f"{one:.2f} s" if one is not None else "n/a (run bench)"])
    return _table(rows)


def _host_peak_table(plans: list[ChoicePlan]) -> str | None:
    """The predicted host peak of each choice and its parts; None when no choice has one."""
    rows = [["offload", "gradient home", "host peak", "at", "build", "initialize", "train",
             "of which tier mgr", "Adam ring", "gathered+activations+grads"]]
    for p in plans:
        if not p.fits or p.host is None:
            continue
        h = p.host.parts
        rows.append([p.choice, p.grad_home, human_bytes(p.host.peak), p.host.phase,
                     human_bytes(p.host.build), human_bytes(p.host.initialize),
                     human_bytes(p.host.train),
                     human_bytes(h["tier_host"] + h["tier_device"]),
                     human_bytes(h["adam_pipeline"]),
                     human_bytes(h["gathered_units"] + h["saved_activations"]
                                 + h["unit_gradients"])])
    return _table(rows) if len(rows) > 1 else None


def _choice_lines(plans: list[ChoicePlan], machine: Machine) -> list[str]:
    """One line per choice that does not fit, had a budget lowered, is not recommended or
    whose traffic was not counted."""
    out = [f"{p.choice}: does not fit: {p.error}" for p in plans if not p.fits]
    out += [f"{p.choice}: host budget lowered to {human_bytes(p.host_budget)} so that its "
            f"predicted host peak ({human_bytes(p.host.peak)}) stays within the host's "
            f"{human_bytes(machine.host_bytes)} (what lives outside the tiers: CPU Adam ring, "
            "model build, gathered units, activations); the recommended config carries it"
            for p in plans if p.fits and p.host is not None and p.host_budget is not None
            and p.host_budget < machine.host_bytes and over_budget(p, machine) is None]
    out += [f"{p.choice}: device budget lowered to {human_bytes(p.device_budget)} so that its "
            f"predicted device peak ({human_bytes(p.device_peak or 0)}: the tier, gathered "
            f"units, activations, a unit's gradients) stays within the device's "
            f"{human_bytes(machine.device_bytes)}; the recommended config carries it"
            for p in plans if p.fits and p.device_budget is not None
            and p.device_budget < machine.device_bytes and over_budget(p, machine) is None]
    out += [f"{p.choice}: not recommended: {why}" for p in plans if p.fits
            and (why := _over_budget_text(p, machine)) is not None]
    out += [f"{p.choice}: traffic not counted: the engine's dry run on meta tensors failed "
            f"({p.traffic_error}); the placement above holds" for p in plans
            if p.fits and p.traffic_error]
    return out


def _written_table(plans: list[ChoicePlan], params: float) -> str:
    """NVMe bytes written per step and per 1,000 steps, and read + written per parameter
    of this rank's shards (`params`) and step, with the predicted step."""
    rows = [["offload", "NVMe written/step", "written/1,000 steps", "NVMe B/param/step",
             "predicted step"]]
    rows += [[p.choice, human_bytes(p.nvme_written), human_bytes(1000 * p.nvme_written),
              f"{(p.nvme_read + p.nvme_written) / params:.1f}",
              f"{p.step_s:.2f} s" if p.step_s is not None else "n/a (run bench)"]
             for p in plans if p.fits]
    return _table(rows)


NEAR_MISS = 0.25  # a choice this far (of the budget) above the machine: name the knob


def _over_budget_text(p: ChoicePlan, machine: Machine) -> str | None:
    """Why a fitting choice peaks above the machine, and the knob that brings a near miss
    (within NEAR_MISS of the budget) in; None when it does not."""
    if over_budget(p, machine) is None:
        return None
    if p.host is not None and p.host.peak > machine.host_bytes:
        over, have = p.host.peak - machine.host_bytes, machine.host_bytes
        text = (f"the predicted host peak {human_bytes(p.host.peak)} ({p.host.phase}) is above "
                f"the host's {human_bytes(have)}")
        if p.host.build > p.host.peak // 2:  # the build is most of it
            knob = (f"building the model holds {human_bytes(p.host.build)}: offload.params."
                    "device nvme builds it straight onto NVMe (tierzero.Init)")
        elif p.host.parts["saved_activations"] > over:
            knob = (f"activations are {human_bytes(p.host.parts['saved_activations'])} of it: "
                    "a smaller train.seq_len or micro batch, or activation checkpointing")
        else:
            knob = ("offload.budgets.host_bytes below the host by the excess, or "
                    "offload.optimizer.grad_device nvme")
    else:
        peak = p.device_peak or 0  # (over_budget found it above the device)
        over, have = peak - machine.device_bytes, machine.device_bytes
        text = (f"the predicted device peak {human_bytes(peak)} (tier manager + "
                f"gathered units + activations + one unit's gradients) is above the device's "
                f"{human_bytes(have)}")
        knob = ("offload.budgets.device_bytes below the device by the excess, a smaller "
                "train.seq_len or micro batch, or activation checkpointing")
    near = over <= NEAR_MISS * have
    return text + (f"; {human_bytes(over)} over, a near miss: {knob}" if near else
                   f"; {human_bytes(over)} over")


def _precision_table(plans: list[ChoicePlan], placements: dict[tuple[str, str], ChoicePlan],
                     chosen: str, machine: Machine, master: str) -> list[str]:
    """Bytes and SSD writes of each offload.optimizer.state_precision (engine/plan/
    state_precision.py); only the run's own (--state-precision) is recommended."""
    def opt(n: int | None) -> str:
        return "-" if n is None else human_bytes(n)

    rows = [["offload", "state_precision", "moments B/param", "fits", "moments", "on",
             "NVMe read/step", "NVMe written/step", "written/1,000 steps", "predicted step"]]
    rows += [[r.choice, r.precision + (" (run)" if r.precision == chosen else ""),
              f"{r.bytes_per_param:.2f}", "yes" if r.fits else "no",
              human_bytes(r.moments) if r.fits else "-", r.moments_tier, opt(r.nvme_read),
              opt(r.nvme_written), opt(r.written_per_1000),
              "-" if r.step_s is None else f"{r.step_s:.2f} s"]
             for r in precision_rows(plans, placements, chosen, machine, master)]
    if len(rows) == 1:
        return []
    return [_table(rows), "state_precision: how the CPU Adam keeps exp_avg/exp_avg_sq "
            "(offload.optimizer.state_precision; fp32 is exact, bf16/int8 change the "
            "numbers: to use one, plan with --state-precision and set it). Each row is "
            "placed with its own moment bytes; the run's step is counted, another row's NVMe "
            "bytes are that count with the moments' NVMe bytes exchanged ('-' where other "
            "tensors would move too), its predicted step that step timed by the CPU Adam "
            "rate tierzero bench measured for its layout ('-' where none was)"]


def _schedule_table(plans: list[ChoicePlan], machine: Machine, grad_accum: int) -> list[str]:
    """Each batch.schedule's optimizer step of `grad_accum` micro-batches ([Note:
    layer-major schedule]); the run's own (auto) is the one the tables above count."""
    rows = [["offload", "schedule", "NVMe read/step", "NVMe written/step", "host->device",
             "device->host", "host peak", "time"]]
    for p in plans:
        for i, (name, (t, host)) in enumerate(sorted(p.schedules.items())):
            one = step_time({"step": t}, machine)
            rows.append([p.choice if i == 0 else "",
                         name + (" (auto)" if name == p.schedule else ""),
                         human_bytes(t.nvme_read), human_bytes(t.nvme_written),
                         human_bytes(t.host_to_device),
                         human_bytes(t.device_to_host + t.grads_to_host),
                         human_bytes(host.peak),
                         f"{one:.2f} s" if one is not None else "n/a (run bench)"])
    if len(rows) == 1:
        return []
    return [_table(rows), f"schedule: an optimizer step of {grad_accum} micro-batches "
            "(batch.schedule): layer_major gathers each unit once per pass and sums its "
            "gradient in fp32 while it is gathered; micro_step runs forward and backward per "
            "micro-batch, gathering every unit and moving every gradient each time"]


def _background_save_table(plans: list[ChoicePlan], machine: Machine) -> str:
    """A background checkpoint's room: NVMe kept regions (on top of the swap's own state)
    and host copies at most (host-homed state: copied only before it changes, within
    outputs.background_save_copy_bytes; device-resident state: copied whole at the save),
    and whether the NVMe has it (else saves are synchronous)."""
    copy_limit = OutputsConfig().background_save_copy_bytes
    rows = [["offload", "background save: NVMe kept (max)", "swap with it", "host copies (max)",
             "NVMe room"]]
    for p in plans:
        if not p.fits:
            continue
        kept = p.checkpoint_bytes("nvme")
        copies = min(copy_limit, p.checkpoint_bytes("host")) + p.checkpoint_bytes("device")
        swap = p.total("nvme") + kept
        rows.append([p.choice, human_bytes(kept), human_bytes(swap), human_bytes(copies),
                     "yes" if swap <= machine.nvme_bytes else
                     "no: background saves fall back to synchronous ones"])
    return _table(rows)


def _speculation_table(plans: list[ChoicePlan], machine: Machine) -> str | None:
    """With clipping or fp16 and state on NVMe, the update speculated into backward keeps
    the regions it replaces until step() ([Note: speculated step]): that room beside the
    swap's own, and whether the NVMe has it (else the update stays deferred)."""
    rows = [["offload", "speculated step: NVMe kept (max)", "swap with it", "NVMe room"]]
    for p in plans:
        kept = p.speculation_bytes() if p.fits else None
        if kept is None:
            continue
        swap = p.total("nvme") + kept
        rows.append([p.choice, human_bytes(kept), human_bytes(swap),
                     "yes" if swap <= machine.nvme_bytes else
                     "no: the clipped update stays deferred into the next forward"])
    return _table(rows) if len(rows) > 1 else None


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def recommended_config(best: ChoicePlan, args: argparse.Namespace,
                       machine: Machine) -> dict[str, Any]:
    offload: dict[str, Any] = {"device": best.choice}
    if best.choice in ("nvme", "auto"):
        offload["path"] = os.path.abspath(args.nvme_path)
    cache = _bytes("--max-in-cpu", args.max_in_cpu) or 0
    if best.choice == "nvme" and cache:
        offload["max_in_cpu_bytes"] = cache
    optimizer = {k: getattr(args, k) for k in ("state_precision", "master_precision")
                 if getattr(args, k) != "fp32"}
    if best.choice != "none" and optimizer:  # the user's own choice
        offload["optimizer"] = optimizer
    # planned below the machine ([Note: plan within the host]): the run places the same
    budgets = {}
    if best.host_budget is not None and best.host_budget < machine.host_bytes:
        budgets["host_bytes"] = best.host_budget
    if best.device_budget is not None and best.device_budget < machine.device_bytes:
        budgets["device_bytes"] = best.device_budget
    if budgets:
        offload["budgets"] = budgets
    return {"precision": args.precision, "zero": {"stage": 3}, "offload": offload}


def run_plan(args: argparse.Namespace) -> int:
    if args.write:  # before minutes of dry runs, not after them
        parent = os.path.dirname(os.path.abspath(args.write))
        if not os.path.isdir(parent):
            raise FileNotFoundError(errno.ENOENT, f"--write: directory {parent} does not "
                                    "exist; create it or name a file in an existing one",
                                    args.write)
    try:
        for flag in ("world_size", "seq_len", "micro_batch", "grad_accum"):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')}", f"{getattr(args, flag)} is "
                                  "not allowed; allowed: an integer >= 1")
        if args.master_precision == "bf16" and args.precision != "bf16":
            raise ConfigError("--master-precision", f"bf16 needs --precision bf16, not "
                              f"{args.precision} (the bf16 compute copy is the master); "
                              "allowed with it: fp32")
        shape = model_shape(args.model, layers=args.layers)
        machine, notes = detect_machine(args)
        cache = _bytes("--max-in-cpu", args.max_in_cpu) or 0
        plans = plan_all(shape, machine, world_size=args.world_size, precision=args.precision,
                         nvme_path=args.nvme_path, max_in_cpu_bytes=cache,
                         seq_len=args.seq_len, micro_batch=args.micro_batch,
                         state_precision=args.state_precision, grad_accum=args.grad_accum,
                         master_precision=args.master_precision)
        placements = precision_placements(shape, machine, plans, world_size=args.world_size,
                                          precision=args.precision, nvme_path=args.nvme_path,
                                          max_in_cpu_bytes=cache, chosen=args.state_precision,
                                          grad_accum=args.grad_accum,
                                          master_precision=args.master_precision)
    except (ConfigError, ModelError) as exc:
        sys.stderr.write(f"tierzero plan: error: {exc}\n")
        return 1
    text = render(shape, plans, machine, args, notes, placements=placements)
    best = recommend(plans, machine)
    if best is None:
        sys.stdout.write(text + "\n")
        sys.stderr.write("tierzero plan: error: the model fits under no offload choice within "
                         "the machine (see above); give the machine more memory or NVMe "
                         "space, or more ranks (--world-size)\n")
        return 1
    config = recommended_config(best, args, machine)
    text += f"\nrecommended: offload {best.choice}\n" + yaml.safe_dump(config, sort_keys=False)
    if args.write:
        write_atomic(args.write, yaml.safe_dump(config, sort_keys=False).encode(), 0o600)
        text += f"written: {args.write}\n"
    sys.stdout.write(text)
    return 0
