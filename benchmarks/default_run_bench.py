"""`tierzero train`'s default run with the streamed step deferred into the next forward, and not.

Issue 30's bar for the default run (configs/default.yaml: builtin:small, bf16, params and
optimizer state on NVMe, gradients in host memory, clipping 1.0, overlap_step on):
`step()` holds at most 0.15 of the step. Two engines of that config live in one process
and take turns in blocks (A B A B ..., who goes first alternating), so neighbouring blocks
see the same load:

  measure   the step as before: gradients measured during backward ([Note: gradients
            measured where they are reduced] in engine/step/streamed.py), the streamed
            update in step(), on the training thread (the driver's mode forced to MEASURE)
  defer     the update handed to a worker that runs it during the next forward, each
            unit's groups before its gather ([Note: deferred streamed step] in
            engine/step/deferred_stream.py): what the config chooses now
  defer-N   (--ring N ...) the same with offload.optimizer.buffer_count N: a deeper ring
            reads more of the next step's state during backward

A block runs --block + 1 steps of one engine through `train_batch` (as `tierzero train`
does) and times the last --block: each timed step runs one update (the deferred update of
the previous step runs in its forward). After a block the engine's deferred update is
drained (untimed), so no engine's work runs under another's block. Per step: wall time,
the time inside step(), forward's waits for the deferred update, the time gathers took,
and NVMe bytes by tensor class and direction (memory_report()["tiers"]["moved_by_class"]).
Medians over blocks. The load average is printed at the start and the end (a shared
machine: compare rows of the same run).

    python benchmarks/default_run_bench.py --out bench_out/default_run.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine

from tierzero import engine
from tierzero.engine.step.offloaded import OffloadedStep, StepMode
from tierzero.engine.train.data.build import load_data
from tierzero.engine.train.loop import token_loss
from tierzero.engine.train.model_source import build_model

COUNTERS = ("step_s", "held_s", "forward_wait_s", "gather_s")


def default_tree(swap: str, buffer_count: int | None, grads: str | None) -> dict[str, Any]:
    """configs/default.yaml, swapping to `swap` (and the CPU Adam ring of `buffer_count`,
    the gradients homed on `grads`)."""
    text = resources.files("tierzero.configs").joinpath("default.yaml").read_text()
    tree: dict[str, Any] = yaml.safe_load(text)
    tree["offload"]["path"] = swap
    if buffer_count is not None:
        tree["offload"]["optimizer"]["buffer_count"] = buffer_count
    if grads is not None:
        tree["offload"]["optimizer"]["grad_device"] = grads
    return tree


class Run:
    """One engine of the default config and its batches, stepped as `tierzero train` does."""

    def __init__(self, name: str, swap_root: str, *, defer: bool,
                 buffer_count: int | None, grads: str | None) -> None:
        self.name = name
        swap = tempfile.mkdtemp(prefix=f"tz-{name}-", dir=swap_root)
        cfg = engine.load_config(default_tree(swap, buffer_count, grads))
        tc = cfg.train
        data = load_data(tc, micro=cfg.batch.micro_batch_size or 1, accum=1, seed=cfg.seed,
                         rank=0, world=1)
        self.batches = data.batches
        torch.manual_seed(cfg.seed)
        with engine.Init(config=cfg):
            model = build_model(tc.model, tc.seq_len, data.tokenizer.vocab_size,
                                data.tokenizer.name)
        self.eng, _, _, _ = engine.initialize(model=model, config=cfg)
        driver = self.eng.step_driver
        if not isinstance(driver, OffloadedStep):
            raise SystemExit("the default config no longer offloads the optimizer")
        if driver.mode is not StepMode.DEFER:
            raise SystemExit(f"the default config chooses {driver.mode}, not DEFER")
        if not defer:
            driver.mode = StepMode.MEASURE  # as before: measured in backward, updated in step()
        self.steps: dict[str, list[float]] = {k: [] for k in COUNTERS}
        self.moved: list[dict[str, dict[str, float]]] = []  # per block, per step
        # every second the training thread spends inside eng.step(), its gathers of
        # persistent units included (optimizer_step_s leaves those to the gather time)
        self.held_s = 0.0
        step = self.eng.step

        def timed_step() -> None:
            t0 = time.perf_counter()
            try:
                step()
            finally:
                self.held_s += time.perf_counter() - t0

        self.eng.step = timed_step  # type: ignore[method-assign]

    def _moved(self) -> dict[str, dict[str, int]]:
        tiers = self.eng.memory_report()["tiers"]
        return {d: dict(c) for d, c in tiers["moved_by_class"].items()}

    def one(self) -> dict[str, float]:
        eng = self.eng
        held0, wait0 = self.held_s, eng.optimizer_times().update_wait_s
        gather0 = eng.scheduler.gather_s
        t0 = time.perf_counter()

        def loss_fn(mb: Any) -> torch.Tensor:
            x, y = mb
            out = eng(input_ids=x)
            return token_loss(out.logits if hasattr(out, "logits") else out[0], y)

        eng.train_batch([self.batches.next()], loss_fn)
        return {"step_s": time.perf_counter() - t0, "held_s": self.held_s - held0,
                "forward_wait_s": eng.optimizer_times().update_wait_s - wait0,
                "gather_s": eng.scheduler.gather_s - gather0}

    def block(self, steps: int) -> None:
        self.one()  # untimed: its forward has no update of this block to wait for
        before = self._moved()
        got = [self.one() for _ in range(steps)]
        after = self._moved()
        self.eng.step_driver.drain()  # the last step's deferred update, untimed
        for k in COUNTERS:
            self.steps[k].append(statistics.median(g[k] for g in got))
        self.moved.append({d: {c: (after[d].get(c, 0) - before.get(d, {}).get(c, 0)) / steps
                               for c in after[d]} for d in after})

    def row(self) -> dict[str, Any]:
        med = {k: statistics.median(v) for k, v in self.steps.items()}
        directions = sorted({d for m in self.moved for d in m})
        moved = {d: {c: statistics.median(m.get(d, {}).get(c, 0.0) for m in self.moved)
                     for c in sorted({c for m in self.moved for c in m.get(d, {})})}
                 for d in directions}
        return {**med, "held_fraction": med["held_s"] / med["step_s"],
                "exposed_fraction": (med["held_s"] + med["forward_wait_s"]) / med["step_s"],
                "moved_bytes_per_step": moved, "blocks": self.steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=8, help="blocks per engine")
    ap.add_argument("--block", type=int, default=4, help="timed steps per block")
    ap.add_argument("--ring", type=int, nargs="*", default=[],
                    help="also defer with offload.optimizer.buffer_count N")
    ap.add_argument("--swap", default="/var/tmp", help="where the engines' swap dirs go")
    ap.add_argument("--grads", choices=("cpu", "nvme"), default=None,
                    help="offload.optimizer.grad_device of every engine (default: the "
                    "config's, cpu)")
    ap.add_argument("--out", default="bench_out/default_run.json")
    args = ap.parse_args()
    if args.blocks < 3:
        ap.error("--blocks must be >= 3 (medians over blocks)")
    info = machine.describe(args.swap)
    print("machine:", json.dumps(info), flush=True)
    runs = [Run("measure", args.swap, defer=False, buffer_count=None, grads=args.grads),
            Run("defer", args.swap, defer=True, buffer_count=None, grads=args.grads)]
    runs += [Run(f"defer-{n}", args.swap, defer=True, buffer_count=n, grads=args.grads)
             for n in args.ring]
    for run in runs:  # warm-up: the first steps learn the order, fill the caches
        for _ in range(3):
            run.one()
        run.eng.step_driver.drain()
    for b in range(args.blocks):
        order = runs[b % len(runs):] + runs[:b % len(runs)]  # rotate who goes first
        for run in order:
            run.block(args.block)
        print(f"block {b + 1}/{args.blocks}: " + ", ".join(
            f"{r.name} {r.steps['step_s'][-1]:.3f} s (step() {r.steps['held_s'][-1]:.3f})"
            for r in runs), flush=True)
    rows = {r.name: r.row() for r in runs}
    for run in runs:
        run.eng.close(restore_params=False)
    load_end = os.getloadavg()
    out = {"machine": info, "loadavg_at_end": f"{load_end[0]:.2f} {load_end[1]:.2f} "
           f"{load_end[2]:.2f}", "args": vars(args), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"load average at start {info['loadavg_at_start']}, at end {out['loadavg_at_end']}")
    print("| engine | step s | step() s | step() / step | forward waits s | gathers s | "
          "exposed / step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['step_s']:.3f} | {r['held_s']:.3f} | {r['held_fraction']:.3f} | "
              f"{r['forward_wait_s']:.3f} | {r['gather_s']:.3f} | {r['exposed_fraction']:.3f} |")
    print("\nNVMe MB per step by tensor class (median over blocks):")
    for name, r in rows.items():
        parts = [f"{d} " + ", ".join(f"{c} {v / 1e6:.1f}" for c, v in cls.items() if v)
                 for d, cls in r["moved_bytes_per_step"].items()
                 if d in ("nvme_to_host", "host_to_nvme")]
        print(f"  {name}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
