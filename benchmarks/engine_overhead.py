"""Step time of tierzero stage 3 (world size 1, no offload) against plain PyTorch.

What it measures: the engine's own overhead (hooks, gather/release, flat
gradient shards, the step over master shards) on a model that fits anyway.
Baselines in the same run, interleaved: plain PyTorch with torch.optim.AdamW
(fused on CUDA, foreach on CPU), fp32; and for bf16, plain PyTorch under
torch.autocast(bfloat16) with fp32 params ("plain"), plus plain PyTorch with
the whole model cast to bf16 ("plain_bf16_params": the same kernels tierzero's
bf16 compute runs, without fp32 master weights), which separates the cost of
computing everything in bf16 from the engine's own overhead. Each configuration runs `repeats`
rounds of `steps` timed optimizer steps after warm-up; the median of the rounds
is reported. Offload is not wired into the engine yet (see issue 6), so this is
not step_bench.py.

    python benchmarks/engine_overhead.py --quick
    python benchmarks/engine_overhead.py --out bench_out/engine_overhead.json
    python benchmarks/engine_overhead.py --threads 1   # shared CPU: compare CPU times
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_models import MLPModel
from machine import describe

from tierzero import engine


def plain_runner(model: nn.Module, dev: torch.device, bf16: bool,
                 batch: tuple[torch.Tensor, torch.Tensor],
                 cast: bool = False) -> Callable[[], None]:
    model = model.to(dev, dtype=torch.bfloat16 if cast else None)
    bf16 = bf16 and not cast
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=not fused)

    def step() -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def tierzero_runner(model: nn.Module, bf16: bool,
                    batch: tuple[torch.Tensor, torch.Tensor]) -> Callable[[], None]:
    cfg = engine.load_config({"zero": {"stage": 3, "units": ["Block"]},
                              "precision": "bf16" if bf16 else "fp32",
                              "optimizer": {"type": "adamw", "lr": 1e-4}})
    eng, _, _, _ = engine.initialize(model=model, config=cfg)

    def step() -> None:
        eng.backward(eng(*batch))
        eng.step()

    return step


def timed(step: Callable[[], None], steps: int, dev: torch.device) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) per step. CPU time is the steadier
    measure on a shared CPU machine; on CUDA, wall time is what counts."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, few steps (< 1 min)")
    ap.add_argument("--out", default="bench_out/engine_overhead.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        vocab, dim, n_blocks, bsz, seq, steps = 1024, 256, 4, 8, 64, 5
    elif dev.type == "cuda":
        vocab, dim, n_blocks, bsz, seq, steps = 32000, 1024, 6, 16, 512, 10  # ~140M params
    else:
        vocab, dim, n_blocks, bsz, seq, steps = 8192, 512, 6, 8, 128, 5  # ~27M params
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (bsz, seq), generator=g).to(dev)
    batch = (ids, torch.roll(ids, 1, dims=1))
    results: dict[str, object] = {"machine": describe(), "device": str(dev),
                                  "model": {"vocab": vocab, "dim": dim, "blocks": n_blocks,
                                            "batch": bsz, "seq": seq}, "rows": {}}
    print(json.dumps(results["machine"]))
    rows: dict[str, dict[str, object]] = {}
    for bf16 in (False, True):
        torch.manual_seed(0)
        base = MLPModel(vocab, dim, n_blocks)
        n_params = sum(p.numel() for p in base.parameters())
        ref_model = MLPModel(vocab, dim, n_blocks)
        base_state = {k: v.clone() for k, v in base.state_dict().items()}
        ref_model.load_state_dict(base_state)
        runners = {"plain": plain_runner(ref_model, dev, bf16, batch),
                   "tierzero": tierzero_runner(base, bf16, batch)}
        if bf16:
            cast_model = MLPModel(vocab, dim, n_blocks)
            cast_model.load_state_dict(base_state)
            runners["plain_bf16_params"] = plain_runner(cast_model, dev, True, batch, cast=True)
        for r in runners.values():
            r()  # warm-up
        times: dict[str, list[float]] = {k: [] for k in runners}
        cpu: dict[str, list[float]] = {k: [] for k in runners}
        for _ in range(args.repeats):  # interleaved rounds
            for name, r in runners.items():
                wall, proc = timed(r, steps, dev)
                times[name].append(wall)
                cpu[name].append(proc)
        med = {k: statistics.median(v) for k, v in times.items()}
        med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        label = "bf16" if bf16 else "fp32"
        ratios = {f"tierzero_over_{k}": med["tierzero"] / v for k, v in med.items()
                  if k != "tierzero"}
        cpu_ratios = {f"cpu_time_tierzero_over_{k}": med_cpu["tierzero"] / v
                      for k, v in med_cpu.items() if k != "tierzero"}
        rows[label] = {"params": n_params, "step_s": med, "rounds_s": times,
                       "cpu_s": med_cpu, "cpu_rounds_s": cpu, **ratios, **cpu_ratios}
        print(f"{label}: {n_params / 1e6:.1f}M params  wall: "
              + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items()) + "  "
              + "  ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
        print(f"{label}: process CPU time: "
              + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med_cpu.items()) + "  "
              + "  ".join(f"{k} {v:.3f}" for k, v in cpu_ratios.items()))
    results["rows"] = rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
