"""Loss curves of offload.optimizer.state_precision fp32 / bf16 / int8 (compressed Adam moments)
and of offload.optimizer.master_precision bf16 (no fp32 master: [Note: bf16 master weights]).

Two runs, each with every choice from the same initial weights on the same batches:
  scratch   the built-in byte-level GPT (engine/models/tiny_lm.py, dim 128, 4 blocks) trained
            from scratch on this repository's docs and sources (bytes)
  finetune  a small Llama (transformers, hidden 128, 4 layers, byte vocabulary) first
            pretrained here with plain torch AdamW on the docs and saved with save_pretrained
            (nothing is downloaded), then loaded with from_pretrained and fine-tuned by the
            engine on the Python sources
The engine runs with the optimizer state in host memory (offload cpu: the in-place CPU Adam;
the NVMe stream runs the same kernel over the same blocks, bit-identical,
tests/engine/step/test_engine_state_precision.py), bf16 compute, AdamW betas (0.9, 0.999).
Final loss: the mean training loss of the last 25 steps (the batches are the same for every
choice); the gap is relative to fp32. With `--eval-batches N` the scratch run also holds the
corpus's last tenth out of training and reports the mean loss over N fixed batches of it
after the last step (`eval_loss`, gap `eval_gap_vs_fp32`), the usual final-loss measure,
free of which training batches the last steps happened to see. `--schedule cosine` warms
the learning rate up over `--warmup` steps and decays it by a half cosine to a tenth at the
last step (the engine's `scheduler: warmup_cosine`), as from-scratch runs are trained;
`--dim/--layers/--heads/--seq` size the scratch model. `--noise-floor` adds a fourth scratch
run, `fp32_jitter`: fp32 again from the initial weights with their last bits perturbed (each
multiplied by 1 +- 2^-20, below what the bf16 compute copy resolves), which shows how far
the final loss moves from fp32's for reasons that have nothing to do with the moments.

`--variants` picks the runs (default fp32,bf16,int8): each is a state precision, with
`+bf16master` for master_precision bf16 (`fp32+bf16master`: bf16 master with fp32 moments,
`int8+bf16master`: with int8 moments), and `_jitter` for the noise-floor run of that
variant (`fp32_jitter` is what --noise-floor adds). Every gap is relative to `fp32`.

    python benchmarks/state_precision_quality.py --out bench_out/state_quality.json \\
        --plot docs/state_precision_loss.png
    python benchmarks/state_precision_quality.py --runs scratch --variants \\
        fp32,fp32+bf16master,int8+bf16master,fp32_jitter --eval-batches 32 ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierzero import engine  # noqa: E402
from tierzero.engine.models.tiny_lm import TinyLM, TinyLMConfig  # noqa: E402

PRECISIONS = ("fp32", "bf16", "int8")


def variant(name: str) -> tuple[str, str, bool]:
    """(state_precision, master_precision, jitter) of a --variants entry."""
    base, jittered = name.removesuffix("_jitter"), name.endswith("_jitter")
    state, _, master = base.partition("+")
    if state not in PRECISIONS or master not in ("", "bf16master"):
        raise ValueError(f"variant {name!r}: allowed: <fp32|bf16|int8>[+bf16master][_jitter]")
    return state, "bf16" if master else "fp32", jittered


def corpus(patterns: tuple[str, ...]) -> torch.Tensor:
    data = b"".join(p.read_bytes() for pat in patterns for p in sorted(ROOT.glob(pat)))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(data: torch.Tensor, n: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        out.append(torch.stack([data[s:s + seq + 1] for s in starts.tolist()]))
    return out


def engine_losses(model: torch.nn.Module, prec: str, rows: list[torch.Tensor], lr: float, *,
                  hf: bool, schedule: dict[str, Any] | None = None,
                  held_out: list[torch.Tensor] | None = None,
                  master: str = "fp32") -> tuple[list[float], float | None]:
    """Training losses of each step and, with `held_out`, the mean loss over those batches
    after the last step (no gradients; the same batches for every choice)."""
    cfg = engine.load_config({
        "zero": {"stage": 3}, "precision": "bf16",
        "optimizer": {"type": "adamw", "lr": lr, "betas": [0.9, 0.999], "weight_decay": 0.01},
        "scheduler": schedule or {"type": "constant"},
        "offload": {"device": "cpu", "optimizer": {"state_precision": prec,
                                                   "master_precision": master}}})
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    losses = []
    eval_loss = None
    try:
        for row in rows:
            if hf:
                loss = eng(input_ids=row[:, :-1], labels=row[:, :-1]).loss
            else:
                loss = eng(row[:, :-1], row[:, 1:]).loss
            eng.backward(loss)
            eng.step()
            losses.append(float(loss.detach()))
            if len(losses) % 50 == 0:
                print(f"  {prec} step {len(losses)}: {statistics.mean(losses[-50:]):.4f}",
                      flush=True)
        if held_out:
            eng.eval()
            with torch.no_grad():
                eval_loss = statistics.mean(
                    float(eng(row[:, :-1], row[:, 1:]).loss) for row in held_out)
            eng.train()
    finally:
        eng.close()
    return losses, eval_loss


def jitter(model: torch.nn.Module) -> None:
    """Multiply every weight by 1 +- 2^-20 (fixed random signs): fp32's noise floor."""
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            sign = torch.randint(0, 2, p.shape, generator=gen) * 2 - 1
            p.mul_(1 + 2.0 ** -20 * sign)


def scratch(args: argparse.Namespace) -> dict[str, Any]:
    data = corpus(("docs/*.md", "engine/*.py", "offload/*.py"))
    held_out = None
    if args.eval_batches:  # the last tenth is never trained on
        cut = data.numel() * 9 // 10
        data, rest = data[:cut], data[cut:]
        held_out = batches(rest, args.eval_batches, args.batch, args.seq, seed=7)
    rows = batches(data, args.steps, args.batch, args.seq, seed=1 + 100 * args.seed)
    cfg = TinyLMConfig(dim=args.dim, layers=args.layers, heads=args.heads,
                       max_seq_len=args.seq)
    schedule = None
    if args.schedule == "cosine":
        schedule = {"type": "warmup_cosine", "warmup_steps": args.warmup,
                    "total_steps": args.steps, "min_lr": args.lr / 10}
    torch.manual_seed(args.seed)
    init = TinyLM(cfg).state_dict()
    out: dict[str, Any] = {"params": sum(v.numel() for v in init.values()), "curves": {},
                           "eval_loss": {}}
    for name in args.variants + (["fp32_jitter"] if args.noise_floor else []):
        prec, master, jittered = variant(name)
        model = TinyLM(cfg)
        model.load_state_dict(init)
        if jittered:
            jitter(model)
        t = time.perf_counter()
        out["curves"][name], ev = engine_losses(model, prec, rows, args.lr, hf=False,
                                                schedule=schedule, held_out=held_out,
                                                master=master)
        if ev is not None:
            out["eval_loss"][name] = ev
        print(f"scratch {name}: final {statistics.mean(out['curves'][name][-25:]):.4f}"
              + (f", held-out {ev:.4f}" if ev is not None else "")
              + f" ({time.perf_counter() - t:.0f} s)", flush=True)
    if not out["eval_loss"]:
        del out["eval_loss"]
    return out


def finetune(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    hf_cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=args.seq)
    pre = corpus(("docs/*.md", "README.md"))
    tune = corpus(("engine/*.py", "offload/*.py", "swap/*.py"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for row in batches(pre, args.pretrain_steps, args.batch, args.seq, seed=2):
        loss = model(input_ids=row[:, :-1], labels=row[:, :-1]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"pretrained: loss {float(loss):.4f}", flush=True)
    rows = batches(tune, args.steps, args.batch, args.seq, seed=3)
    out: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters()),
                           "pretrain_final_loss": float(loss), "curves": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for name in args.variants:
            prec, master, jittered = variant(name)
            tuned = transformers.LlamaForCausalLM.from_pretrained(tmp)
            if jittered:
                jitter(tuned)
            t = time.perf_counter()
            out["curves"][name], _ = engine_losses(tuned, prec, rows, args.ft_lr, hf=True,
                                                   master=master)
            print(f"finetune {name}: final {statistics.mean(out['curves'][name][-25:]):.4f} "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)
    return out


def summarise(run: dict[str, Any]) -> None:
    final = {p: statistics.mean(c[-25:]) for p, c in run["curves"].items()}
    run["final_loss"] = final
    if "fp32" not in final:  # runs made to join another file's (table() merges them)
        return
    run["gap_vs_fp32"] = {p: (final[p] - final["fp32"]) / final["fp32"] for p in final}
    if ev := run.get("eval_loss"):
        run["eval_gap_vs_fp32"] = {p: (ev[p] - ev["fp32"]) / ev["fp32"] for p in ev}


def table(files: list[str]) -> list[str]:
    """Markdown: per run (a seed; the same run in several files is joined), each variant's
    held-out loss (else final training loss) and gap to fp32; then the noise floor of fp32
    against itself: the largest |gap| of the `_jitter` runs over all seeds (the
    perturbation floor) and fp32's seed-to-seed spread (std / mean of its loss), and per
    variant the seeds whose |gap| is within each. A `+bf16master` variant whose fp32-master
    counterpart ran too (int8+bf16master and int8) is also compared with it, seed by seed:
    the master's own effect."""
    runs: dict[str, dict[str, Any]] = {}
    for f in files:
        for k, v in json.loads(Path(f).read_text()).items():
            if isinstance(v, dict) and "curves" in v:
                run = runs.setdefault(k, {"curves": {}, "final_loss": {}, "eval_loss": {}})
                for part in ("curves", "final_loss", "eval_loss"):
                    run[part].update(v.get(part, {}))
    names = list(dict.fromkeys(n for run in runs.values() for n in run["curves"]))
    loss = {k: run["eval_loss"] or run["final_loss"] for k, run in runs.items()}
    gaps = {n: {k: (lk[n] - lk["fp32"]) / lk["fp32"] for k, lk in loss.items() if n in lk}
            for n in names}
    out = ["| run | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for k, lk in loss.items():
        out.append(f"| {k} | " + " | ".join(
            "-" if n not in lk else f"{lk[n]:.4f}" if n == "fp32" else
            f"{lk[n]:.4f} ({100 * gaps[n][k]:+.2f} %)" for n in names) + " |")
    out.append("| mean / worst | " + " | ".join(
        "" if n == "fp32" else f"{100 * statistics.mean(gaps[n].values()):+.2f} % / "
        f"{100 * max(gaps[n].values(), key=abs):+.2f} %" for n in names) + " |")
    jit = [n for n in names if n.endswith("_jitter")]
    floor = max((abs(g) for n in jit for g in gaps[n].values()), default=float("nan"))
    base = [lk["fp32"] for lk in loss.values()]
    spread = statistics.stdev(base) / statistics.mean(base) if len(base) > 1 else float("nan")
    out += ["", f"noise floor: fp32 perturbed moves by up to {100 * floor:.2f} %; fp32's own "
            f"seed-to-seed spread (std / mean) is {100 * spread:.2f} %"]
    for n in [n for n in names if n != "fp32" and n not in jit]:
        g = gaps[n]
        own = [k for k in g if jit and k in gaps[jit[0]]]
        line = (f"- {n}: |gap to fp32| within the perturbation floor on "
                f"{sum(abs(x) <= floor for x in g.values())} of {len(g)} seeds, within its "
                f"seed's perturbed run on {sum(abs(g[k]) <= abs(gaps[jit[0]][k]) for k in own)}"
                f" of {len(own)}, within fp32's seed-to-seed spread on "
                f"{sum(abs(x) <= spread for x in g.values())}; worst "
                f"{100 * max(map(abs, g.values())):.2f} %")
        twin = n.removesuffix("+bf16master")
        if twin not in (n, "fp32") and twin in names:
            rel = {k: (loss[k][n] - loss[k][twin]) / loss[k][twin] for k in g if twin in loss[k]}
            mean, worst = statistics.mean(rel.values()), max(rel.values(), key=abs)
            line += (f"; against {twin} (fp32 master): mean {100 * mean:+.2f} %, worst "
                     f"{100 * worst:+.2f} %, within the perturbation floor on "
                     f"{sum(abs(x) <= floor for x in rel.values())} of {len(rel)}")
        out.append(line)
    return out


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k, v in result.items() if isinstance(v, dict) and "curves" in v]
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        run = result[name]
        for prec, curve in run["curves"].items():
            k = 10  # moving average over 10 steps
            smooth = [statistics.mean(curve[max(0, i - k + 1):i + 1]) for i in range(len(curve))]
            label = (f"{prec} (final {run['final_loss'][prec]:.3f}, "
                     f"{100 * run['gap_vs_fp32'][prec]:+.2f}%")
            if "eval_loss" in run:
                label += (f"; held-out {run['eval_loss'][prec]:.3f}, "
                          f"{100 * run['eval_gap_vs_fp32'][prec]:+.2f}%")
            ax.plot(smooth, label=label + ")")
        ax.set_title(f"{name} ({run['params'] / 1e6:.2f}M params)")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (10-step mean)")
        ax.legend()
    fig.suptitle("offload.optimizer.state_precision (Adam moments) and master_precision")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--pretrain-steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ft-lr", type=float, default=5e-4)
    ap.add_argument("--runs", default="scratch,finetune")
    ap.add_argument("--out", default="bench_out/state_quality.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="scratch: initial weights and batches")
    ap.add_argument("--dim", type=int, default=128, help="scratch model width")
    ap.add_argument("--layers", type=int, default=4, help="scratch model blocks")
    ap.add_argument("--heads", type=int, default=4, help="scratch model attention heads")
    ap.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                    help="scratch: constant lr, or warm-up then half cosine to lr/10")
    ap.add_argument("--warmup", type=int, default=30, help="scratch: warm-up steps (cosine)")
    ap.add_argument("--eval-batches", type=int, default=0,
                    help="scratch: held-out batches scored after the last step (0: none)")
    ap.add_argument("--noise-floor", action="store_true",
                    help="scratch: also fp32 from initial weights perturbed by 2^-20")
    ap.add_argument("--variants", default="fp32,bf16,int8",
                    help="runs: <fp32|bf16|int8>[+bf16master][_jitter], comma-separated; the "
                    "gaps are against fp32 (runs without it join another file's in --table)")
    ap.add_argument("--tag", default=None,
                    help="scratch: result key (default scratch, or scratch_seed<N>)")
    ap.add_argument("--table", default=None,
                    help="a,b: only print the markdown table of these result files")
    ap.add_argument("--merge", default=None,
                    help="a,b: only merge these result files (runs made separately, e.g. in "
                         "parallel) into --out and plot them")
    args = ap.parse_args()
    for flag in ("steps", "batch", "seq", "dim", "layers", "heads", "threads"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} {getattr(args, flag)}: allowed: an integer >= 1")
    for flag in ("warmup", "eval_batches", "pretrain_steps"):
        if getattr(args, flag) < 0:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: allowed: an integer >= 0")
    args.variants = args.variants.split(",")
    try:
        for name in args.variants:
            variant(name)
    except ValueError as exc:
        ap.error(f"--variants: {exc}")
    if "fp32" not in args.variants:
        print("--variants without fp32: no gaps here; join this file with one that has fp32 "
              "(--table a.json,b.json)", file=sys.stderr)
    if args.schedule == "cosine" and args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup}: allowed: fewer than --steps ({args.steps})")
    if args.table:
        print("\n".join(table(args.table.split(","))))
        return
    if args.merge:
        merged: dict[str, Any] = {}
        for f in args.merge.split(","):
            merged.update(json.loads(Path(f).read_text()))
        Path(args.out).write_text(json.dumps(merged, indent=1))
        if args.plot:
            plot(merged, args.plot)
        return
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"args": vars(args)}
    for name in args.runs.split(","):
        key = f"{name}_seed{args.seed}" if name == "scratch" and args.seed else name
        if name == "scratch" and args.tag:
            key = args.tag
        result[key] = {"scratch": scratch, "finetune": finetune}[name](args)
        summarise(result[key])
        print(key, json.dumps(result[key].get("gap_vs_fp32")),
              json.dumps(result[key].get("eval_gap_vs_fp32")), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot and {"scratch", "finetune"} <= set(result):
        plot(result, args.plot)


if __name__ == "__main__":
    main()
