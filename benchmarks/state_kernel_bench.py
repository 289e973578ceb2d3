"""CPU Adam kernel throughput per offload.optimizer.state_precision (offload/_adam_kernel.c).

One shard of --numel elements, bf16 gradient in, bf16 param out (the offloaded step's
operands; `--dtype fp16`: fp16 both, as with fp16 compute), moments fp32 / bf16 / int8;
the choices interleaved, median of --repeats.
Bytes per element touched: fp32 28, bf16 20, int8 ~16. `--masters fp32,bf16` adds rows
with offload.optimizer.master_precision bf16: the bf16 param is the master, read and
written (rounded stochastically) instead of the fp32 master read and written and the
param written: 6 bytes less per element. With one thread the kernel runs on the calling
thread, so its thread CPU time is reported too ("cpu"): on a shared, loaded
machine wall time mostly measures waiting for a core, CPU time what the kernel costs.

    python benchmarks/state_kernel_bench.py --numel 16777216 --threads 1,2

`--baseline-source FILE` compares against another version of the kernel in the same
process: FILE (an _adam_kernel.c, e.g. `git show REV:offload/_adam_kernel.c > base.c`) is
compiled with the package's flags (or, a .so, loaded), and every round runs each choice
with both kernels, in alternating order, so drift of a shared machine falls on both
alike. Rows then carry the baseline's median and the median of the per-round ratios
(this kernel / baseline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from tierzero.engine.bench.measure import adam_state_key
from tierzero.offload import AdamHyper, AdamThreads, adam_build, adam_update
from tierzero.offload import adam_kernel as ak
from tierzero.offload import state_codec as sc
from tierzero.offload.bf16_master import master_key


def build_baseline(source: Path, directory: Path) -> adam_build.CompiledKernel:
    """`source` compiled with the flags the package builds its own kernel with (about 20 s),
    loaded; a `.so` (a kernel built before, e.g. from tierzero's cache) is loaded as is."""
    if not source.is_file():
        raise SystemExit(f"--baseline-source {source}: no such file")
    out = source
    if source.suffix != ".so":
        cc = adam_build._compiler()
        if cc is None:
            raise SystemExit("--baseline-source: no C compiler found")
        out = directory / "baseline.so"
        flags = adam_build.BASE_FLAGS + adam_build.ARCH_FLAGS[0]
        proc = subprocess.run([cc, *flags, str(source), "-o", str(out), "-lm"],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"--baseline-source {source}: {cc} failed: {proc.stderr[-2000:]}")
    fd = os.open(out, os.O_RDONLY)
    try:
        return adam_build._load(out, fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def using(kernel: adam_build.CompiledKernel | None) -> Iterator[None]:
    """adam_update runs `kernel` inside (None: the package's own)."""
    if kernel is None:
        yield
        return
    own = ak.compiled_kernel
    ak.compiled_kernel = lambda: kernel  # type: ignore[assignment]
    try:
        yield
    finally:
        ak.compiled_kernel = own  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--masters", default="fp32",
                    help="master precisions: fp32 (fp32 master + bf16 param out), bf16")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16",
                    help="the gradient's and the param copy's dtype (fp16: fp32 masters only)")
    ap.add_argument("--baseline-source", type=Path, default=None,
                    help="another _adam_kernel.c to compare against in the same process")
    args = ap.parse_args()
    if args.dtype == "fp16" and args.masters != "fp32":
        ap.error("--dtype fp16: a bf16 master needs bf16 params; use --masters fp32")
    with tempfile.TemporaryDirectory() as tmp:
        baseline = (build_baseline(args.baseline_source, Path(tmp))
                    if args.baseline_source else None)
        run(args, baseline)


def run(args: argparse.Namespace, baseline: adam_build.CompiledKernel | None) -> None:
    n = args.numel
    p = torch.randn(n)
    low = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    g = (torch.randn(n) * 1e-3).to(low)
    shadow = torch.empty(n, dtype=low)
    p16 = p.to(torch.bfloat16)
    masters = args.masters.split(",")
    state = {adam_state_key(prec, m): (
                 (torch.zeros(n), torch.zeros(n)) if prec == "fp32" else
                 (torch.zeros(sc.moment_nbytes(n, prec), dtype=torch.uint8),
                  torch.zeros(sc.moment_nbytes(n, prec), dtype=torch.uint8)))
             for m in masters for prec in sc.STATE_PRECISIONS}
    hyper = AdamHyper(lr=1e-4, weight_decay=0.01)
    out: dict = {"numel": n, "dtype": args.dtype, "loadavg": os.getloadavg(), "rows": [],
                 "baseline_source": str(args.baseline_source) if baseline else None}
    kernels: list[adam_build.CompiledKernel | None] = [None] + ([baseline] if baseline else [])
    for t in (int(x) for x in args.threads.split(",")):
        pool = AdamThreads(t) if t > 1 else None
        # [kernel index][choice]: seconds per round
        times: list[dict[str, list[float]]] = [{prec: [] for prec in state} for _ in kernels]
        cpu: list[dict[str, list[float]]] = [{prec: [] for prec in state} for _ in kernels]
        for r in range(args.repeats + 1):
            for name, (m, v) in state.items():
                prec, bf16 = name.removesuffix("+bf16master"), name.endswith("bf16master")
                order = list(range(len(kernels)))
                if r % 2:
                    order.reverse()
                for k in order:
                    with using(kernels[k]):
                        t0, c0 = time.perf_counter(), time.thread_time()
                        adam_update(p16 if bf16 else p, m, v, g, hyper=hyper, step=r + 1,
                                    shadow=None if bf16 else shadow, threads=pool, state=prec,
                                    master_key=master_key(r + 1, 7) if bf16 else None)
                        if r:  # the first round warms up
                            times[k][name].append(time.perf_counter() - t0)
                            cpu[k][name].append(time.thread_time() - c0)
        if pool is not None:
            pool.close()
        for prec, ts in times[0].items():
            s = statistics.median(ts)
            row = {"threads": t, "state": prec, "median_s": s, "gparams_per_s": n / s / 1e9}
            line = f"threads {t} {prec:15s} {s * 1e3:8.1f} ms  {n / s / 1e9:.3f} G params/s"
            if pool is None:  # one thread: the kernel ran on this thread
                row["cpu_median_s"] = statistics.median(cpu[0][prec])
                line += f"  cpu {row['cpu_median_s'] * 1e3:.1f} ms"
            if baseline is not None:
                base = times[1][prec]
                row["baseline_median_s"] = statistics.median(base)
                row["ratio_median"] = statistics.median(a / b for a, b in zip(ts, base,
                                                                              strict=True))
                line += (f"  baseline {row['baseline_median_s'] * 1e3:.1f} ms, "
                         f"ratio {row['ratio_median']:.3f}")
                if pool is None:
                    row["cpu_ratio_median"] = statistics.median(
                        a / b for a, b in zip(cpu[0][prec], cpu[1][prec], strict=True))
                    line += f" (cpu {row['cpu_ratio_median']:.3f})"
            out["rows"].append(row)
            print(line, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
