"""Overlap efficiency of the tier manager's prefetch queue.

Streams shards homed on NVMe through host to the device tier while a consumer
computes on each one, the way forward streams parameters. Four modes run
interleaved, ``--repeats`` times each, and medians are compared:

  io       prefetch on, no compute: the transfer pipeline alone   (I/O time)
  compute  the same compute on device-resident tensors, no I/O    (compute time)
  serial   no prefetch: fetch, wait, compute, one shard at a time (baseline)
  overlap  prefetch on, with compute                              (measured)

  efficiency = max(io, compute) / overlap        (target >= 0.9)

Compute per shard is calibrated so compute time ~= I/O time (``--balance``),
the case where overlap matters most. On CUDA the compute is matmuls on the GPU;
on a CPU-only machine the "device" tier is CPU memory and compute is torch CPU
work. Results go to ``--out`` as JSON.

  .venv/bin/python benchmarks/prefetch_bench.py --quick
  .venv/bin/python benchmarks/prefetch_bench.py --total-gib 4 --shard-mib 64
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages

from machine import describe

from tierzero.offload import (
    Budgets,
    PoolSettings,
    PrefetchSettings,
    ShardSpec,
    TierManager,
    TierSettings,
)
from tierzero.swap import SwapStore

MiB = 1 << 20



class Work:
    """Fixed compute per shard: matmuls over ``rows`` rows of the shard viewed as (R, 256)."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.device = device
        self.cols = 256
        self.weight = torch.randn(self.cols, self.cols, device=device) / 16
        self.rows = numel // self.cols  # rows processed per call (may exceed R: wraps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.view(-1, self.cols)  # (R, 256)
        acc = torch.zeros((), device=self.device)
        left = self.rows
        while left > 0:
            chunk = m[: min(left, m.shape[0])]
            acc += (chunk @ self.weight).sum()  # reads the shard, real FLOPs
            left -= chunk.shape[0]
        return acc

    def calibrate(self, sample: torch.Tensor, seconds: float) -> None:
        """Pick ``rows`` so one call takes about ``seconds``."""
        self.rows = sample.numel() // self.cols
        self(sample)
        sync(self.device)
        start = time.perf_counter()
        for _ in range(3):
            self(sample)
        sync(self.device)
        per_call = (time.perf_counter() - start) / 3
        self.rows = max(1, round(self.rows * seconds / per_call))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(mgr: TierManager, keys: list[str], work: Work | None, *, prefetch: bool,
        serial: bool) -> float:
    """Stream every shard to the device tier; return seconds."""
    if prefetch:
        mgr.set_order([(k, "device") for k in keys])
    sync(mgr.device)
    start = time.perf_counter()
    for key in keys:
        view = mgr.fetch(key, "device").wait()
        if work is not None:
            work(view)
            if serial:
                sync(mgr.device)
        mgr.release(key)
        mgr.evict(key)  # done with it: free device and host room at once
    sync(mgr.device)
    elapsed = time.perf_counter() - start
    mgr.set_order([])
    mgr.synchronize()
    return elapsed


def compute_only(work: Work, sample: torch.Tensor, n: int) -> float:
    sync(work.device)
    start = time.perf_counter()
    for _ in range(n):
        work(sample)
    sync(work.device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="256 MiB in 16 MiB shards, 3 repeats")
    ap.add_argument("--total-gib", type=float, default=4.0)
    ap.add_argument("--shard-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--balance", type=float, default=1.0, help="compute time / I/O time")
    ap.add_argument("--nvme-ahead-shards", type=int, default=8)
    ap.add_argument("--device-ahead-shards", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads for compute (default: all but one core)")
    ap.add_argument("--swap-dir", default=None, help="default: a temporary dir under bench_out/")
    ap.add_argument("--out", default="bench_out/prefetch_bench.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.total_gib, args.shard_mib = 0.25, 16
    logging.basicConfig(level=logging.WARNING)
    # leave a core to the copy and I/O threads on CPU-only machines
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))
    shard_bytes = args.shard_mib * MiB
    n = max(2, int(args.total_gib * 1024 / args.shard_mib))
    numel = shard_bytes // 4
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    swap_root = args.swap_dir or str(Path(args.out).parent)
    info = describe(swap_root)
    print("machine:", json.dumps(info))
    print(f"streaming {n} shards x {args.shard_mib} MiB = {n * shard_bytes / 2**30:.2f} GiB, "
          f"device tier {device}")
    specs = [ShardSpec(f"s{i}", "param", numel, torch.float32) for i in range(n)]
    settings = TierSettings(
        homes={"param": "nvme"}, device="cuda" if cuda else "cpu",
        budgets=Budgets(device=(args.device_ahead_shards + 4) * shard_bytes,
                        host=(args.nvme_ahead_shards + args.device_ahead_shards + 6) * shard_bytes,
                        nvme=None, nvme_reserve=0),
        pool=PoolSettings(),
        prefetch=PrefetchSettings(nvme_bytes=args.nvme_ahead_shards * shard_bytes,
                                  device_bytes=args.device_ahead_shards * shard_bytes),
        swap_path=swap_root)
    results: dict[str, list[float]] = {"io": [], "compute": [], "serial": [], "overlap": []}
    with tempfile.TemporaryDirectory(dir=swap_root) as tmp, \
            SwapStore(tmp, block_size=4 * MiB, queue_depth=8, threads=4) as store, \
            TierManager(specs, settings, swap=store) as mgr:
        print("placing shards on NVMe ...", flush=True)
        for spec in specs:
            mgr.place(spec.key, torch.full((numel,), 0.5)).wait()
        mgr.synchronize()
        keys = [s.key for s in specs]
        work = Work(numel, device)
        sample = torch.full((numel,), 0.5, device=device)
        io_time = run(mgr, keys, None, prefetch=True, serial=False)  # warm-up + calibration
        work.calibrate(sample, args.balance * io_time / n)
        print(f"warm-up I/O {io_time:.3f} s; compute calibrated to {work.rows} rows/shard",
              flush=True)
        modes: dict[str, Callable[[], float]] = {
            "io": lambda: run(mgr, keys, None, prefetch=True, serial=False),
            "compute": lambda: compute_only(work, sample, n),
            "serial": lambda: run(mgr, keys, work, prefetch=False, serial=True),
            "overlap": lambda: run(mgr, keys, work, prefetch=True, serial=False),
        }
        for r in range(args.repeats):
            for name, fn in modes.items():
                results[name].append(fn())
            print(f"repeat {r}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in results.items()),
                  flush=True)
        report = mgr.memory_report()
    med = {k: statistics.median(v) for k, v in results.items()}
    ideal = max(med["io"], med["compute"])
    out = {
        "bench": "prefetch", "machine": info, "quick": args.quick,
        "shards": n, "shard_bytes": shard_bytes, "total_bytes": n * shard_bytes,
        "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
        "compute_rows_per_shard": work.rows, "seconds": results,
        "median_s": med, "ideal_s": ideal,
        "efficiency": ideal / med["overlap"],
        "speedup_vs_serial": med["serial"] / med["overlap"],
        "io_gib_per_s": n * shard_bytes / 2**30 / med["io"],
        "report": {"peak": report.peak, "budget": report.budget, "stall_s": report.stall_s,
                   "hits": report.hits, "misses": report.misses,
                   "pool_peak_in_use": report.pool_peak_in_use,
                   "pool_buffers": report.pool_buffers},
    }
    print(f"median: io {med['io']:.3f} s, compute {med['compute']:.3f} s, serial "
          f"{med['serial']:.3f} s, overlap {med['overlap']:.3f} s")
    print(f"overlap efficiency {out['efficiency']:.3f} (ideal {ideal:.3f} s), "
          f"{out['speedup_vs_serial']:.2f}x vs serial, I/O {out['io_gib_per_s']:.2f} GiB/s")
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
