"""What `tierzero train`'s instrumentation costs per step, against the bare engine loop.

Four loops over the same built-in model (bf16, world size 1), the same batch
shape and the same config, each built once:
  train   the CLI's step (engine.train.loop._one_step): unit probes (2 forward
          hooks per block), per-step memory_report, disk and tier counters, a
          JSONL line and the formatted log line; tracing off (every swap.trace
          call site is one attribute check);
  traced  the same with a swap.trace recorder on (what --trace costs on the
          steps it records; a fresh recorder per round);
  engine  the bare engine loop: forward, cross-entropy, backward, step;
  plain   plain PyTorch: autocast(bf16) forward, fp32 params, torch.optim.AdamW.
Rounds are interleaved in a fresh random order each; each round times `steps`
steps after one untimed warm-up step per loop; medians over rounds. Process
CPU time is reported beside wall time (on a shared machine compare CPU times).

    python benchmarks/train_overhead.py --quick
    python benchmarks/train_overhead.py --out bench_out/train_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from machine import describe

from tierzero import engine
from tierzero.engine.models import SIZES, TinyLM
from tierzero.engine.train.data import ByteBatches, load_bytes
from tierzero.engine.train.loop import _one_step
from tierzero.engine.train.metrics import DiskCounter, MetricsWriter, TierCounter, log_line
from tierzero.engine.train.timeline import UnitProbes
from tierzero.swap import trace


def build(size: str, batch: int, seq: int, offload: str) -> dict[str, Callable[[], None]]:
    tokens, source = load_bytes(None)
    tree: dict[str, object] = {"precision": "bf16", "batch": {"micro_batch_size": batch},
                               "optimizer": {"lr": 1e-4}}
    if offload == "nvme":  # every tier moves bytes: the trace records NVMe blocks and copies
        tree["offload"] = {"device": "nvme", "path": tempfile.mkdtemp(prefix="tz-bench-swap-")}
    cfg = engine.load_config(tree)
    loops: dict[str, Callable[[], None]] = {}

    def cli_step() -> Callable[[], None]:
        torch.manual_seed(0)
        eng_t, *_ = engine.initialize(model=TinyLM(SIZES[size]), config=cfg)
        data_t = ByteBatches(tokens, seq, batch, seed=0, rank=0, source=source)
        probes = UnitProbes([(u.label, u.module) for u in eng_t.units if not u.is_root])
        disk, moves = DiskCounter(), TierCounter(eng_t.memory_report())
        writer = MetricsWriter(os.path.join(tempfile.mkdtemp(prefix="tz-bench-"), "m.jsonl"))
        state = {"step": 0}

        def step() -> None:
            state["step"] += 1
            rec = _one_step(eng_t, data_t, probes, disk=disk, moves=moves,
                            step=state["step"], accum=1, world=1)
            writer.write(rec.as_json())
            log_line(rec, 0)

        return step

    train = cli_step()
    traced_step = cli_step()

    def traced() -> None:
        with trace.recording(trace.Recorder()):
            traced_step()

    torch.manual_seed(0)
    eng_e, *_ = engine.initialize(model=TinyLM(SIZES[size]), config=cfg)
    data_e = ByteBatches(tokens, seq, batch, seed=0, rank=0, source=source)

    def bare() -> None:
        x, y = data_e.next()
        out = eng_e(input_ids=x)
        eng_e.backward(F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten()))
        eng_e.step()

    torch.manual_seed(0)
    model = TinyLM(SIZES[size])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    data_p = ByteBatches(tokens, seq, batch, seed=0, rank=0, source=source)

    def plain() -> None:
        x, y = data_p.next()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x).logits
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()

    loops.update(train=train, traced=traced, engine=bare, plain=plain)
    return loops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (< 1 min)")
    ap.add_argument("--out", default="bench_out/train_overhead.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="steps per round (default 10, quick 5)")
    ap.add_argument("--offload", choices=("none", "nvme"), default="none",
                    help="where params and optimizer state live (nvme: a temp dir)")
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats must be >= 3 (medians of at least 3 rounds)")
    size, steps = ("tiny", args.steps or 5) if args.quick else ("small", args.steps or 10)
    info = describe()
    print("machine:", json.dumps(info))
    loops = build(size, batch=4, seq=64, offload=args.offload)
    for fn in loops.values():
        fn()  # warm-up
    wall: dict[str, list[float]] = {k: [] for k in loops}
    cpu: dict[str, list[float]] = {k: [] for k in loops}
    rng = random.Random(0)
    for _ in range(args.repeats):
        order = list(loops)
        rng.shuffle(order)
        for name in order:
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                loops[name]()
            wall[name].append((time.perf_counter() - w0) / steps)
            cpu[name].append((time.process_time() - c0) / steps)
    med = {k: {"wall_ms": 1e3 * statistics.median(wall[k]),
               "cpu_ms": 1e3 * statistics.median(cpu[k])} for k in loops}
    print(f"model builtin:{size} ({SIZES[size].num_parameters / 1e6:.1f}M params), bf16, "
          f"batch 4 x 64, offload {args.offload}, {steps} steps x {args.repeats} rounds")
    print("| loop | wall ms/step | process CPU ms/step | wall / engine |")
    print("| --- | ---: | ---: | ---: |")
    for k in ("train", "traced", "engine", "plain"):
        ratio = med[k]["wall_ms"] / med["engine"]["wall_ms"]
        print(f"| {k} | {med[k]['wall_ms']:.1f} | {med[k]['cpu_ms']:.1f} | {ratio:.3f} |")
    result = {"machine": info, "model": f"builtin:{size}", "offload": args.offload,
              "steps": steps,
              "repeats": args.repeats, "median": med, "rounds_wall_s": wall, "rounds_cpu_s": cpu}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("written:", args.out)


if __name__ == "__main__":
    main()
