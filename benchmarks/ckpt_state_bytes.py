"""Checkpoint bytes on disk per offload.optimizer.state_precision (fp32, bf16, int8).

One rank, a stack of Linear layers of about --params parameters, bf16 compute, optimizer
state offloaded (--offload cpu or nvme) so the CPU Adam keeps the moments in the chosen
precision; one step, then save_checkpoint. Reports, per choice: the whole checkpoint
directory's bytes, the moment tensors' bytes (exp_avg + exp_avg_sq, from the rank file's
safetensors header), the moments' bytes per parameter and the save's wall time (one save:
the bytes are the result, the time is indicative).

    python benchmarks/ckpt_state_bytes.py --params 10e6
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's engine
from machine import describe

from tierzero import engine

PRECISIONS = ("fp32", "bf16", "int8")


def _build(params: float, dim: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = max(1, round(params / (dim * dim + dim)))
    return torch.nn.Sequential(*(torch.nn.Linear(dim, dim) for _ in range(layers)))


def _moment_bytes(rank_file: Path) -> int:
    """Bytes of the exp_avg / exp_avg_sq tensors, from the safetensors header."""
    with open(rank_file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
               if k.endswith(("::exp_avg", "::exp_avg_sq")))


def _one(prec: str, args: argparse.Namespace, base: Path) -> dict[str, float]:
    swap = base / f"swap-{prec}"
    swap.mkdir()
    cfg = engine.load_config({
        "precision": "bf16", "zero": {"stage": 3, "units": ["Linear"]},
        "optimizer": {"type": "adamw", "lr": 1e-4},
        "offload": {"device": args.offload, "path": str(swap),
                    "optimizer": {"state_precision": prec}}})
    model = _build(args.params, args.dim)
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    try:
        eng.backward(eng(torch.randn(4, args.dim)).float().square().mean())
        eng.step()
        t0 = time.perf_counter()
        path = eng.save_checkpoint(base / "ck", tag=prec)
        seconds = time.perf_counter() - t0
    finally:
        eng.close()
    assert isinstance(path, Path)
    n = sum(p.numel() for p in model.parameters())
    total = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    moments = _moment_bytes(path / "rank00000.safetensors")
    return {"params": n, "checkpoint_bytes": total, "moment_bytes": moments,
            "moment_bytes_per_param": moments / n, "save_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=10e6, help="model parameters (default 10M)")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--offload", default="cpu", choices=("cpu", "nvme"))
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--out", default="bench_out/ckpt_state_bytes.json")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ckpt_state_bytes_", dir=args.dir))
    try:
        rows = {p: _one(p, args, base) for p in PRECISIONS}
    finally:
        shutil.rmtree(base)  # a directory this script created
    result = {"rows": rows, "offload": args.offload,
              "machine": describe(args.dir or tempfile.gettempdir())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    fp32 = rows["fp32"]
    print("| state_precision | checkpoint | vs fp32 | moments | moments B/param | save |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for p, r in rows.items():
        print(f"| {p} | {r['checkpoint_bytes'] / 1e6:.1f} MB | "
              f"{100 * (r['checkpoint_bytes'] / fp32['checkpoint_bytes'] - 1):+.1f} % | "
              f"{r['moment_bytes'] / 1e6:.1f} MB | {r['moment_bytes_per_param']:.3f} | "
              f"{r['save_s']:.2f} s |")


if __name__ == "__main__":
    main()
