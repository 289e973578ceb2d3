"""Report code shared by step_bench and scale_bench: medians over rounds and the printed
lines, for rows of either engine.

tierzero's children and DeepSpeed's (ds_runner.py, scale_bench's DeepSpeed child) write rows
with different fields: DeepSpeed has no `hidden_s` (its optimizer step does not run beside
compute), no tier split, and its own `swap_file_bytes` / `ds_zero`; a killed child has no
phases at all. Every formatter here reads each field with `.get` and prints NA for one a row
does not carry, so a report never stops on a row of the other shape. Standard library only:
tests/test_bench_report.py imports it without torch or DeepSpeed.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable
from typing import Any

NA = "n/a"
GiB = 1 << 30


def num(row: dict[str, Any], key: str, spec: str, scale: float = 1.0) -> str:
    """`row[key] / scale` formatted with `spec`, or NA when the row has no number there."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return NA
    return format(value / scale, spec)


def drive_seconds(read: float, written: float, read_gbps: float, write_gbps: float,
                  mixed_gbps: float) -> float:
    """The least time a drive needs to read `read` and write `written` bytes, given its
    GB/s reading alone, writing alone and doing both at once (reads and writes share it)."""
    return max(read / (read_gbps * 1e9), written / (write_gbps * 1e9),
               (read + written) / (mixed_gbps * 1e9))


def fastest_drive(*measured: dict[str, float]) -> dict[str, float]:
    """Each GB/s field of several measurements of one drive (before and after a row) at
    its highest: a bound from it is the least time the drive could have needed at any of
    those moments, so a drive that drifts during a row does not flatter the row."""
    fields = ("read_gbps", "write_gbps", "mixed_gbps", "deep_mixed_gbps")
    return {k: max(m[k] for m in measured) for k in fields if all(k in m for m in measured)}


def steal_seconds(cpus: Iterable[int], stat_text: str | None = None) -> float | None:
    """Seconds the hypervisor ran something else while `cpus` (this VM's vCPUs) had work to
    run, summed over those CPUs since boot: the `steal` column of /proc/stat's per-CPU
    lines (the eighth number, in clock ticks). None where /proc/stat has no such column
    (not Linux, or a kernel without it); 0 on a machine that is not a VM. A difference of
    two readings is the CPU time the VM lost between them: on a VM whose host serves its
    disk on the same physical cores, that time is gone from the step's CPU work. (The
    engine reads the same column through swap.trace.steal_ticks; this copy stays in the
    standard library for DeepSpeed's child, which runs without tierzero.)"""
    if stat_text is None:
        try:
            with open("/proc/stat") as f:
                stat_text = f.read()
        except OSError:
            return None
    want = {f"cpu{c}" for c in cpus}
    ticks, seen = 0, 0
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] in want:
            if len(fields) < 9:
                return None
            ticks += int(fields[8])
            seen += 1
    if seen != len(want):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def median_row(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a configuration's rounds: a field with numbers is their median over
    the rounds that have one (None in the others, as an overlap without a bound), anything
    else (names, dicts) is the first round's; `disk` is left out."""
    keys: dict[str, None] = {}
    for r in rounds:
        keys.update(dict.fromkeys(r))
    out: dict[str, Any] = {}
    for k in keys:
        if k == "disk":
            continue
        values = [r[k] for r in rounds if k in r]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        out[k] = statistics.median(numbers) if numbers else values[0]
    return out


def step_line(model: str, config: str, m: dict[str, Any], *, gpu: bool = False) -> str:
    """step_bench's printed line for one median row, of a tierzero or a DeepSpeed child."""
    rounds = m.get("step_s_rounds") or []
    return (f"{model:4s} {config:9s} step {num(m, 'step_s', '.3f')}s "
            f"(x{num(m, 'vs_plain', '.2f')} plain)"
            f" fwd+bwd {num(m, 'fwd_bwd_s', '.3f')}s opt {num(m, 'opt_s', '.3f')}s"
            f" adam {num(m, 'adam_s', '.3f')}s hidden {num(m, 'hidden_s', '.3f')}"
            f" nvme r/w {num(m, 'nvme_read_per_step', '.0f', 1e6)}/"
            f"{num(m, 'nvme_write_per_step', '.0f', 1e6)} MB/step"
            f" io {num(m, 'nvme_io_s', '.3f')}s overlap {num(m, 'overlap_eff', '.2f')}"
            f" peakRSS {num(m, 'peak_rss_process', '.0f', 2**20)}"
            f"/{num(m, 'peak_rss_train', '.0f', 2**20)} MiB"
            + (f" peakGPU {num(m, 'peak_gpu_bytes', '.0f', 2**20)} MiB" if gpu else "")
            + " rounds " + ("/".join(f"{x:.3f}" for x in rounds) or NA)
            + (f" FAILED: {str(m['failed']).strip().splitlines()[-1][:200]}"
               if m.get("failed") else ""))


# -- scale_bench ----------------------------------------------------------------------------
def stopped_text(row: dict[str, Any]) -> str | None:
    """"stopped at N GB during <phase> (why)" for a child the parent's watchdog killed,
    None for one that finished or failed on its own."""
    why = row.get("killed")
    if why is None:
        return None
    peak = row.get("peak_rss_wait4") or row.get("rss_trace_max") or 0
    phase = row.get("killed_phase") or "an unknown phase"
    return f"stopped at {peak / 1e9:.1f} GB during {phase} ({why})"


def scale_result(row: dict[str, Any]) -> str:
    """One scale_bench row's outcome in words."""
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    stopped = stopped_text(row)
    if stopped is not None:
        return stopped
    if "failed" in row:
        last = [line for line in str(row["failed"]).splitlines() if line.strip()][-1:]
        return f"failed: {last[0][:200] if last else '?'}"
    steps = [p for p in row.get("phases", []) if str(p.get("phase", "")).startswith("step")]
    return f"finished {len(steps)} step(s)"


def _phase_peak(row: dict[str, Any], name: str) -> str:
    phases = row.get("phases") or [
        p for p in row.get("partial", []) if isinstance(p, dict)]
    found = [p for p in phases if p.get("phase") == name]
    return num(found[0], "peak_growth", ".2f", 1e9) if found else NA


def scale_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows: every engine's row of one scale_bench run, finished or not."""
    out = ["| row | result | peak RSS (whole child) | build peak growth | initialize peak "
           "growth | step s | NVMe read / written per step | swap bytes |",
           "| --- | --- |" + " ---: |" * 6]
    for name, row in rows.items():
        s = row.get("summary") or {}
        rw = (f"{num(s, 'nvme_read_per_step', '.2f', 1e9)} / "
              f"{num(s, 'nvme_written_per_step', '.2f', 1e9)} GB")
        out.append(f"| {name} | {scale_result(row)} | {num(row, 'peak_rss_wait4', '.2f', 1e9)} GB"
                   f" | {_phase_peak(row, 'build')} GB | {_phase_peak(row, 'initialize')} GB"
                   f" | {num(s, 'step_s', '.1f')} | {rw} "
                   f"| {num(row, 'swap_file_bytes', '.2f', 1e9)} GB |")
    return out
