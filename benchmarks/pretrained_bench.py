"""Loading a sharded safetensors checkpoint into a tierzero engine: time and extra memory.

Variants, each in a fresh process (clean memory accounting), interleaved, `repeats`
rounds, medians reported:
  tierzero   engine.load_pretrained(eng, dir): streams tensor by tensor into the shards
  baseline   safetensors.torch.load_file per file + model.load_state_dict, the usual
             "materialise, then hand to the engine" path (what loading with
             transformers and then partitioning does)
Both start from the same model (an nn.Sequential of bias-free square Linears, fp32)
already built; tierzero's is already partitioned by engine.initialize (world size 1,
fp32, no offload). Memory: peak RSS growth during the load (VmHWM reset through
/proc/self/clear_refs just before it). It counts the checkpoint's pages that safetensors
maps and touches (both variants read every byte once, world size 1), so it shows the
difference only beyond those; `largest_read_bytes` is tierzero's arithmetic bound on
its own buffers (the baseline's: the whole state dict).

    python benchmarks/pretrained_bench.py --quick
    python benchmarks/pretrained_bench.py --out bench_out/pretrained.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import torch
sys.path.insert(0, sys.argv[4])
from tierzero import engine
from safetensors.torch import load_file
variant, ckpt, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0

model = torch.nn.Sequential(*[torch.nn.Linear(spec["dim"], spec["dim"], bias=False)
                              for _ in range(spec["n"])])
eng = None
if variant == "tierzero":
    eng, _, _, _ = engine.initialize(model=model, config={"zero": {"stage": 3},
                                     "precision": "fp32"}, device="cpu")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM (peak RSS) to the current RSS
base = status("VmRSS")
t0 = time.perf_counter()
largest = 0
if variant == "tierzero":
    largest = engine.load_pretrained(eng, ckpt).peak_read_bytes
else:
    import glob
    sd = {}
    for f in sorted(glob.glob(ckpt + "/*.safetensors")):
        sd.update(load_file(f))
    model.load_state_dict(sd)
    largest = sum(v.numel() * v.element_size() for v in sd.values())
    del sd
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "peak_rss_growth_bytes": status("VmHWM") - base,
                  "largest_read_bytes": largest}))
"""


def machine(directory: Path) -> dict[str, str]:
    model = "unknown"
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(directory)], capture_output=True,
                        check=False, text=True).stdout.strip()
    return {"cpu": model, "cores": str(os.cpu_count()), "torch": torch.__version__,
            "python": platform.python_version(), "fs": f"{directory} ({fs})",
            "loadavg_at_start": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def write_checkpoint(directory: Path, n: int, dim: int, files: int) -> None:
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {f"{k}.weight": torch.randn(dim, dim, generator=g) for k in range(i, n, files)}
        save_file(part, str(directory / name))
        weight_map.update(dict.fromkeys(part, name))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


def run_child(variant: str, ckpt: Path, spec: dict[str, int]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, variant, str(ckpt), json.dumps(spec), str(ROOT)],
        capture_output=True, text=True, check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB checkpoint, 3 rounds")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoint is written")
    ap.add_argument("--out", type=Path, default=ROOT / "bench_out" / "pretrained.json")
    args = ap.parse_args()
    spec = {"n": 16, "dim": 1024} if args.quick else {"n": 32, "dim": 2048}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ckpt = Path(tmp)
        write_checkpoint(ckpt, spec["n"], spec["dim"], files=4)
        info = machine(ckpt)
        rows: dict[str, list[dict[str, float]]] = {"tierzero": [], "baseline": []}
        for _ in range(args.repeats):
            for variant, runs in rows.items():  # interleaved
                runs.append(run_child(variant, ckpt, spec))
    total = spec["n"] * spec["dim"] ** 2 * 4
    result: dict[str, object] = {"machine": info, "checkpoint_bytes": total,
                                 "tensor_bytes": spec["dim"] ** 2 * 4, "spec": spec}
    for variant, runs in rows.items():
        result[variant] = {
            "seconds_median": statistics.median(r["seconds"] for r in runs),
            "peak_rss_growth_bytes_median": statistics.median(
                r["peak_rss_growth_bytes"] for r in runs),
            "largest_read_bytes": runs[0]["largest_read_bytes"],
            "runs": runs,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
