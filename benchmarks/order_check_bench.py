"""Cost of the collective order check (zero.check_unit_order) on two gloo ranks.

Every unit gather and gradient reduction is preceded by a 4-byte all-gather of its code
on a separate gloo group ([Note: collective order check] in engine/collectives.py). This
trains a stage-3 model of `--blocks` MLP blocks on two gloo ranks (one CPU thread each),
with the check on and off in alternating repeats in the same run, and reports the median
step time of each and their ratio.

    .venv/bin/python benchmarks/order_check_bench.py --blocks 8 --dim 256 --steps 5 \
        --repeats 3 --out bench_out/order_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tierzero import engine


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))  # type: ignore[no-any-return]


class Model(nn.Module):
    def __init__(self, blocks: int, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


def _time_steps(check: bool, args: argparse.Namespace, rank: int) -> float:
    torch.manual_seed(0)
    model = Model(args.blocks, args.dim)
    cfg = engine.load_config({"zero": {"stage": 3, "units": ["Block"],
                                       "persistence_threshold_bytes": 0,
                                       "check_unit_order": check},
                              "precision": "fp32", "optimizer": {"type": "adamw", "lr": 1e-4}})
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    x = torch.randn(4, 16, args.dim, generator=torch.Generator().manual_seed(rank))
    times = []
    for i in range(args.steps + 1):  # the first step records the trace: not timed
        dist.barrier()
        start = time.perf_counter()
        eng.backward(eng(x))
        eng.step()
        if i:
            times.append(time.perf_counter() - start)
    eng.close()
    return statistics.median(times)


def _worker(rank: int, init: str, args: argparse.Namespace, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    runs: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(args.repeats):
        for name in ("off", "on"):
            runs[name].append(_time_steps(name == "on", args, rank))
    if rank == 0:
        Path(out).write_text(json.dumps(runs))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "runs.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "pg"), args, raw), nprocs=2, join=True)
        runs = json.loads(Path(raw).read_text())
    on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
    collectives = 2 * (args.blocks + 1)  # per step: a gather and a reduction per unit
    result: dict[str, Any] = {
        "blocks": args.blocks, "dim": args.dim, "steps": args.steps,
        "repeats": args.repeats, "step_s_check_off": off, "step_s_check_on": on,
        "ratio_on_off": on / off, "extra_ms_per_collective_approx":
            1000 * (on - off) / max(1, collectives + args.blocks),  # + backward re-gathers
        "runs": runs}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
