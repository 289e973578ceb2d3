"""CPU Adam kernel throughput per offload.optimizer.state_precision (offload/_adam_kernel.c).

One shard of --numel elements, bf16 gradient in, bf16 param out (the offloaded step's
operands), moments fp32 / bf16 / int8; the choices interleaved, median of --repeats.
Bytes per element touched: fp32 28, bf16 20, int8 ~16. `--masters fp32,bf16` adds rows
with offload.optimizer.master_precision bf16: the bf16 param is the master, read and
written (rounded stochastically) instead of the fp32 master read and written and the
param written: 6 bytes less per element. With one thread the kernel runs on the calling
thread, so its thread CPU time is reported too ("cpu"): on a shared, loaded
machine wall time mostly measures waiting for a core, CPU time what the kernel costs.

    python benchmarks/state_kernel_bench.py --numel 16777216 --threads 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from tierzero.offload import AdamHyper, AdamThreads, adam_update
from tierzero.offload import state_codec as sc
from tierzero.offload.bf16_master import master_key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--masters", default="fp32",
                    help="master precisions: fp32 (fp32 master + bf16 param out), bf16")
    args = ap.parse_args()
    n = args.numel
    p = torch.randn(n)
    g = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    shadow = torch.empty(n, dtype=torch.bfloat16)
    p16 = p.to(torch.bfloat16)
    masters = args.masters.split(",")
    state = {f"{prec}{'+bf16master' if m == 'bf16' else ''}": (
                 (torch.zeros(n), torch.zeros(n)) if prec == "fp32" else
                 (torch.zeros(sc.moment_nbytes(n, prec), dtype=torch.uint8),
                  torch.zeros(sc.moment_nbytes(n, prec), dtype=torch.uint8)))
             for m in masters for prec in sc.STATE_PRECISIONS}
    hyper = AdamHyper(lr=1e-4, weight_decay=0.01)
    out = {"numel": n, "loadavg": os.getloadavg(), "rows": []}
    for t in (int(x) for x in args.threads.split(",")):
        pool = AdamThreads(t) if t > 1 else None
        times: dict[str, list[float]] = {prec: [] for prec in state}
        cpu: dict[str, list[float]] = {prec: [] for prec in state}
        for r in range(args.repeats + 1):
            for name, (m, v) in state.items():
                prec, bf16 = name.removesuffix("+bf16master"), name.endswith("bf16master")
                t0, c0 = time.perf_counter(), time.thread_time()
                adam_update(p16 if bf16 else p, m, v, g, hyper=hyper, step=r + 1,
                            shadow=None if bf16 else shadow, threads=pool, state=prec,
                            master_key=master_key(r + 1, 7) if bf16 else None)
                prec = name
                if r:  # the first round warms up
                    times[prec].append(time.perf_counter() - t0)
                    cpu[prec].append(time.thread_time() - c0)
        if pool is not None:
            pool.close()
        for prec, ts in times.items():
            s = statistics.median(ts)
            row = {"threads": t, "state": prec, "median_s": s, "gparams_per_s": n / s / 1e9}
            line = f"threads {t} {prec:15s} {s * 1e3:8.1f} ms  {n / s / 1e9:.3f} G params/s"
            if pool is None:  # one thread: the kernel ran on this thread
                row["cpu_median_s"] = statistics.median(cpu[prec])
                line += f"  cpu {row['cpu_median_s'] * 1e3:.1f} ms"
            out["rows"].append(row)
            print(line, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
