"""Writing a trained model as a Hugging Face directory from an NVMe-offloaded engine.

Variants, each in a fresh process, interleaved, `repeats` rounds, medians reported:
  export     tierzero.export_hf(eng, dir): one flat group at a time from the store
  baseline   eng.save_checkpoint(ckpt) + consolidate_to_safetensors(ckpt, dir): the path
             before export_hf (a full checkpoint, optimizer state included, then a
             second pass that cuts parameters out of it)
The model: a Hugging Face Llama (fp32 compute, every class offloaded to NVMe under a
temporary directory, world size 1), one optimizer step taken so every shard exists.
Memory: peak RSS growth during the write (VmHWM reset through /proc/self/clear_refs
just before it); disk: bytes written under the temporary directory.

    python benchmarks/export_bench.py --quick
    python benchmarks/export_bench.py --repeats 3 --out bench_out/export.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
import torch, transformers
sys.path.insert(0, sys.argv[3])
import tierzero
variant, tmp, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[4])

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0

def du(path):
    return sum(f.stat().st_size for f in __import__("pathlib").Path(path).rglob("*")
               if f.is_file())

torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=spec["hidden"], intermediate_size=spec["inter"],
                               num_hidden_layers=spec["layers"], num_attention_heads=8,
                               num_key_value_heads=8, vocab_size=spec["vocab"])
model = transformers.LlamaForCausalLM(cfg)
params = sum(p.numel() for p in model.parameters())
os.makedirs(f"{tmp}/swap")
eng, *_ = tierzero.initialize(model=model, config={
    "precision": "fp32", "offload": {"device": "nvme", "path": f"{tmp}/swap"}})
ids = torch.randint(0, spec["vocab"], (1, 32))
out = eng(input_ids=ids, labels=ids)
eng.backward(out.loss)
eng.step()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM (peak RSS) to the current RSS
base = status("VmRSS")
t0 = time.perf_counter()
if variant == "export":
    tierzero.export_hf(eng, f"{tmp}/hf")
    written = du(f"{tmp}/hf")
else:
    eng.save_checkpoint(f"{tmp}/ckpt", tag="final")
    tierzero.consolidate_to_safetensors(f"{tmp}/ckpt", f"{tmp}/hf", progress=False)
    written = du(f"{tmp}/hf") + du(f"{tmp}/ckpt")
seconds = time.perf_counter() - t0
peak = status("VmHWM") - base
eng.close()
print(json.dumps({"seconds": seconds, "peak_rss_growth": peak, "written_bytes": written,
                  "parameters": params}))
"""

SPECS = {"quick": {"hidden": 256, "inter": 688, "layers": 4, "vocab": 4000},
         "full": {"hidden": 512, "inter": 1376, "layers": 8, "vocab": 8000}}


def run_one(variant: str, spec: dict[str, int]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        proc = subprocess.run([sys.executable, "-c", CHILD, variant, tmp, str(ROOT),
                               json.dumps(spec)], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model, one round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    spec = SPECS["quick" if args.quick else "full"]
    repeats = 1 if args.quick else args.repeats
    runs: dict[str, list[dict[str, float]]] = {"export": [], "baseline": []}
    for _ in range(repeats):
        for variant, results in runs.items():  # interleaved: both see the same load
            results.append(run_one(variant, spec))
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    summary = {"machine": cpu_model(), "model": spec, "repeats": repeats, "median": med,
               "ratio_baseline_over_export": {
                   k: med["baseline"][k] / med["export"][k] for k in
                   ("seconds", "peak_rss_growth", "written_bytes") if med["export"][k]}}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
