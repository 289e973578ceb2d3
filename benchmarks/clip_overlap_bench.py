"""The cpu-offload step with clipping (optimizer overlapped) against the unclipped one, paired.

Issue 16's measure: "the cpu-offload step with clipping is within 5 % of the unclipped
overlapped step (same run)". step_bench.py runs each configuration in its own child, one
after the other, so on a shared machine a change of load between children moves a row
by more than 5 %. Here the engines live in one process and take turns in short blocks
(A B C A B C ...), so neighbouring blocks see the same load, and the figure is the
median over blocks of each block's ratio to the unclipped block next to it.

Engines (params and optimizer state in host memory, bf16, the same model and batch):
  over        overlap_step on, no clipping (CPU Adam during backward)
  over_clip   overlap_step on, clipping --clip (norms measured during backward, the
              update deferred into the next forward: [Note: deferred step])
  noover_clip overlap_step off, clipping --clip (the whole step after backward)
A block runs `--block` + 1 steps of one engine and times the last `--block`, each from
the start of forward to the return of step(): a timed step holds exactly one optimizer
update (the deferred update of the previous step runs in its forward). After a block
the engine's deferred update is drained (untimed), so no engine's work runs under
another's block.

    python benchmarks/clip_overlap_bench.py --out bench_out/clip_overlap.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine
from step_bench import HFLoss, build

from tierzero import engine

ENGINES = {"over": (True, False), "over_clip": (True, True), "noover_clip": (False, True)}


def make_engine(model: torch.nn.Module, units: tuple[str, ...], *, overlap: bool,
                clip: float) -> Any:
    cfg = engine.load_config({
        "zero": {"stage": 3, "units": list(units), "persistence_threshold_bytes": 0},
        "precision": "bf16", "optimizer": {"type": "adamw", "lr": 1e-4},
        "gradient_clipping": clip,
        "offload": {"params": {"device": "cpu"},
                    "optimizer": {"device": "cpu", "overlap_step": overlap}}})
    eng, _, _, _ = engine.initialize(model=copy.deepcopy(model), config=cfg, device="cpu")
    return eng


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("mlp", "hf"), default="hf")
    ap.add_argument("--quick", action="store_true", help="the small model variant")
    ap.add_argument("--blocks", type=int, default=12, help="blocks per engine")
    ap.add_argument("--block", type=int, default=3, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per engine first")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default="bench_out/clip_overlap.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine.describe()
    print("machine:", json.dumps(info), flush=True)
    raw, units, vocab = build(args.model, args.quick)
    model: torch.nn.Module = raw if args.model == "mlp" else HFLoss(raw)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    labels = torch.roll(ids, -1, 1)
    engines = {name: make_engine(model, units, overlap=o, clip=args.clip if c else 0.0)
               for name, (o, c) in ENGINES.items()}

    exposed: dict[str, list[float]] = {n: [] for n in engines}

    def one(eng: Any, name: str | None = None) -> float:
        """One step's seconds; with `name`, its exposed optimizer seconds are kept too
        (in step() plus forward's waits for the deferred update)."""
        w0 = eng.optimizer_times().update_wait_s
        t0 = time.perf_counter()
        eng.backward(eng(ids, labels))
        t1 = time.perf_counter()
        eng.step()
        t2 = time.perf_counter()
        if name is not None:
            exposed[name].append(t2 - t1 + eng.optimizer_times().update_wait_s - w0)
        return t2 - t0

    def drain(eng: Any) -> None:
        eng.step_driver.drain()  # the deferred update of the block's last step, untimed

    for eng in engines.values():
        for _ in range(args.warmup):
            one(eng)
        drain(eng)
    per_block: dict[str, list[float]] = {n: [] for n in engines}
    hidden: dict[str, list[float]] = {n: [] for n in engines}
    names = list(engines)
    for b in range(args.blocks):
        order = names[b % len(names):] + names[:b % len(names)]  # rotate who goes first
        for name in order:
            eng = engines[name]
            one(eng)  # untimed: its forward has no update of this block to wait for
            h0 = eng.optimizer_times().hidden_s
            times = [one(eng, name) for _ in range(args.block)]
            drain(eng)
            per_block[name].append(statistics.median(times))
            hidden[name].append((eng.optimizer_times().hidden_s - h0) / args.block)
        print(f"block {b + 1}/{args.blocks}: " + ", ".join(
            f"{n} {per_block[n][-1]:.3f} s" for n in names), flush=True)
    for eng in engines.values():
        eng.close()
    ratios = {n: statistics.median(c / u for c, u in zip(per_block[n], per_block["over"],
                                                          strict=True)) for n in names}
    rows = {n: {"step_s": statistics.median(per_block[n]), "ratio_to_over": ratios[n],
                "hidden_s_per_step": statistics.median(hidden[n]),
                "exposed_s_per_step": statistics.median(exposed[n]),
                "blocks": per_block[n]} for n in names}
    out = {"machine": info, "load_at_end": os.getloadavg(), "args": vars(args),
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("| engine | median step s | median ratio to `over` (paired blocks) | "
          "optimizer exposed s per step | optimizer hidden s per step |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for n in names:
        r = rows[n]
        print(f"| {n} | {r['step_s']:.3f} | {r['ratio_to_over']:.3f} | "
              f"{r['exposed_s_per_step']:.3f} | {r['hidden_s_per_step']:.3f} |")


if __name__ == "__main__":
    main()
