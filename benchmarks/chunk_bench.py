"""The NVMe-bound streamed CPU Adam step (offload.AdamStream) with the optimizer state in
whole shards (before issue 15) and in pieces of offload.optimizer.chunk_numel (after), same
run, same swap directory, interleaved rounds, medians.

Per step every shard's master and moments (12 B/param) are read from NVMe and written back
with the new bf16 param (14 B/param); the gradient lives in host memory. Reported per
setting: median step seconds, its ratio to the whole-shard step, the host ring (what the
chunking is for), and the disk's own read+write time for the same bytes measured in the run
(a SwapStore write then read of the same total, no compute).

    python benchmarks/chunk_bench.py --swap /var/tmp --shards 6 --numel 4000000 \
        --chunks 0,1048576,262144 --rounds 3 --out bench_out/chunk_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tierzero.offload import AdamHyper, AdamStream, ShardSpec, TierManager, TierSettings
from tierzero.offload.settings import STATE_CLASSES as STATE
from tierzero.offload.settings import Budgets, PoolSettings, PrefetchSettings
from tierzero.swap import SwapStore, aligned_empty

HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def pieces(n: int, chunk: int) -> list[tuple[int, int]]:
    if not chunk or n <= chunk:
        return [(0, n)]
    return [(lo, min(n, lo + chunk)) for lo in range(0, n, chunk)]


def run_setting(swap_dir: str, shards: int, numel: int, chunk: int, steps: int
                ) -> tuple[list[float], int]:
    whole = [{"grad": f"g{i}", "param": f"p{i}"} for i in range(shards)]
    chunks = [[(lo, hi, {c: f"{c}{i}@{lo}" for c in STATE}) for lo, hi in pieces(numel, chunk)]
              for i in range(shards)]
    specs = [ShardSpec(f"g{i}", "grad", numel, torch.float32) for i in range(shards)]
    specs += [ShardSpec(f"p{i}", "param", numel, torch.bfloat16) for i in range(shards)]
    specs += [ShardSpec(k[c], c, hi - lo, torch.float32)  # type: ignore[arg-type]
              for cs in chunks for lo, hi, k in cs for c in STATE]
    homes = {"master": "nvme", "exp_avg": "nvme", "exp_avg_sq": "nvme", "grad": "cpu",
             "param": "nvme"}
    settings = TierSettings(homes=homes,  # type: ignore[arg-type]
                            budgets=Budgets(device=1 << 30, host=8 << 30, nvme=1 << 40),
                            pool=PoolSettings(buffer_count=2), prefetch=PrefetchSettings(),
                            device="cpu")
    with tempfile.TemporaryDirectory(dir=swap_dir) as d, SwapStore(d) as swap:
        mgr = TierManager(specs, settings, swap=swap)
        try:
            init = torch.randn(numel)
            for i in range(shards):
                mgr.place(f"g{i}", init).wait()
                mgr.place(f"p{i}", init.bfloat16()).wait()
                for lo, hi, k in chunks[i]:
                    for c in STATE:
                        mgr.place(k[c], init[lo:hi]).wait()
            mgr.synchronize()
            ring = 4 * sum(3 * 4 * (hi - lo) for cs in chunks for lo, hi, _ in cs) // sum(
                len(cs) for cs in chunks)
            stream = AdamStream(mgr, whole, [numel] * shards, buffer_bytes=ring,
                                shadow=torch.bfloat16, chunks=chunks)
            times = []
            try:
                for step in range(1, steps + 2):  # the first step warms the read-ahead
                    t = time.perf_counter()
                    stream.step(HYPER, float(step))
                    stream.wait_idle()  # the writes landed: the step's whole disk time
                    if step > 1:
                        times.append(time.perf_counter() - t)
                buffer_bytes = stream.buffer_bytes
            finally:
                stream.close()
        finally:
            mgr.close()
    return times, buffer_bytes


def disk_only(swap_dir: str, shards: int, numel: int) -> float:
    """Write then read the step's bytes (state + param out, state in) with no compute."""
    out = [aligned_empty((3 * numel,), torch.float32).normal_() for _ in range(shards)]
    p16 = [aligned_empty((numel,), torch.bfloat16).normal_() for _ in range(shards)]
    with tempfile.TemporaryDirectory(dir=swap_dir) as d, SwapStore(d) as swap:
        t = time.perf_counter()
        futs = [swap.write(f"s{i}", out[i]) for i in range(shards)]
        futs += [swap.write(f"p{i}", p16[i]) for i in range(shards)]
        for f in futs:
            f.result()
        reads = [swap.read(f"s{i}", out[i]) for i in range(shards)]
        for f in reads:
            f.result()
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--swap", default="/var/tmp")
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("--numel", type=int, default=4_000_000)
    ap.add_argument("--chunks", default="0,1048576,262144", help="0: whole shards")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chunks = [int(c) for c in args.chunks.split(",")]
    steps: dict[int, list[float]] = {c: [] for c in chunks}
    rings: dict[int, int] = {}
    disk: list[float] = []
    for _ in range(args.rounds):  # interleaved: machine noise hits every setting alike
        disk.append(disk_only(args.swap, args.shards, args.numel))
        for c in chunks:
            t, rings[c] = run_setting(args.swap, args.shards, args.numel, c, args.steps)
            steps[c] += t
    base = statistics.median(steps[chunks[0]])
    result: dict[str, Any] = {
        "shards": args.shards, "numel": args.numel, "rounds": args.rounds,
        "disk_only_s": statistics.median(disk),
        "settings": [{"chunk_numel": c, "step_s": statistics.median(steps[c]),
                      "ratio_to_first": statistics.median(steps[c]) / base,
                      "ring_bytes": rings[c], "steps": steps[c]} for c in chunks]}
    for s in result["settings"]:
        print(f"chunk_numel {s['chunk_numel']:>9}: step {s['step_s']:.3f} s "
              f"(x{s['ratio_to_first']:.2f}), ring {s['ring_bytes'] / 1e6:.1f} MB")
    print(f"disk only (same bytes, no compute): {result['disk_only_s']:.3f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
