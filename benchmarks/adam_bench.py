"""CPU Adam step: tierzero's one-pass kernel against PyTorch (and DeepSpeed), interleaved.

    .venv/bin/python benchmarks/adam_bench.py            # 100M params, 1 and all threads
    .venv/bin/python benchmarks/adam_bench.py --quick    # 10M params, finishes in ~30 s

Sections, each at 1 thread and at all threads (torch.set_num_threads for the
baselines, an AdamThreads pool of the same size for tierzero):

  plain      fp32 grad in, fp32 master/m/v updated:
             tierzero adam_update (and its pure-PyTorch fallback) vs
             torch.optim.AdamW(foreach=True),
             AdamW(fused=True) and DeepSpeedCPUAdam (if importable).
  offloaded  bf16 grad in, fp32 master/m/v updated, bf16 param out:
             tierzero's single pass vs each baseline plus the conversions it
             needs (grad bf16->fp32 copy before, param fp32->bf16 copy after).
  bandwidth  an in-place streaming kernel (x.mul_(c) over 4 bytes/elt, read +
             write: 8 bytes per element) at the same thread count; the bound of
             a variant is bandwidth / bytes it must touch per parameter
             ("%bound"); and a do-nothing C kernel over exactly the plain /
             offloaded variant's streams (adam_bench_pattern.py), whose time
             over a method's time is "%pattern":
             plain 28 B (read p, m, v, g fp32; write p, m, v), tierzero
             offloaded 28 B (read p, m, v + bf16 g; write p, m, v + bf16 p16),
             baseline offloaded 40 B (plain + 6 B per conversion pass).
  subnormal  moments already subnormal and zero grads (long-unused rows): tierzero
             vs fused AdamW at all threads, params/4 elements.
  nvme       (unless --skip-nvme) the streamed CPU Adam (AdamStream) over swap files in
             --nvme-dir vs the Adam compute alone and the same I/O alone; the
             target is step <= 1.15 x max(adam, disk).

Every repeat runs every method once, in turn (interleaved); reported numbers
are medians over --repeats repeats after one warm-up. Results go to --out as
JSON and are printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adam_bench_nvme import nvme_section
from adam_bench_pattern import load as load_pattern
from adam_bench_pattern import pattern_methods
from machine import describe

from tierzero.offload import AdamHyper, AdamThreads, adam_update, kernel_status

BYTES = {"plain": 28, "tz_offloaded": 28, "baseline_offloaded": 40, "stream": 8}
DEEPSPEED_HINT = ("pip install deepspeed (its DeepSpeedCPUAdam op is JIT-built with a C++ "
                  "compiler on first use; set DS_BUILD_CPU_ADAM=1 to build at install)")



def deepspeed_adam() -> tuple[Any, str]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or a failed op build
        return None, f"deepspeed not importable ({type(exc).__name__}: {exc}); {DEEPSPEED_HINT}"
    return DeepSpeedCPUAdam, "ok"


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def build_methods(n: int, hyper: AdamHyper, pool: AdamThreads
                  ) -> tuple[dict[str, dict[str, Callable[[], None]]], list[str]]:
    """Per section, method name -> one step. Shares p/g tensors; each optimizer owns m/v."""
    notes: list[str] = []
    p = torch.randn(n) * 0.1
    g32 = torch.randn(n) * 1e-3
    g16 = g32.to(torch.bfloat16)
    p16 = torch.empty(n, dtype=torch.bfloat16)
    m, v = torch.zeros(n), torch.zeros(n)
    counter = [0]

    def tz_plain() -> None:
        counter[0] += 1
        adam_update(p, m, v, g32, hyper=hyper, step=counter[0], threads=pool)

    def tz_offloaded() -> None:
        counter[0] += 1
        adam_update(p, m, v, g16, hyper=hyper, step=counter[0], shadow=p16, threads=pool)

    kw = {"lr": hyper.lr, "betas": (hyper.beta1, hyper.beta2), "eps": hyper.eps,
          "weight_decay": hyper.weight_decay}
    param = torch.nn.Parameter(p, requires_grad=True)  # shares p's storage
    param.grad = g32.clone()
    baselines: dict[str, torch.optim.Optimizer] = {
        "torch_foreach": torch.optim.AdamW([param], foreach=True, **kw),  # type: ignore[arg-type]
        "torch_fused": torch.optim.AdamW([param], fused=True, **kw),  # type: ignore[arg-type]
    }
    ds_cls, why = deepspeed_adam()
    if ds_cls is not None:
        baselines["deepspeed"] = ds_cls([param], adamw_mode=True, **kw)
    else:
        notes.append(f"deepspeed skipped: {why}")

    def fallback_plain() -> None:
        counter[0] += 1
        adam_update(p, m, v, g32, hyper=hyper, step=counter[0], threads=pool, backend="torch")

    def fallback_offloaded() -> None:
        counter[0] += 1
        adam_update(p, m, v, g16, hyper=hyper, step=counter[0], shadow=p16, threads=pool,
                    backend="torch")

    # tierzero_fallback: the pure-PyTorch path used when no C compiler is available.
    plain: dict[str, Callable[[], None]] = {"tierzero": tz_plain,
                                            "tierzero_fallback": fallback_plain}
    offloaded: dict[str, Callable[[], None]] = {"tierzero": tz_offloaded,
                                                "tierzero_fallback": fallback_offloaded}
    for name, opt in baselines.items():
        plain[name] = opt.step  # type: ignore[assignment]

        def pipeline(opt: torch.optim.Optimizer = opt) -> None:
            assert param.grad is not None
            param.grad.copy_(g16)  # bf16 -> fp32 grad (a pass)
            opt.step()
            p16.copy_(param.detach())  # fp32 -> bf16 compute copy (a pass)

        offloaded[name + "+conv"] = pipeline
    bandwidth = {"stream_inplace": stream_bandwidth(n)}
    so, why = load_pattern()
    if so is not None:
        bandwidth.update(pattern_methods(so, pool, p=p, m=m, v=v, g32=g32, g16=g16, p16=p16))
    else:
        notes.append(why)
    return {"plain": plain, "offloaded": offloaded, "bandwidth": bandwidth}, notes


def stream_bandwidth(n: int) -> Callable[[], None]:
    x = torch.randn(n)

    def run() -> None:
        x.mul_(1.0000001)

    return run


def bench_threads(n: int, threads: int, repeats: int, hyper: AdamHyper) -> dict[str, Any]:
    torch.set_num_threads(threads)
    with AdamThreads(threads) as pool:
        sections, notes = build_methods(n, hyper, pool)
        flat = [(sec, name, fn) for sec, methods in sections.items()
                for name, fn in methods.items()]
        times: dict[tuple[str, str], list[float]] = {(s, name): [] for s, name, _ in flat}
        for _, _, fn in flat:  # warm-up: first-touch state, JIT, page faults
            fn()
        for r in range(repeats):
            rotated = flat[r % len(flat):] + flat[:r % len(flat)]
            for sec, name, fn in rotated:
                times[(sec, name)].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    bw = BYTES["stream"] * n / med[("bandwidth", "stream_inplace")]
    rows = []
    for sec in ("plain", "offloaded"):
        names = [name for s, name in med if s == sec]
        base = [name for name in names if not name.startswith("tierzero")]
        fastest = min(med[(sec, name)] for name in base)
        for name in names:
            t = med[(sec, name)]
            nbytes = BYTES["plain"] if sec == "plain" else (
                BYTES["tz_offloaded"] if name.startswith("tierzero")
                else BYTES["baseline_offloaded"])
            bound = bw / nbytes
            pattern = med.get(("bandwidth", f"pattern_{sec}"))
            rows.append({
                "frac_of_pattern": None if pattern is None else pattern / t,
                "section": sec, "method": name, "threads": threads, "median_s": t,
                "all_s": times[(sec, name)], "gparams_per_s": n / t / 1e9,
                "bytes_per_param": nbytes, "bound_gparams_per_s": bound / 1e9,
                "frac_of_bound": n / t / bound, "speedup_vs_fastest_baseline": fastest / t,
            })
    return {"threads": threads, "bandwidth_gb_s": bw / 1e9, "rows": rows, "notes": notes}


def bench_subnormal(n: int, threads: int, repeats: int, hyper: AdamHyper) -> dict[str, Any]:
    """Zero gradients, moments already subnormal (after a run of zero grads): see
    [Note: subnormals] in offload/_adam_kernel.c. tierzero vs fused AdamW, interleaved."""
    torch.set_num_threads(threads)
    p = torch.randn(n)
    m, v, g = torch.full((n,), 1e-40), torch.full((n,), 1e-40), torch.zeros(n)
    param = torch.nn.Parameter(p.clone())
    param.grad = g.clone()
    fused = torch.optim.AdamW([param], fused=True, lr=hyper.lr, weight_decay=hyper.weight_decay)
    fused.step()
    step = [0]
    with AdamThreads(threads) as pool:

        def tz() -> None:
            step[0] += 1
            m.fill_(1e-40)  # keep the state subnormal (flushing would zero it after a step)
            v.fill_(1e-40)
            adam_update(p, m, v, g, hyper=hyper, step=1000 + step[0], threads=pool)

        def base() -> None:
            fused.state[param]["exp_avg"].fill_(1e-40)
            fused.state[param]["exp_avg_sq"].fill_(1e-40)
            fused.step()

        def fill() -> None:
            m.fill_(1e-40)
            v.fill_(1e-40)

        times: dict[str, list[float]] = {"tierzero": [], "torch_fused": [], "fill": []}
        for r in range(repeats):
            order = [("tierzero", tz), ("torch_fused", base), ("fill", fill)]
            for name, fn in order[r % 3:] + order[:r % 3]:
                times[name].append(timed(fn))
    med = {k: statistics.median(ts) for k, ts in times.items()}
    # Both methods include refilling m and v (two passes); "fill" times that alone.
    res = {"threads": threads, "median_s": med,
           "speedup": (med["torch_fused"] - med["fill"]) / max(med["tierzero"] - med["fill"],
                                                               1e-9)}
    print(f"\n== subnormal moments, zero grads, {threads} thread(s): tierzero "
          f"{med['tierzero']:.4f} s, fused AdamW {med['torch_fused']:.4f} s (each incl. "
          f"{med['fill']:.4f} s refill) -> {res['speedup']:.1f}x excluding the refill")
    return res


def print_table(result: dict[str, Any]) -> None:
    print(f"\n== {result['threads']} thread(s): in-place stream bandwidth "
          f"{result['bandwidth_gb_s']:.1f} GB/s")
    for note in result["notes"]:
        print("   " + note)
    print(f"   {'section':<10}{'method':<22}{'median s':>10}{'Gparam/s':>10}{'bound':>8}"
          f"{'%bound':>8}{'%pattern':>10}{'vs best base':>14}")
    for r in result["rows"]:
        pat = "-" if r["frac_of_pattern"] is None else f"{100 * r['frac_of_pattern']:.0f}%"
        print(f"   {r['section']:<10}{r['method']:<22}{r['median_s']:>10.4f}"
              f"{r['gparams_per_s']:>10.3f}{r['bound_gparams_per_s']:>8.3f}"
              f"{100 * r['frac_of_bound']:>7.0f}%{pat:>10}"
              f"{r['speedup_vs_fastest_baseline']:>13.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", default="1,all", help="comma list; 'all' = every CPU")
    ap.add_argument("--quick", action="store_true", help="10M params, 3 repeats, small NVMe part")
    ap.add_argument("--out", default="bench_out/adam_bench.json")
    ap.add_argument("--nvme-dir", default="bench_out/adam_swap", help="directory for swap files")
    ap.add_argument("--nvme-params", type=int, default=50_000_000)
    ap.add_argument("--nvme-shards", type=int, default=8)
    ap.add_argument("--skip-nvme", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.params, args.repeats = 10_000_000, 3
        args.nvme_params = 5_000_000
    all_cpus = len(os.sched_getaffinity(0))
    counts = sorted({all_cpus if t == "all" else int(t) for t in args.threads.split(",")})
    hyper = AdamHyper(lr=1e-3, weight_decay=0.01)
    Path(args.nvme_dir).mkdir(parents=True, exist_ok=True)
    info = {**describe(args.nvme_dir), "adam_kernel": kernel_status()}
    print("machine:", json.dumps(info, indent=1))
    print(f"params={args.params:,} repeats={args.repeats} threads={counts}")
    out: dict[str, Any] = {"machine": info, "params": args.params, "repeats": args.repeats,
                           "results": []}
    for t in counts:
        res = bench_threads(args.params, t, args.repeats, hyper)
        print_table(res)
        out["results"].append(res)
    out["subnormal"] = bench_subnormal(args.params // 4, max(counts), args.repeats, hyper)
    if not args.skip_nvme:
        out["nvme"] = nvme_section(Path(args.nvme_dir), n=args.nvme_params,
                                   shards=args.nvme_shards, threads=max(counts),
                                   repeats=args.repeats, hyper=hyper)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
