"""Checkpoint speed: tierzero save / load / consolidate against plain-PyTorch baselines.

One rank, fp32, a stack of Linear layers of about --params parameters, Adam state
populated by one step. Per repeat, interleaved:
  tierzero save      eng.save_checkpoint (streamed safetensors, CRC-32, fsync, rename)
  torch.save         {model, optimizer} state dicts of an unsharded twin, then fsync
  tierzero load      eng.load_checkpoint (verify=True: CRC-32 pass over every byte)
  tierzero load -v   eng.load_checkpoint(verify=False)
  torch.load         of the torch.save file, into the twin (load_state_dict)
  consolidate        consolidate_to_safetensors (fp32, one tensor at a time)
  save_file          safetensors.torch.save_file of the twin's state dict, then fsync
  tierzero save/load [cpu|nvme]   the same model with params and optimizer state
                     offloaded (--offload): shards streamed through the tier manager
Medians of --repeats runs; checkpoint bytes / median seconds as GB/s.

    python benchmarks/ckpt_bench.py --quick
    python benchmarks/ckpt_bench.py --params 200e6 --dir /local_nvme/bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's engine
from machine import describe

from tierzero import engine
from tierzero.engine.checkpoint.io import fsync_dir  # fsyncs any path opened read-only

CONFIG: dict[str, object] = {"precision": "fp32", "zero": {"stage": 3, "units": ["Linear"]},
                             "optimizer": {"type": "adamw", "lr": 1e-4}}


def _build(params: float, dim: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = max(1, round(params / (dim * dim + dim)))
    return torch.nn.Sequential(*(torch.nn.Linear(dim, dim) for _ in range(layers)))


def _step(model: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
          backward: Callable[[torch.Tensor], None], dim: int) -> None:
    x = torch.randn(4, dim)
    backward(forward(x).square().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=50e6, help="model parameters (default 50M)")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--out", default="bench_out/ckpt_bench.json")
    ap.add_argument("--quick", action="store_true", help="10M parameters, 3 repeats")
    ap.add_argument("--offload", default="nvme",
                    help="comma list of offload devices (cpu, nvme) also timed; '' = none")
    args = ap.parse_args()
    if args.quick:
        args.params, args.repeats = 10e6, 3
    base = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir))
    try:
        result = _run(args, base)
    finally:
        shutil.rmtree(base)  # a directory this script created
    result["machine"] = describe(args.dir or tempfile.gettempdir())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def _run(args: argparse.Namespace, base: Path) -> dict[str, object]:
    model = _build(args.params, args.dim)
    twin = _build(args.params, args.dim)
    cfg = engine.load_config(CONFIG)
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    _step(model, eng, eng.backward, args.dim)
    eng.step()
    offloaded = {}
    for dev in [d for d in args.offload.split(",") if d]:
        (base / f"swap-{dev}").mkdir()
        ocfg = engine.load_config({**CONFIG, "offload": {
            "device": dev, "path": str(base / f"swap-{dev}")}})
        oeng, _, _, _ = engine.initialize(model=_build(args.params, args.dim), config=ocfg,
                                          device="cpu")
        _step(oeng.module, oeng, oeng.backward, args.dim)
        oeng.step()
        offloaded[dev] = oeng
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-4)
    _step(twin, twin, lambda loss: loss.backward(), args.dim)
    opt.step()
    n = sum(p.numel() for p in twin.parameters())
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], object]) -> None:
        # Flush every dirty page first (untimed): a save's fsync must not wait on the
        # write-back of whatever the previous method wrote.
        os.sync()
        t0 = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    def torch_save(pt: Path) -> None:
        torch.save({"model": twin.state_dict(), "optimizer": opt.state_dict()}, pt)
        fsync_dir(pt)

    def torch_load(pt: Path) -> None:
        sd = torch.load(pt, weights_only=True)
        twin.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])

    def st_save(st: Path) -> None:
        save_file(twin.state_dict(), str(st))
        fsync_dir(st)

    for r in range(args.repeats):
        ck, pt, st, hf = (base / f"tz{r}", base / f"torch{r}.pt", base / f"st{r}.safetensors",
                          base / f"hf{r}")
        timed("tierzero save", partial(eng.save_checkpoint, ck, tag="t"))
        for dev, oeng in offloaded.items():
            timed(f"tierzero save [{dev}]", partial(oeng.save_checkpoint, base / f"{dev}{r}",
                                                    tag="t"))
        timed("torch.save", partial(torch_save, pt))
        timed("tierzero load", partial(eng.load_checkpoint, ck))
        for dev, oeng in offloaded.items():
            timed(f"tierzero load [{dev}]", partial(oeng.load_checkpoint, base / f"{dev}{r}"))
            shutil.rmtree(base / f"{dev}{r}")
        timed("tierzero load -v", partial(eng.load_checkpoint, ck, verify=False))
        timed("torch.load", partial(torch_load, pt))
        timed("consolidate", partial(engine.consolidate_to_safetensors, ck, hf, progress=False))
        timed("save_file", partial(st_save, st))
        shutil.rmtree(ck)
        shutil.rmtree(hf)
        pt.unlink()
        st.unlink()
    state_bytes = n * 4 * 3  # master, exp_avg, exp_avg_sq (fp32)
    rows = {}
    for name, ts in times.items():
        moved = n * 4 if name in ("consolidate", "save_file") else state_bytes
        med = statistics.median(ts)
        rows[name] = {"median_s": med, "all_s": ts, "GB_per_s": moved / med / 1e9}
    eng.close()
    for oeng in offloaded.values():
        oeng.close()
    return {"params": n, "state_bytes": state_bytes, "repeats": args.repeats,
            "torch": torch.__version__, "rows": rows}


if __name__ == "__main__":
    main()
