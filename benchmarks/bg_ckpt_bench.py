"""Background checkpoints: what a save costs the training thread and the steps it overlaps.

In one child process per run (a fresh engine; `offload: {device: cpu | nvme}`, bf16,
AdamW), after --warmup steps, --repeats times:
  undisturbed   --base steps with no save in flight, each timed
  synchronous   eng.save_checkpoint(background=False): its seconds (the baseline)
  background    eng.save_checkpoint(background=True): the seconds it held the training
                thread (PendingSave.stats.held_s), then steps until the save is complete,
                each timed (the steps it overlapped), and the save's own figures (seconds,
                bytes read from the snapshot and written, writer busy / paused)
Reported per run: medians of the synchronous save, the hold and its ratio to the
synchronous save (the issue's bound: 5 %), the undisturbed step, the overlapped step and
its ratio (bound: 1.3x), and the saves' figures. Checkpoints of each repeat are removed
as soon as they are measured.

    .venv/bin/python benchmarks/bg_ckpt_bench.py --model builtin:small --offload cpu
    .venv/bin/python benchmarks/bg_ckpt_bench.py --llama2b --offload nvme --dir /var/tmp \\
        --warmup 1 --base 2 --repeats 1 --state-precision int8

The 2.07B model is the Llama of benchmarks/scale_bench.py (33 GB of state on NVMe). A
watchdog kills the child when the machine's available memory falls below
--min-available (a shared machine) or after --child-timeout; such a row says so and is
not a measurement. Everything is written in one directory this script makes under --dir
and removes at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's engine
sys.path.insert(0, str(HERE))
from machine import describe  # noqa: E402
from scale_bench import LLAMA_2B  # noqa: E402

GiB = 1 << 30


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch.nn.functional as F

    from tierzero import engine
    from tierzero.engine.config import load_config
    from tierzero.engine.train.model_source import build_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = load_config(args.config)
    with engine.Init(config=config):
        model = build_model(args.model, args.seq)
    n_params = sum(p.numel() for p in model.parameters())  # (as tierzero train counts them)
    eng, _, _, _ = engine.initialize(model=model, config=config)
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 256)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)  # (B, T)
    labels = torch.roll(ids, -1, 1)

    def step() -> float:
        t = time.perf_counter()
        out = eng(input_ids=ids)
        logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(
            out, tuple) else out  # (B, T, V)
        eng.backward(F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()))
        eng.step()
        return time.perf_counter() - t

    def note(msg: str) -> None:
        sys.stderr.write(f"bg_ckpt_bench: {msg}\n")
        sys.stderr.flush()

    for _ in range(args.warmup):
        note(f"warm-up step {step():.2f} s")
    out = _measure(eng, step, args, note)
    report = eng.memory_report()
    eng.close(restore_params=False)
    return {"params": n_params, **out,
            "outside_peak": (report["tiers"] or {}).get("outside_peak")}


def _measure(eng: Any, step: Any, args: argparse.Namespace, note: Any) -> dict[str, Any]:
    """The repeats of the module docstring: undisturbed steps, a synchronous save, a
    background save and the steps until it is complete."""
    from tierzero import engine

    ck = Path(args.ckpt)
    base: list[float] = []
    sync: list[float] = []
    held: list[float] = []
    settle: list[float] = []  # of held: waiting for optimizer work (SaveStats.settle_s)
    over: list[float] = []
    saves: list[dict[str, Any]] = []
    for r in range(args.repeats):
        for _ in range(args.base):
            base.append(step())
            note(f"undisturbed step {base[-1]:.2f} s")
        t = time.perf_counter()
        eng.save_checkpoint(ck, tag=f"sync{r}")
        sync.append(time.perf_counter() - t)
        note(f"synchronous save {sync[-1]:.2f} s")
        shutil.rmtree(ck / f"sync{r}")
        step()  # (after a synchronous save: not counted either way)
        pending = eng.save_checkpoint(ck, tag=f"bg{r}", background=True)
        if not isinstance(pending, engine.PendingSave):
            raise RuntimeError("save_checkpoint(background=True) returned no PendingSave")
        held.append(pending.stats.held_s)
        settle.append(pending.stats.settle_s)
        note(f"background save held {held[-1]:.3f} s, of which {settle[-1]:.3f} s waiting "
             "for optimizer work")
        n = 0
        while not pending.done() or n == 0:
            over.append(step())
            n += 1
            note(f"step during the save {over[-1]:.2f} s")
        pending.wait()
        saves.append({"fallback": pending.fallback, "overlapped_steps": n,
                      **pending.stats.as_json()})
        shutil.rmtree(ck / f"bg{r}")
    s, h, b, o = _median(sync), _median(held), _median(base), _median(over)
    own = _median([x - y for x, y in zip(held, settle, strict=True)])
    return {"sync_save_s": sync, "held_s": held, "settle_s": settle,
            "undisturbed_step_s": base,
            "overlapped_step_s": over, "saves": saves,
            "median": {"sync_save_s": s, "held_s": h,
                       "held_over_sync": h / s if s and h is not None else None,
                       "held_without_settle_s": own,
                       "held_without_settle_over_sync": (own / s if s and own is not None
                                                         else None),
                       "undisturbed_step_s": b, "overlapped_step_s": o,
                       "overlapped_over_undisturbed": o / b if b and o is not None else None}}


def run_child(cmd: list[str], args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    killed: list[str] = []

    def watch() -> None:
        while proc.poll() is None:
            avail = psutil.virtual_memory().available
            if avail < args.min_available:
                killed.append(f"available memory fell to {avail / GiB:.2f} GiB")
                proc.kill()
                return
            if time.perf_counter() - t0 > args.child_timeout:
                killed.append(f"ran past --child-timeout {args.child_timeout:.0f} s")
                proc.kill()
                return
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        stdout = proc.stdout.read() if proc.stdout else ""
        proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    watcher.join()
    if killed:
        return {"killed": killed[0] + "; not a measurement"}
    if proc.returncode != 0:
        return {"failed": f"child exited with {proc.returncode}"}
    return dict(json.loads(stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:small", help="a train.model spec")
    ap.add_argument("--llama2b", action="store_true", help="the 2.07B Llama of scale_bench")
    ap.add_argument("--offload", choices=("cpu", "nvme"), default="cpu")
    ap.add_argument("--dir", default=tempfile.gettempdir(),
                    help="swap files and checkpoints go in a new directory here")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2)))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--base", type=int, default=4, help="undisturbed steps per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-overlap-step", action="store_true",
                    help="offload.optimizer.overlap_step: false (no deferred optimizer update "
                         "pending when the save is called)")
    ap.add_argument("--state-precision", choices=("fp32", "bf16", "int8"), default="fp32",
                    help="offload.optimizer.state_precision (int8 fits the 2.07B run, its "
                         "checkpoint and the kept regions on a smaller disk)")
    ap.add_argument("--share", type=float, default=None,
                    help="outputs.background_save_share (default: the config default)")
    ap.add_argument("--min-available", type=float, default=1.5 * GiB)
    ap.add_argument("--child-timeout", type=float, default=3600.0)
    ap.add_argument("--out", default="bench_out/bg_ckpt_bench.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    run_dir = tempfile.mkdtemp(prefix="bg_ckpt_bench-", dir=args.dir)  # 0700, ours
    try:
        model = args.model
        if args.llama2b:
            model = os.path.join(run_dir, "model")
            os.mkdir(model, 0o700)
            Path(model, "config.json").write_text(json.dumps(LLAMA_2B))
        config: dict[str, Any] = {
            "zero": {"stage": 3}, "precision": "bf16",
            "optimizer": {"type": "adamw", "lr": 1.0e-4}, "gradient_clipping": 1.0,
            "offload": {"device": args.offload}}
        if args.offload == "nvme":
            os.mkdir(os.path.join(run_dir, "swap"), 0o700)
            config["offload"]["path"] = os.path.join(run_dir, "swap")
        optimizer: dict[str, Any] = {}
        if args.no_overlap_step:
            optimizer["overlap_step"] = False
        if args.state_precision != "fp32":
            optimizer["state_precision"] = args.state_precision
        if optimizer:
            config["offload"]["optimizer"] = optimizer
        if args.share is not None:
            config["outputs"] = {"background_save_share": args.share}
        cfg_path = os.path.join(run_dir, "config.json")
        Path(cfg_path).write_text(json.dumps(config))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", model,
               "--config", cfg_path, "--ckpt", os.path.join(run_dir, "ck"),
               "--seq", str(args.seq), "--batch", str(args.batch),
               "--threads", str(args.threads), "--warmup", str(args.warmup),
               "--base", str(args.base), "--repeats", str(args.repeats)]
        row = run_child(cmd, args)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    out = {"bench": "bg_ckpt_bench", "machine": describe(args.dir),
           "args": {k: v for k, v in vars(args).items() if k not in ("child", "config", "ckpt")},
           "model": "llama-2.07B" if args.llama2b else args.model, "result": row}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    med = row.get("median")
    if med:
        print(f"{out['model']} offload {args.offload}, {row['params'] / 1e6:.1f}M params: "
              f"synchronous save {med['sync_save_s']:.3f} s, background save held the "
              f"training thread {med['held_s']:.4f} s ({100 * med['held_over_sync']:.1f} %; "
              f"{med['held_without_settle_s']:.4f} s = "
              f"{100 * med['held_without_settle_over_sync']:.1f} % without waiting for "
              "optimizer work); "
              f"step {med['undisturbed_step_s']:.3f} s undisturbed, "
              f"{med['overlapped_step_s']:.3f} s during the save "
              f"({med['overlapped_over_undisturbed']:.2f}x)")
    else:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
