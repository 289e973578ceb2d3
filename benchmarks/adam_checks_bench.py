"""Cost of checking every operand before each C Adam kernel call (issue 20).

    .venv/bin/python benchmarks/adam_checks_bench.py            # 7 repeats
    .venv/bin/python benchmarks/adam_checks_bench.py --repeats 3

`run_prepared` checks dtype, device, contiguity, numel and storage size of
master, both moments, grad and shadow on every call (offload/adam_math.py
check_flat). The worst case is CPUAdam over many small parameters, one call
each; the usual case is a few large flat shards. For each shape, CPUAdam.step
runs with the checks and with check_flat replaced by a no-op, interleaved,
one warm-up, medians over --repeats; the ratio is checked / unchecked.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import torch

from tierzero.offload import CPUAdam, adam_kernel

SHAPES = {"many small (512 x 1k)": (512, 1_000), "few large (4 x 4M)": (4, 4_000_000)}


def _step_time(count: int, numel: int, checked: bool) -> float:
    params = [torch.randn(numel, requires_grad=True) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(numel)
    real = adam_kernel.check_flat
    if not checked:
        adam_kernel.check_flat = lambda *a, **k: None  # type: ignore[assignment]
    try:
        with CPUAdam(params, lr=1e-3, threads=1) as opt:
            opt.step()  # warm-up: state allocation, kernel load
            t = time.perf_counter()
            opt.step()
            return time.perf_counter() - t
    finally:
        adam_kernel.check_flat = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench_out/adam_checks_bench.json")
    args = ap.parse_args()
    results: dict[str, Any] = {"machine": {"cpu": platform.processor() or platform.machine(),
                                           "cores": os.cpu_count()}, "shapes": {}}
    for name, (count, numel) in SHAPES.items():
        times: dict[str, list[float]] = {"checked": [], "unchecked": []}
        for _ in range(args.repeats):  # interleaved
            times["unchecked"].append(_step_time(count, numel, checked=False))
            times["checked"].append(_step_time(count, numel, checked=True))
        med = {k: statistics.median(v) for k, v in times.items()}
        per_call_us = (med["checked"] - med["unchecked"]) / count * 1e6
        results["shapes"][name] = {"median_s": med, "ratio": med["checked"] / med["unchecked"],
                                   "check_us_per_call": per_call_us}
        print(f"{name:24s} unchecked {med['unchecked'] * 1e3:8.2f} ms  checked "
              f"{med['checked'] * 1e3:8.2f} ms  ratio {med['checked'] / med['unchecked']:.3f}"
              f"  (~{per_call_us:.1f} us per call)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
