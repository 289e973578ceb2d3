"""Runs a memory-measuring child script (tests/*_child.py) in a fresh interpreter, so its
peak RSS is its own, and returns the JSON it prints. Shared by the ~100M-parameter memory
tests; MALLOC_MMAP_THRESHOLD_ = 1 MiB for the reason given in test_engine_offload_memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


def run_memory_child(script: str, *args: object) -> dict[str, Any]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MiB), OMP_NUM_THREADS="2",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / script), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout))
