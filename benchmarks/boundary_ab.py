"""The layer-major boundary store on and off in one process: what it costs a step.

A Hugging Face Llama (--layers x --hidden, all state on NVMe, bf16, clipping 1.0) trains
layer-major with --accum micro-batches of 1 x --seq tokens; on alternate steps
`engine.boundary.store_for` is the real one (the store runs; with the default rooms it
moves nothing on a machine with free RAM) or returns None (the pass keeps its leaves
itself, as before the store). Reported: median step seconds of each (the first step of
each dropped), their ratio, and the store's counters. Writes --out as JSON.

    .venv/bin/python benchmarks/boundary_ab.py --swap /var/tmp
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's engine
sys.path.insert(0, str(HERE))
from machine import describe  # noqa: E402

from tierzero import engine  # noqa: E402
from tierzero.engine import boundary  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--swap", default=tempfile.gettempdir())
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12, help="steps in all, alternating")
    ap.add_argument("--out", default="bench_out/boundary_ab.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    hf = transformers.LlamaConfig(vocab_size=4096, hidden_size=args.hidden,
                                  intermediate_size=args.hidden * 11 // 4,
                                  num_hidden_layers=args.layers, num_attention_heads=8,
                                  num_key_value_heads=8)
    model = transformers.LlamaForCausalLM(hf)
    with tempfile.TemporaryDirectory(dir=args.swap) as swap:
        cfg = engine.load_config({
            "zero": {"stage": 3}, "precision": "bf16", "gradient_clipping": 1.0,
            "batch": {"gradient_accumulation_steps": args.accum, "schedule": "layer_major"},
            "optimizer": {"type": "adamw", "lr": 1e-4},
            "offload": {"device": "nvme", "path": swap}})
        eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
        g = torch.Generator().manual_seed(0)
        mbs = []
        for _ in range(args.accum):
            ids = torch.randint(0, hf.vocab_size, (1, args.seq), generator=g)
            mbs.append({"input_ids": ids, "labels": ids})
        real = boundary.store_for
        times: dict[str, list[float]] = {"on": [], "off": []}
        try:
            for i in range(args.steps):
                mode = "on" if i % 2 else "off"
                boundary.store_for = real if mode == "on" else (lambda *_a: None)
                start = time.perf_counter()
                eng.train_batch(mbs)
                times[mode].append(time.perf_counter() - start)
        finally:
            boundary.store_for = real
        counters = eng.memory_report()["layer_major_boundary"]
        eng.close()
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    out = {"bench": "boundary_ab", "machine": describe(args.swap), "args": vars(args),
           "step_s": times, "median_s": med, "on_over_off": med["on"] / med["off"],
           "boundary": counters}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"boundary store on {med['on']:.4f} s, off {med['off']:.4f} s per step "
          f"({med['on'] / med['off']:.3f}x); {counters}")


if __name__ == "__main__":
    main()
