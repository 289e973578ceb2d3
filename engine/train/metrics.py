"""Per-step metrics of `tierzero train`: the record, its log line, the JSONL file.

[Note: metrics file] One JSON object per line. The first has "event": "run"
(model, parameter count, units, config, machine), then one "event": "step"
per optimizer step with the fields of StepRecord, and a last "event": "end"
with the summary. Every byte figure is an int, every time is seconds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import IO, Any, Protocol

import psutil
import torch

from tierzero.engine.config import Config
from tierzero.engine.config.native import as_dict
from tierzero.swap import trace
from tierzero.swap.safe_files import OutputModes, create_new, make_output_dir

TIERS = ("device", "host", "nvme")


@dataclass(frozen=True)
class StepRecord:
    step: int  # 1-based optimizer step
    loss: float  # mean over micro-steps (and ranks)
    lr: float
    # global L2 norm of the gradients before clipping, unscaled (Hugging Face's grad_norm;
    # ZeroEngine.get_global_grad_norm), with clipping on or off; None (null in the file)
    # when the step was skipped: fp16 overflow, or the norm was not finite
    grad_norm: float | None
    # the factor clipping applied to the gradients: 1.0 when it did not (or is off)
    clip_coef: float | None
    tokens: int  # tokens consumed by this step over all ranks
    tokens_per_s: float
    step_s: float  # wall time of the whole step
    compute_s: float  # forward + backward, minus the gather waits
    # gathering units, forward and backward and the re-gathers of persistent units at the
    # step's end (NVMe reads and copies included)
    wait_s: float
    # the optimizer's time exposed: the training thread in step() less its gathers (a step
    # begun during backward finished, measurements waited for) and forward's waits for a
    # unit's deferred update before its gather
    optimizer_s: float
    # seconds the optimizer's worker thread (CPU Adam, gradient measurements) ran during
    # this step while the training thread was not waiting for it: hidden under compute,
    # not part of step_s = compute_s + wait_s + optimizer_s. Measured from the worker's
    # intervals and the training thread's waits (OverlapClock, engine/step/worker_time.py)
    optimizer_hidden_s: float
    # every second the worker ran during this step, hidden or waited for (>= hidden)
    optimizer_worker_s: float
    tier_bytes: dict[str, int]  # tier -> bytes held on this rank now
    tier_peak_bytes: dict[str, int]  # tier -> peak so far
    nvme_read_bytes: int  # this process's block-device reads during the step
    nvme_written_bytes: int
    nvme_read_gbps: float
    nvme_write_gbps: float
    rss_bytes: int  # resident memory of this process
    # the tier manager's transfers during the step, bytes per direction (nvme_to_host,
    # host_to_nvme, host_to_device, device_to_host; all 0 without offloading)
    moved_bytes: dict[str, int]
    io_stall_s: float  # any thread blocked on a tier transfer it needed (fetch, room)
    # where the gradient shards live: "host", "nvme", "host+nvme" (None: not offloaded)
    grad_home: str | None = None
    # how this step's optimizer update ran (StepDriver.last_update): "step", "backward",
    # "deferred" (into the next forward), "speculated" (during backward, committed: [Note:
    # speculated step]), "undone" (speculated, then undone and deferred); None: skipped
    update: str | None = None
    # the cores this process ran on over the step (its CPU seconds, every thread, over
    # step_s), and the cores a VM's hypervisor took from the CPUs it may run on meanwhile
    # (/proc/stat's steal; None where the kernel does not count it, 0 off a VM): a step
    # whose cpu_cores stays below the cores it has while steal_cores is high is short of
    # CPU the machine did not give (a VM's host serving its disk on the VM's cores)
    cpu_cores: float | None = None
    steal_cores: float | None = None

    def as_json(self) -> dict[str, Any]:
        out = {"event": "step", **dataclasses.asdict(self)}
        if self.grad_norm is not None and not math.isfinite(self.grad_norm):
            out["grad_norm"] = None  # strict JSON has no NaN / Infinity
        return out


def tier_bytes(report: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """(current, peak) bytes per tier from `engine.memory_report()`.

    A report with a "tiers" entry (the tier manager's MemoryReport, or its dict
    form) is read as is. Without one every shard and gathered parameter is in
    the engine's device memory (CPU memory on a CPU-only machine), because the
    engine does not route shards through the tiers yet.
    """
    tiers = report.get("tiers")
    if tiers is not None:
        current = tiers["current"] if isinstance(tiers, dict) else tiers.current
        peak = tiers["peak"] if isinstance(tiers, dict) else tiers.peak
        return ({t: int(current.get(t, 0)) for t in TIERS}, {t: int(peak.get(t, 0)) for t in TIERS})
    shards = int(report["shard_bytes_total"])
    now = dict.fromkeys(TIERS, 0)
    peak = dict.fromkeys(TIERS, 0)
    now["device"] = shards + int(report["gathered_bytes"])
    peak["device"] = shards + int(report["gathered_peak_bytes"])
    return now, peak


class DiskCounter:
    """Bytes this process read from and wrote to block devices (Linux /proc/self/io).

    Counts what really reached the disk (page-cache hits are not reads), which
    is what NVMe offload costs; None where the platform has no I/O counters.
    """

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._last = self._read()

    def _read(self) -> tuple[int, int] | None:
        try:
            io = self._proc.io_counters()  # type: ignore[attr-defined,unused-ignore]
        except (AttributeError, psutil.Error, NotImplementedError):
            return None
        return int(io.read_bytes), int(io.write_bytes)

    def delta(self) -> tuple[int, int]:
        now = self._read()
        if now is None or self._last is None:
            return 0, 0
        read, written = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        return read, written

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)


class CpuCounter:
    """Per-step deltas of this process's CPU seconds (every thread) and of the steal of
    the CPUs it may run on (swap.trace.steal_seconds; None where not counted)."""

    def __init__(self) -> None:
        self._cpus = os.sched_getaffinity(0)
        self._last = self._read()

    def _read(self) -> tuple[float, float | None]:
        return time.process_time(), trace.steal_seconds(self._cpus)

    def delta(self) -> tuple[float, float | None]:
        now = self._read()
        cpu = now[0] - self._last[0]
        steal = None if now[1] is None or self._last[1] is None else now[1] - self._last[1]
        self._last = now
        return cpu, steal


DIRECTIONS = ("nvme_to_host", "host_to_nvme", "host_to_device", "device_to_host")


class TierCounter:
    """Per-step deltas of the tier manager's moved bytes and stall seconds."""

    def __init__(self, report: dict[str, Any]) -> None:
        self._last = self._read(report)

    @staticmethod
    def _read(report: dict[str, Any]) -> tuple[dict[str, int], float]:
        tiers = report.get("tiers")
        if tiers is None:
            return dict.fromkeys(DIRECTIONS, 0), 0.0
        moved = tiers["moved"] if isinstance(tiers, dict) else tiers.moved
        stall = tiers["stall_s"] if isinstance(tiers, dict) else tiers.stall_s
        return {d: int(moved.get(d, 0)) for d in DIRECTIONS}, float(stall)

    def delta(self, report: dict[str, Any]) -> tuple[dict[str, int], float]:
        now = self._read(report)
        moved = {d: now[0][d] - self._last[0][d] for d in DIRECTIONS}
        stall = now[1] - self._last[1]
        self._last = now
        return moved, stall


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def optimizer_split(r: StepRecord) -> str:
    """The optimizer's time hidden under compute against the time the step waited for it:
    "optimizer hidden 0.040 s of 0.045 s on its worker, 80 % of optimizer time hidden"."""
    shown = r.optimizer_hidden_s + r.optimizer_s
    share = 100.0 * r.optimizer_hidden_s / shown if shown > 0 else 0.0
    return (f"optimizer hidden {r.optimizer_hidden_s:.3f} s of {r.optimizer_worker_s:.3f} s "
            f"on its worker, {share:.0f} % of optimizer time hidden")


def grad_text(r: StepRecord) -> str:
    """ "grad norm 1.2345, clip coef 0.810" ("skipped" when the step was)."""
    if r.grad_norm is None or r.clip_coef is None:
        norm = "skipped" if r.grad_norm is None else f"{r.grad_norm}, step skipped"
        return f"grad norm {norm}"
    return f"grad norm {r.grad_norm:.4f}, clip coef {r.clip_coef:.3f}"


def log_line(r: StepRecord, total_steps: int) -> str:
    # per tier: bytes now / peak
    tiers = ", ".join(f"{t} {human_bytes(r.tier_bytes[t])}/{human_bytes(r.tier_peak_bytes[t])}"
                      for t in TIERS)
    return (f"step {r.step}/{total_steps} | loss {r.loss:.4f} | lr {r.lr:.2e} | "
            f"{grad_text(r)} | "
            f"{r.tokens_per_s:,.0f} tok/s | {r.step_s:.3f} s = compute {r.compute_s:.3f} + "
            f"wait {r.wait_s:.3f} + optimizer {r.optimizer_s:.3f} exposed | "
            f"{optimizer_split(r)} | now/peak {tiers} | "
            f"nvme read {r.nvme_read_gbps:.2f} GB/s write {r.nvme_write_gbps:.2f} GB/s | "
            f"swap in/out {human_bytes(r.moved_bytes['nvme_to_host'])}/"
            f"{human_bytes(r.moved_bytes['host_to_nvme'])}, io stall {r.io_stall_s:.3f} s"
            + (f" | cpu {r.cpu_cores:.2f} cores" if r.cpu_cores is not None else "")
            + (f", steal {r.steal_cores:.2f}" if r.steal_cores else "")
            + (f" | grads {r.grad_home}" if r.grad_home else "")
            + (f" | update {r.update}" if r.update else ""))


class EventSink(Protocol):
    """Another output of the metrics events (TensorBoard: engine/train/tensorboard.py)."""

    def write(self, event: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsWriter:
    """Appends JSON lines and flushes each, so a crashed run keeps what it measured; hands
    every event to `also` too (train.report_to)."""

    def __init__(self, path: str, modes: OutputModes | None = None,
                 also: EventSink | None = None) -> None:
        self._also = also
        modes = modes or OutputModes()
        parent = os.path.dirname(path)
        if parent:
            make_output_dir(parent, modes)
        self.path = path
        # A new file of ours, never written through a planted link ([Note: output files]).
        self._file: IO[str] | None = os.fdopen(create_new(path, modes.file), "w",
                                               encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise RuntimeError(f"metrics file {self.path} is closed")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._also is not None:
            self._also.write(record)

    def close(self) -> None:
        try:
            if self._also is not None:
                self._also.close()
        finally:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_event(config: Config, model: str, n_params: int, *, units: int, world: int,
              source: str, start_step: int = 0, tokenizer: str = "bytes",
              mode: str = "windows", eval_source: str | None = None) -> dict[str, Any]:
    """The first event of the metrics file ([Note: metrics file]): model, config, machine."""
    tree = as_dict(config)
    for key in ("source", "ignored_keys", "ignored_reasons", "run_length_auto"):
        tree.pop(key, None)
    return {"event": "run", "started": datetime.now(timezone.utc).isoformat(),
            "model": model, "parameters": n_params, "units": units, "world_size": world,
            "start_step": start_step,
            "dataset": source, "tokenizer": tokenizer, "data_mode": mode,
            "eval_dataset": eval_source, "config": tree,
            "machine": {"cpu": platform.processor() or platform.machine(),
                        "cores": os.cpu_count(), "torch": torch.__version__,
                        "cuda": torch.cuda.is_available()}}


def end_event(records: list[StepRecord], evals: list[dict[str, Any]],
              stopped_by: str | None = None) -> dict[str, Any]:
    """The last event of the metrics file: the run's summary."""
    stopped = {} if stopped_by is None else {"stopped_by": stopped_by}
    if not records:
        return {"event": "end", "steps": 0, **stopped}
    losses = {"first_eval_loss": evals[0]["eval_loss"],
              "last_eval_loss": evals[-1]["eval_loss"]} if evals else {}
    return {"event": "end", **stopped, "steps": len(records), **losses,
            "first_loss": records[0].loss,
            "last_loss": records[-1].loss,
            "mean_tokens_per_s": sum(r.tokens for r in records) / sum(r.step_s for r in records),
            "total_s": sum(r.step_s for r in records),
            "wait_s": sum(r.wait_s for r in records),
            "nvme_read_bytes": sum(r.nvme_read_bytes for r in records),
            "nvme_written_bytes": sum(r.nvme_written_bytes for r in records)}
