"""How long `tierzero plan` takes now that it runs the engine, against placement alone.

Per model, two ways of planning every offload choice (none, cpu, nvme, auto) on
one 80 GB GPU with 512 GB of RAM and 4 TB of NVMe:
  placement  the engine's shard store declared and finalized per choice (the
             table: homes, budgets, pool), no dry run;
  full       placement plus the engine's dry run of two steps on meta tensors
             for each choice that fits (traffic, peaks, predicted time).
Models: Llama-shaped 7B / 40B / 70B Hugging Face configs (built on meta with
transformers; skipped without it) and a 40B parameter count. The two ways
alternate in a fresh random order each round; medians over rounds. Model
construction is timed separately, once.

    python benchmarks/plan_bench.py --quick
    python benchmarks/plan_bench.py --out bench_out/plan_bench.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from machine import describe

from tierzero.engine.plan import Machine, ModelShape, model_shape, plan_all

GB = 10**9
MACHINE = Machine(device_bytes=80 * GB, host_bytes=512 * GB, nvme_bytes=4000 * GB, cuda=True,
                  nvme_read_gbps=6.0, nvme_write_gbps=5.0, copy_gbps=25.0,
                  adam_params_per_s=2e9)
LLAMAS = {  # name: (hidden, intermediate, layers, heads, kv heads)
    "llama-7b": (4096, 11008, 32, 32, 32),
    "llama-40b": (8192, 22016, 56, 64, 8),
    "llama-70b": (8192, 28672, 80, 64, 8),
}


def llama_file(directory: Path, name: str) -> str:
    hidden, inter, layers, heads, kv = LLAMAS[name]
    path = directory / f"{name}.json"
    path.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "vocab_size": 32000, "max_position_embeddings": 4096,
        "tie_word_embeddings": False}))
    return str(path)


def models(quick: bool, directory: Path) -> dict[str, str]:
    out = {"count-40b": "40B"}
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers missing: Llama configs skipped")
        return out
    for name in (["llama-7b"] if quick else list(LLAMAS)):
        out[name] = llama_file(directory, name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="count-40b and llama-7b (< 1 min)")
    ap.add_argument("--out", default="bench_out/plan_bench.json")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats must be >= 3 (medians of at least 3 rounds)")
    info = describe()
    print("machine:", json.dumps(info))
    rng = random.Random(0)
    rows: dict[str, dict[str, object]] = {}
    medians: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tz-plan-bench-") as tmp:
        for name, spec in models(args.quick, Path(tmp)).items():
            t0 = time.perf_counter()
            shape: ModelShape = model_shape(spec)
            build_s = time.perf_counter() - t0
            times: dict[str, list[float]] = {"placement": [], "full": []}
            for _ in range(args.repeats):
                order = list(times)
                rng.shuffle(order)
                for way in order:
                    t0 = time.perf_counter()
                    plans = plan_all(shape, MACHINE, world_size=1, precision="bf16",
                                     nvme_path=tmp, traffic=way == "full")
                    times[way].append(time.perf_counter() - t0)
            fitting = [p.choice for p in plans if p.fits]
            medians[name] = {k: statistics.median(v) for k, v in times.items()}
            rows[name] = {"parameters": shape.parameters, "units": len(shape.units),
                          "build_s": build_s, "fitting": fitting,
                          "median_s": medians[name],
                          "rounds_s": times}
    print(f"plan of every offload choice, 80 GB device / 512 GB host / 4 TB NVMe, "
          f"{args.repeats} rounds")
    print("| model | params | units | build s | placement s | full s | choices that fit |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, r in rows.items():
        med = medians[name]
        print(f"| {name} | {r['parameters'] / 1e9:.2f}B | {r['units']} | {r['build_s']:.2f} | "
              f"{med['placement']:.2f} | {med['full']:.2f} | {', '.join(r['fitting'])} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": info, "models": rows}, indent=2))
    print("written:", args.out)


if __name__ == "__main__":
    main()
