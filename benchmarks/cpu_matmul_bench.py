"""bf16 matrix products on this CPU: torch's native kernel against fp32 products rounded once.

[Note: low-precision matmul on CPU] in engine/cpu_matmul.py: where torch has no fast
bf16 kernel for the CPU (no oneDNN support, e.g. AVX2-only CPUs), `precision.cpu_matmul:
auto` computes the engine's bf16 products in fp32. Four measurements, each against its
baselines in the same run:

  kernels   one Linear's forward and backward (the output, input and weight gradients)
            at a few transformer shapes: fp32, bf16 native, bf16 under the mode; the
            median of --repeats
  panels    the seven Linears of one layer of scale_bench's 2.07B Llama (hidden 2560,
            MLP 6912), forward and backward at --panel-tokens tokens, with the products
            over `PANEL` elements in panels ([Note: fp32 products in panels]) and upcast
            whole, alternating, the median of --repeats; and the largest fp32 tensor
            either way allocates (one recorded pass each)
  orientation
            the same layer at --panel-tokens tokens, forward and backward, each product's
            fp32 result laid out as the engine chooses ([Note: the product's larger
            operand on the left]) against every result row-major (the layout torch gives
            by itself), alternating, the median of --repeats; and forward alone likewise
  default   `tierzero train`'s default run (configs/default.yaml: builtin:small, bf16,
            offloaded to NVMe under --swap) with precision.cpu_matmul native, and fp32,
            and with precision fp32; engines take turns in blocks of --block timed steps
            (after one untimed), --blocks each; the median step per engine

    python benchmarks/cpu_matmul_bench.py --out bench_out/cpu_matmul.json
    python benchmarks/cpu_matmul_bench.py --only panels --repeats 7 --out bench_out/panels.json
    python benchmarks/cpu_matmul_bench.py --only orientation --panel-tokens 16,64,256,1024 \
        --repeats 9 --out bench_out/orientation.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine
from torch.utils._python_dispatch import TorchDispatchMode

from tierzero import engine
from tierzero.engine import cpu_matmul
from tierzero.engine.cpu_matmul import LowPrecisionMatmul, native_matmul_is_slow
from tierzero.engine.train.data.build import load_data
from tierzero.engine.train.loop import token_loss
from tierzero.engine.train.model_source import build_model

# (tokens, in, out): an attention projection and an MLP's up projection of a 1024-wide
# model, and a 2560-wide projection at 64 tokens (scale_bench's 2.07B, 1 x 64 tokens)
SHAPES = [(256, 1024, 1024), (256, 1024, 4096), (64, 2560, 2560)]


def linear_s(tokens: int, d_in: int, d_out: int, dtype: torch.dtype, *, mode: bool,
             repeats: int) -> float:
    """Median seconds of one Linear's forward and backward."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d_in, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(d_out, d_in, generator=g) / d_in ** 0.5).to(dtype).requires_grad_()
    dy = torch.randn(tokens, d_out, generator=g).to(dtype)
    times = []
    for _ in range(repeats + 1):  # the first warms up
        x.grad = w.grad = None
        t0 = time.perf_counter()
        with LowPrecisionMatmul(dtype) if mode else contextlib.nullcontext():
            F.linear(x, w).backward(dy)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def kernels(repeats: int) -> list[dict[str, Any]]:
    rows = []
    for tokens, d_in, d_out in SHAPES:
        fp32 = linear_s(tokens, d_in, d_out, torch.float32, mode=False, repeats=repeats)
        native = linear_s(tokens, d_in, d_out, torch.bfloat16, mode=False, repeats=repeats)
        upcast = linear_s(tokens, d_in, d_out, torch.bfloat16, mode=True, repeats=repeats)
        flops = 3 * 2 * tokens * d_in * d_out
        rows.append({"shape": [tokens, d_in, d_out], "fp32_s": fp32, "bf16_native_s": native,
                     "bf16_fp32_products_s": upcast, "native_over_upcast": native / upcast,
                     "upcast_over_fp32": upcast / fp32,
                     "gflops": {"fp32": flops / fp32 / 1e9, "bf16_native": flops / native / 1e9,
                                "bf16_fp32_products": flops / upcast / 1e9}})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# (in, out) of one 2.07B layer's Linears: q, k, v, o; gate, up; down
LAYER_2B = [(2560, 2560)] * 4 + [(2560, 6912)] * 2 + [(6912, 2560)]


class Fp32Peak(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The element count of the largest fp32 tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def _layer(ws: list[torch.Tensor], xs: list[torch.Tensor], dys: list[torch.Tensor],
           panel: int, peak: Fp32Peak | None = None) -> float:
    """Seconds of each Linear's forward and backward under the mode, `PANEL` = `panel`."""
    cpu_matmul.PANEL = panel
    for t in ws + xs:
        t.grad = None
    t0 = time.perf_counter()
    with peak or contextlib.nullcontext(), LowPrecisionMatmul(torch.bfloat16):
        for w, x, dy in zip(ws, xs, dys, strict=True):
            F.linear(x, w).backward(dy)
    return time.perf_counter() - t0


def panels(tokens_list: list[int], repeats: int) -> list[dict[str, Any]]:
    """A 2.07B layer's Linears, forward and backward, products in panels against whole
    upcasts, alternating in one process."""
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(o, i, generator=g) / i ** 0.5).bfloat16().requires_grad_()
          for i, o in LAYER_2B]
    default_panel = cpu_matmul.PANEL
    rows = []
    for tokens in tokens_list:
        xs = [torch.randn(tokens, i, generator=g).bfloat16().requires_grad_() for i, _ in LAYER_2B]
        dys = [torch.randn(tokens, o, generator=g).bfloat16() for _, o in LAYER_2B]

        ways = {"panels": default_panel, "whole": 1 << 62}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for r in range(repeats + 1):  # the first round warms up
            for name in (list(ways) if r % 2 else list(ways)[::-1]):
                times[name].append(_layer(ws, xs, dys, ways[name]))
        peaks = {}
        for name, panel in ways.items():
            peak = Fp32Peak()
            _layer(ws, xs, dys, panel, peak)
            peaks[name] = peak.largest
        cpu_matmul.PANEL = default_panel
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        flops = 3 * 2 * tokens * sum(i * o for i, o in LAYER_2B)
        rows.append({"tokens": tokens, "panel": default_panel, "panels_s": med["panels"],
                     "whole_s": med["whole"], "panels_over_whole": med["panels"] / med["whole"],
                     "gflops": {k: flops / v / 1e9 for k, v in med.items()},
                     "largest_fp32_mb": {k: v * 4 / 1e6 for k, v in peaks.items()},
                     "times": times})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "times"}), flush=True)
    return rows


def _row_major(buf: torch.Tensor, rows: int, cols: int, k: int) -> torch.Tensor:
    """The baseline's result layout: always row-major, as torch allocates it."""
    return buf[:rows * cols].view(rows, cols)


def _forward(ws: list[torch.Tensor], xs: list[torch.Tensor]) -> float:
    """Seconds of each Linear's forward under the mode, without autograd."""
    t0 = time.perf_counter()
    with torch.no_grad(), LowPrecisionMatmul(torch.bfloat16):
        for w, x in zip(ws, xs, strict=True):
            F.linear(x, w)
    return time.perf_counter() - t0


def orientation(tokens_list: list[int], repeats: int) -> list[dict[str, Any]]:
    """A 2.07B layer's Linears with each fp32 result laid out as the engine chooses
    (`cpu_matmul._fp32_result`) against always row-major, alternating in one process:
    forward and backward, and forward alone."""
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(o, i, generator=g) / i ** 0.5).bfloat16().requires_grad_()
          for i, o in LAYER_2B]
    chosen = cpu_matmul._fp32_result
    ways = {"chosen": chosen, "row_major": _row_major}
    rows = []
    try:
        for tokens in tokens_list:
            xs = [torch.randn(tokens, i, generator=g).bfloat16().requires_grad_()
                  for i, _ in LAYER_2B]
            dys = [torch.randn(tokens, o, generator=g).bfloat16() for _, o in LAYER_2B]
            times: dict[str, list[float]] = {k: [] for k in ways}
            fwd: dict[str, list[float]] = {k: [] for k in ways}
            for r in range(repeats + 1):  # the first round warms up
                for name in (list(ways) if r % 2 else list(ways)[::-1]):
                    cpu_matmul._fp32_result = ways[name]  # type: ignore[assignment]
                    times[name].append(_layer(ws, xs, dys, cpu_matmul.PANEL))
                    fwd[name].append(_forward(ws, xs))
            med = {k: statistics.median(v[1:]) for k, v in times.items()}
            med_f = {k: statistics.median(v[1:]) for k, v in fwd.items()}
            flops = 2 * tokens * sum(i * o for i, o in LAYER_2B)
            rows.append({"tokens": tokens, "panel": cpu_matmul.PANEL,
                         "chosen_s": med["chosen"], "row_major_s": med["row_major"],
                         "chosen_over_row_major": med["chosen"] / med["row_major"],
                         "forward_chosen_s": med_f["chosen"],
                         "forward_row_major_s": med_f["row_major"],
                         "forward_chosen_over_row_major": med_f["chosen"] / med_f["row_major"],
                         "gflops": {k: 3 * flops / v / 1e9 for k, v in med.items()},
                         "forward_gflops": {k: flops / v / 1e9 for k, v in med_f.items()},
                         "times": times, "forward_times": fwd})
            print(json.dumps({k: v for k, v in rows[-1].items()
                              if k not in ("times", "forward_times")}), flush=True)
    finally:
        cpu_matmul._fp32_result = chosen  # type: ignore[assignment]
    return rows


class Run:
    """One engine of the default config (precision and cpu_matmul set), stepped as
    `tierzero train` does."""

    def __init__(self, name: str, swap_root: str, precision: str, cpu_matmul: str) -> None:
        self.name = name
        tree: dict[str, Any] = yaml.safe_load(
            resources.files("tierzero.configs").joinpath("default.yaml").read_text())
        tree["offload"]["path"] = tempfile.mkdtemp(prefix=f"tz-{name}-", dir=swap_root)
        tree["precision"] = {"dtype": precision, "cpu_matmul": cpu_matmul}
        cfg = engine.load_config(tree)
        data = load_data(cfg.train, micro=cfg.batch.micro_batch_size or 1, accum=1,
                         seed=cfg.seed, rank=0, world=1)
        self.batches = data.batches
        torch.manual_seed(cfg.seed)
        with engine.Init(config=cfg):
            model = build_model(cfg.train.model, cfg.train.seq_len, data.tokenizer.vocab_size,
                                data.tokenizer.name)
        self.eng, _, _, _ = engine.initialize(model=model, config=cfg)
        self.steps: list[float] = []
        self.losses: list[float] = []

    def one(self) -> float:
        eng = self.eng

        def loss_fn(mb: Any) -> torch.Tensor:
            x, y = mb
            out = eng(input_ids=x)
            return token_loss(out.logits if hasattr(out, "logits") else out[0], y)

        t0 = time.perf_counter()
        losses = eng.train_batch([self.batches.next()], loss_fn)
        self.losses.append(float(losses[0]))
        return time.perf_counter() - t0

    def block(self, steps: int) -> None:
        self.one()  # untimed: its forward runs the previous block's deferred update
        self.steps += [self.one() for _ in range(steps)]
        self.eng.step_driver.drain()


def default_run(swap: str, blocks: int, block: int) -> dict[str, Any]:
    runs = [Run("native", swap, "bf16", "native"), Run("fp32_products", swap, "bf16", "fp32"),
            Run("fp32_compute", swap, "fp32", "native")]
    for b in range(blocks):
        for r in runs[b % len(runs):] + runs[:b % len(runs)]:
            r.block(block)
            print(f"block {b} {r.name}: {statistics.median(r.steps[-block:]):.3f} s/step",
                  flush=True)
    out = {r.name: {"step_s": statistics.median(r.steps), "steps": r.steps,
                    "cpu_matmul": r.eng.memory_report()["cpu_matmul"], "losses": r.losses}
           for r in runs}
    for r in runs:
        r.eng.close()
    out["native_over_fp32_products"] = out["native"]["step_s"] / out["fp32_products"]["step_s"]
    out["fp32_products_over_fp32_compute"] = (out["fp32_products"]["step_s"]
                                              / out["fp32_compute"]["step_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="kernel timings per shape")
    ap.add_argument("--blocks", type=int, default=3, help="blocks per engine")
    ap.add_argument("--block", type=int, default=2, help="timed steps per block")
    ap.add_argument("--swap", default="/var/tmp", help="where the engines' swap dirs go")
    ap.add_argument("--only", choices=["kernels", "panels", "orientation", "default"],
                    help="one of the measurements (default: all four)")
    ap.add_argument("--panel-tokens", default="64,256,1024",
                    help="token counts of the panels and orientation measurements")
    ap.add_argument("--out", default="bench_out/cpu_matmul.json")
    args = ap.parse_args()
    result: dict[str, Any] = {
        "machine": machine.describe(args.swap),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16_is_slow": native_matmul_is_slow(torch.bfloat16),
        "threads": torch.get_num_threads()}
    if args.only in (None, "kernels"):
        result["kernels"] = kernels(args.repeats)
    if args.only in (None, "panels"):
        result["panels"] = panels([int(t) for t in args.panel_tokens.split(",")], args.repeats)
    if args.only in (None, "orientation"):
        result["orientation"] = orientation([int(t) for t in args.panel_tokens.split(",")],
                                            args.repeats)
    if args.only in (None, "default"):
        result["default_run"] = default_run(args.swap, args.blocks, args.block)
        d = result["default_run"]
        print(f"default run: native {d['native']['step_s']:.3f} s, fp32 products "
              f"{d['fp32_products']['step_s']:.3f} s, fp32 compute "
              f"{d['fp32_compute']['step_s']:.3f} s a step", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
