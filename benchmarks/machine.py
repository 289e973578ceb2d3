"""What machine a benchmark ran on: one description shared by every script here.

Scripts run as `python benchmarks/<name>.py`, so this module is importable as
`machine` from them.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def file_system(path: str | Path) -> str:
    """`<fstype> on <device>` for the file system holding `path` (df's view)."""
    out = subprocess.run(["df", "--output=fstype,source", str(path)], capture_output=True,
                         check=False, text=True).stdout.split()
    return f"{out[-2]} on {out[-1]}" if len(out) >= 4 else "unknown"


def describe(path: str | Path | None = None) -> dict[str, object]:
    """CPU, cores, load, torch, GPU, and the file system of `path` when given."""
    load = os.getloadavg()
    info: dict[str, object] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "loadavg_at_start": f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
    }
    if path is not None:
        real = os.path.realpath(path)
        info["path"] = real
        info["file_system"] = file_system(real)
    return info
