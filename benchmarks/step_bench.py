"""Training step time, peak RSS and NVMe traffic: plain PyTorch vs tierzero's offload tiers.

Configurations (each in a fresh child process, so peak RSS is its own; rounds interleave
the configurations, the median over `--repeats` rounds is reported):
  plain     plain PyTorch, fp32 params under torch.autocast(bf16),
            torch.optim.AdamW(fused=True)
  none      tierzero stage 3, bf16, every shard on the device (CPU here)
  cpu       params and optimizer state in host memory, CPU Adam
  opt_nvme  optimizer state on NVMe, params on the device
  all_nvme  params and optimizer state on NVMe
  all_nvme_cache  all_nvme with offload.params.max_in_cpu_bytes = --cache-bytes (default
            2e9: DeepSpeed's default max_in_cpu, 1e9 elements x 2 bytes): parameter shards
            within it are homed in host memory instead
  all_nvme_noverify  all_nvme with nvme.verify: false (not in the default set; name it
            in --configs to measure what the default block checksums cost)
  ds_*      the same under DeepSpeed ZeRO-3 when `deepspeed` imports (else a how-to); each
            tierzero row is compared with DeepSpeed's same placement (ds_pairs.py): all_nvme
            with ds_all_nvme_nocache (`max_in_cpu: 0`), all_nvme_cache with ds_all_nvme
            (DeepSpeed's default, parameters kept in host memory); both DeepSpeed rows run
            whenever either tierzero row does; a :clip row's DeepSpeed twin clips too
Variants: a configuration may carry suffixes, run as rows of their own in the same rounds:
  :clip     gradient clipping at --clip (default 1.0; plain: torch's clip_grad_norm_)
  :noover   offload.optimizer.overlap_step off (tierzero rows; else --overlap-step decides)
  :bf16m, :int8m  offload.optimizer.state_precision bf16 / int8 (compressed moments; tierzero
            rows with an offloaded optimizer)
e.g. `--configs plain,cpu,cpu:clip,cpu:clip:noover` compares the overlapped step with and
without clipping against the step after backward, in the same run.
Models: "mlp" (~80M parameters: embedding, 9 pre-norm MLP blocks of width 1024, head;
batch 16 x 16 tokens) and "hf" (a small Llama from a config, no download, ~30M).

Per row: step time (median), forward+backward and optimizer-step time, peak RSS over the
whole process (VmHWM, model build included) and over the timed steps, NVMe bytes read and
written per step, CPU Adam time, and overlap efficiency = max(compute, NVMe I/O, Adam) /
step time, where compute is plain PyTorch's forward+backward in the same round, Adam is
the CPU Adam kernel's time, and NVMe I/O is the least time the disk needs for the step's
bytes: max(read / read bandwidth, write / write bandwidth, (read + write) / bandwidth of
reads and writes running together). The disk is measured right before every NVMe run (a
virtual disk's speed drifts by tens of percent between minutes), and each run's overlap
uses its own measurement; the row reports the median over the rounds.

    python benchmarks/step_bench.py --quick
    python benchmarks/step_bench.py --swap /local_nvme --out bench_out/step_bench.json
    python benchmarks/step_bench.py --device cuda --swap /local_nvme   # on a GPU

With `--device cuda` the model computes on the GPU (plain: fused AdamW on the GPU under
bf16 autocast; tierzero: `initialize(device="cuda")`, so "none" keeps every shard on the
GPU and the offload rows move them from host memory or NVMe), each step is timed to a
`torch.cuda.synchronize()`, rows add the peak GPU memory, and the DeepSpeed rows are left
out (ds_runner.py runs DeepSpeed's CPU accelerator only).

Children run with glibc's default malloc settings, as users run; `--mmap-threshold 1048576`
reproduces the earlier rows (every row slower: freed blocks are returned and faulted in
again; RSS lower).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import machine  # noqa: E402  (benchmarks/machine.py)
from bench_models import MLPModel  # noqa: E402  (benchmarks/bench_models.py)
from bench_report import drive_seconds, median_row, step_line  # noqa: E402  (benchmarks/bench_report.py)
from ds_pairs import deepspeed_configs, report_deepspeed  # noqa: E402  (benchmarks/ds_pairs.py)

from tierzero import engine, swap  # noqa: E402

CONFIGS = ("plain", "none", "cpu", "opt_nvme", "all_nvme", "all_nvme_cache")
OFFLOAD = {"none": ("none", "none"), "cpu": ("cpu", "cpu"), "opt_nvme": ("none", "nvme"),
           "all_nvme": ("nvme", "nvme"), "all_nvme_cache": ("nvme", "nvme"),
           "all_nvme_noverify": ("nvme", "nvme")}
DS_DEFAULT_MAX_IN_CPU = 2 * 10**9  # offload_param.max_in_cpu 1e9 elements x 2 bytes (bf16)
DS_RUNNER = Path(__file__).resolve().parent / "ds_runner.py"




def build(model: str, quick: bool) -> tuple[nn.Module, tuple[str, ...], int]:
    """(model, unit class names, vocab)."""
    torch.manual_seed(0)
    if model == "mlp":
        dim, blocks, vocab = (512, 4, 2048) if quick else (1024, 9, 4096)
        return MLPModel(vocab, dim, blocks), ("Block",), vocab
    import transformers

    hidden, layers, vocab = (256, 4, 4096) if quick else (512, 8, 16384)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=256, tie_word_embeddings=False, attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg), ("LlamaDecoderLayer",), vocab


class HFLoss(nn.Module):
    """Calls an HF causal LM with (ids, labels) and returns its loss."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out: Any = self.inner(input_ids=ids, labels=labels)
        return out.loss  # type: ignore[no-any-return]


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    with contextlib.suppress(OSError):  # resets VmHWM; older kernels refuse
        Path("/proc/self/clear_refs").write_text("5")


def split_config(config: str) -> tuple[str, set[str]]:
    """"cpu:clip:noover" -> ("cpu", {"clip", "noover"}); unknown suffixes are an error."""
    base, *flags = config.split(":")
    unknown = set(flags) - {"clip", "noover", "bf16m", "int8m"}
    if unknown:
        raise SystemExit(f"--configs {config!r}: unknown variant {sorted(unknown)}; "
                         "allowed: clip, noover, bf16m, int8m")
    return base, set(flags)


def child(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    base, flags = split_config(args.config)
    clip = args.clip if "clip" in flags else 0.0
    dev = torch.device(args.device)
    raw, units, vocab = build(args.model, args.quick)
    model: nn.Module = raw if args.model == "mlp" else HFLoss(raw)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(dev)
    labels = torch.roll(ids, -1, 1)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n_params = sum(p.numel() for p in model.parameters())
    fb: list[float] = []
    opt_s: list[float] = []
    adam_s: list[float] = []
    hidden_s: list[float] = []  # the CPU Adam's seconds on its worker beside compute
    moved0: dict[str, Any] = {}
    if base == "plain":
        model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def one() -> None:
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = model(ids, labels)
            loss.backward()
            sync()
            t1 = time.perf_counter()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            fb.append(t1 - t0)
            opt_s.append(time.perf_counter() - t1)
        report: Any = lambda: None  # noqa: E731
    else:
        p_dev, o_dev = OFFLOAD[base]
        path = tempfile.mkdtemp(dir=args.swap, prefix="step_bench-")
        atexit.register(shutil.rmtree, path, True)  # the swap directory goes with the child
        cfg = engine.load_config({
            "zero": {"stage": 3, "units": list(units), "persistence_threshold_bytes": 0},
            "precision": "bf16", "optimizer": {"type": "adamw", "lr": 1e-4},
            "gradient_clipping": clip,
            "nvme": {"verify": base != "all_nvme_noverify"},
            "offload": {"params": {"device": p_dev, "path": path if p_dev == "nvme" else None,
                                   "max_in_cpu_bytes": (args.cache_bytes if base
                                                        == "all_nvme_cache" else 0)},
                        "optimizer": {"device": o_dev, "path": path if "nvme" in (
                            p_dev, o_dev) else None,
                                      "overlap_step": (args.overlap_step == "on"
                                                       and "noover" not in flags),
                                      "state_precision": ("int8" if "int8m" in flags else
                                                          "bf16" if "bf16m" in flags else
                                                          "fp32"),
                                      **({"buffer_count": args.buffer_count}
                                         if args.buffer_count else {})}}})
        eng, _, _, _ = engine.initialize(model=model, config=cfg, device=dev)

        def one() -> None:
            hidden0 = eng.optimizer_times()[0]
            t0 = time.perf_counter()
            eng.backward(eng(ids, labels))
            sync()
            t1 = time.perf_counter()
            eng.step()
            sync()
            fb.append(t1 - t0)
            opt_s.append(time.perf_counter() - t1)
            hidden_s.append(eng.optimizer_times()[0] - hidden0)
            st = eng.memory_report()["optimizer_step"]
            if st is not None:
                adam_s.append(st["compute_s"])

        def report() -> dict[str, Any] | None:
            tiers = eng.memory_report()["tiers"]
            return None if tiers is None else {**tiers["moved"],
                                               "by_class": tiers["moved_by_class"]}
    warm_up(one, args.warmup, fb, opt_s, adam_s)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    moved0 = report() or {}
    steps, total = timed_steps(one, args.steps)
    moved1 = report() or {}
    per_step = {k: (moved1.get(k, 0) - moved0.get(k, 0)) / args.steps for k in moved1
                if k != "by_class"}
    # bytes per step by direction and tensor class (the tier manager's moved_by_class)
    by_class = {d: {c: (n - moved0.get("by_class", {}).get(d, {}).get(c, 0)) / args.steps
                    for c, n in cls.items()}
                for d, cls in moved1.get("by_class", {}).items()}
    import resource

    return {"config": args.config, "model": args.model, "params": n_params,
            "step_s": statistics.median(steps), "mean_step_s": total / args.steps,
            "fwd_bwd_s": statistics.median(fb), "opt_s": statistics.median(opt_s),
            "adam_s": statistics.median(adam_s) if adam_s else 0.0,
            "hidden_s": statistics.median(hidden_s) if hidden_s else 0.0,
            "nvme_read_per_step": per_step.get("nvme_to_host", 0.0),
            "nvme_write_per_step": per_step.get("host_to_nvme", 0.0),
            "moved_by_class_per_step": by_class,
            "peak_rss_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_rss_train": _hwm(),
            "peak_gpu_bytes": (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"
                               else 0)}


def warm_up(one: Callable[[], None], n: int, *samples: list[float]) -> None:
    """Run `one` n times, then forget the per-phase samples it appended."""
    for _ in range(n):
        one()
    for s in samples:
        s.clear()


def timed_steps(one: Callable[[], None], n: int) -> tuple[list[float], float]:
    """(each step's seconds, all n steps' seconds), the peak-RSS mark reset first."""
    _reset_hwm()
    t0 = time.perf_counter()
    steps = []
    for _ in range(n):
        t = time.perf_counter()
        one()
        steps.append(time.perf_counter() - t)
    return steps, time.perf_counter() - t0


def disk_bandwidth(directory: str, nbytes: int) -> dict[str, float]:
    """GB/s of SwapStore at `directory`: write, read, and write + read of `nbytes` each
    running together (an optimizer step's traffic: the disk shares its bandwidth between
    them, and together they may move more bytes per second than either alone)."""
    # page-aligned, as the engine's buffers are (an unaligned one goes through a bounce copy)
    t = swap.aligned_empty(nbytes // 4, torch.float32).fill_(1.0)
    out = swap.aligned_empty(nbytes // 4, torch.float32)
    with swap.SwapStore(directory) as st:
        # Timed writes land on file space written once before, as the engine's do in
        # steady state (its copy-on-write regions reuse freed space): a first write also
        # allocates the file's extents, slower, which would inflate the I/O bound and so
        # the overlap figure. Two regions written, then freed for the timed ones.
        for k in ("warm", "warm2"):
            st.write(k, t).wait()
        for k in ("warm", "warm2"):
            st.delete(k)
        t0 = time.perf_counter()
        st.write("bw", t).wait()
        w = time.perf_counter() - t0
        t0 = time.perf_counter()
        st.read("bw", out=out).wait()
        r = time.perf_counter() - t0
        t0 = time.perf_counter()
        both = [st.write("bw2", t), st.read("bw", out=out)]
        for f in both:
            f.wait()
        m = time.perf_counter() - t0
    return {"write_gbs": nbytes / w / 1e9, "read_gbs": nbytes / r / 1e9,
            "mixed_gbs": 2 * nbytes / m / 1e9}


def io_seconds(read: float, write: float, bw: dict[str, float]) -> float:
    """The least time the disk `bw` needs to read `read` and write `write` bytes."""
    return drive_seconds(read, write, bw["read_gbs"], bw["write_gbs"], bw["mixed_gbs"])


def add_overlap(runs: dict[str, list[dict[str, Any]]], bw: dict[str, float]) -> None:
    """Each measured run's NVMe I/O bound and overlap efficiency against plain PyTorch's
    forward+backward of the same round (rows of a failed child have neither)."""
    compute_runs = [r.get("fwd_bwd_s") for r in runs.get("plain", [])]
    for rs in runs.values():
        for i, r in enumerate(rs):
            if "step_s" not in r:
                continue
            io_s = io_seconds(r.get("nvme_read_per_step", 0.0), r.get("nvme_write_per_step",
                                                                       0.0), r.get("disk", bw))
            compute = compute_runs[i] if i < len(compute_runs) else None
            parts = [x for x in (compute, io_s, r.get("adam_s")) if x]
            r["nvme_io_s"] = io_s
            r["overlap_eff"] = max(parts) / r["step_s"] if parts else None


def run_child(ns: argparse.Namespace, model: str, config: str) -> dict[str, Any]:
    ds = config.startswith("ds_")  # DeepSpeed runs in its own virtualenv (ds_runner.py)
    cmd = [ns.deepspeed_python if ds else sys.executable, str(DS_RUNNER) if ds else __file__,
           "--child", "--model", model, "--config", config,
           "--swap", ns.swap, "--steps", str(ns.steps), "--warmup", str(ns.warmup),
           "--batch", str(ns.batch), "--seq", str(ns.seq), "--threads", str(ns.threads),
           "--clip", str(ns.clip)]
    if not ds:
        cmd += ["--overlap-step", ns.overlap_step, "--cache-bytes", str(ns.cache_bytes),
                "--device", ns.device]
        if ns.buffer_count:
            cmd += ["--buffer-count", str(ns.buffer_count)]
    if ns.quick:
        cmd.append("--quick")
    env = dict(os.environ)
    if ns.mmap_threshold is not None:  # glibc: blocks above it are mmapped, freed at once
        env["MALLOC_MMAP_THRESHOLD_"] = str(ns.mmap_threshold)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    # progress: rows print once a model's rounds are done, so a run stopped by a time
    # limit still shows how far it got and how long each child took
    sys.stderr.write(f"  {model}/{config}: child done in {time.perf_counter() - start:.1f} s "
                     f"(exit {proc.returncode})\n")
    if proc.returncode != 0:  # kept as a row: the other rows of the run still count
        sys.stderr.write(f"{model}/{config} failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-4000:]}\n")
        return {"config": config, "model": model,
                "failed": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small mlp model, 1 round (about a minute on a quiet 2-core machine)")
    ap.add_argument("--out", default="bench_out/step_bench.json")
    ap.add_argument("--swap", default=tempfile.gettempdir(), help="NVMe directory")
    ap.add_argument("--models", default=None, help="mlp,hf (quick: mlp)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 3; quick: 1)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per child (default 5; quick: 3)")
    # a fresh process runs its first bf16 steps several times slower (kernel warm-up)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model computes (cuda: the offload tiers are the GPU, "
                         "host memory and NVMe; no DeepSpeed rows)")
    ap.add_argument("--overlap-step", choices=("on", "off"), default="on",
                    help="offload.optimizer.overlap_step of the tierzero rows (A/B of the "
                         "optimizer step during backward)")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="gradient clipping limit of the :clip variants (default 1.0)")
    ap.add_argument("--buffer-count", type=int, default=None,
                    help="offload.optimizer.buffer_count of the tierzero rows (CPU Adam host "
                         "ring depth); default: the config's default")
    ap.add_argument("--cache-bytes", type=int, default=DS_DEFAULT_MAX_IN_CPU,
                    help="offload.params.max_in_cpu_bytes of the all_nvme_cache rows "
                         "(default: DeepSpeed's default max_in_cpu, 1e9 elements x 2 bytes)")
    ap.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                    help="run every child with MALLOC_MMAP_THRESHOLD_=BYTES (glibc returns "
                         "freed blocks above it to the system at once: lower RSS, but each "
                         "new block is page-faulted in again, slower steps for every row). "
                         "Default: glibc's own dynamic threshold, as users run")
    ap.add_argument("--deepspeed-python", default=None,
                    help="python of a virtualenv with deepspeed (install_deepspeed.sh) for the "
                    "ds_* rows; default: this python if it imports deepspeed, else no ds rows")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="mlp", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="plain", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.mmap_threshold is not None and ns.mmap_threshold < 0:
        ap.error(f"--mmap-threshold {ns.mmap_threshold}: need a byte count >= 0")
    if ns.cache_bytes < 0:
        ap.error(f"--cache-bytes {ns.cache_bytes}: need a byte count >= 0")
    if ns.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False on this machine "
                 f"(torch {torch.__version__}); use --device cpu or a CUDA build of torch")
    if ns.child:
        sys.stdout.write(json.dumps(child(ns)) + "\n")
        return
    ns.repeats = ns.repeats or (1 if ns.quick else 3)
    ns.steps = ns.steps or (3 if ns.quick else 5)
    ns.models = ns.models or ("mlp" if ns.quick else "mlp,hf")
    configs = ns.configs.split(",")
    for c in configs:
        split_config(c)  # unknown variants fail before anything runs
    if ns.device == "cpu":
        configs += deepspeed_configs(ns, configs)
    else:
        sys.stdout.write("DeepSpeed rows skipped: ds_runner.py runs DeepSpeed's CPU "
                         "accelerator only, not --device cuda\n")
    info = machine.describe(ns.swap)
    disk_bytes = (64 if ns.quick else 512) << 20
    bw = disk_bandwidth(ns.swap, disk_bytes)
    info["malloc_mmap_threshold"] = (ns.mmap_threshold if ns.mmap_threshold is not None
                                     else os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc"))
    sys.stdout.write(f"machine: {json.dumps(info)}\ndisk at {ns.swap}: {bw}\n")
    rows: list[dict[str, Any]] = []
    disks: list[dict[str, float]] = [bw]
    for model in ns.models.split(","):
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        for _ in range(ns.repeats):
            for c in configs:  # interleaved rounds: load drift hits every config alike
                # the disk as it is now, for this run's I/O bound (it drifts between minutes)
                disk = disk_bandwidth(ns.swap, disk_bytes) if "nvme" in c else None
                r = run_child(ns, model, c)
                if disk is not None:
                    disks.append(disk)
                    r["disk"] = disk
                runs[c].append(r)
        add_overlap(runs, bw)
        med = {c: median_row(rs) for c, rs in runs.items()}
        plain_step = med.get("plain", {}).get("step_s")
        for c, m in med.items():
            m["vs_plain"] = m["step_s"] / plain_step if plain_step and "step_s" in m else None
            # the spread behind the median
            m["step_s_rounds"] = [r["step_s"] for r in runs[c] if "step_s" in r]
            rows.append(m)
            sys.stdout.write(step_line(model, c, m, gpu=ns.device == "cuda") + "\n")
        report_deepspeed(model, med)
    spread = {k: (min(d[k] for d in disks), max(d[k] for d in disks)) for k in bw}
    sys.stdout.write("disk GB/s over the run (min, max): " + ", ".join(
        f"{k.removesuffix('_gbs')} {lo:.2f}-{hi:.2f}" for k, (lo, hi) in spread.items()) + "\n")
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "disk": bw, "disks": disks, "args": vars(ns),
                               "rows": rows}, indent=1))
    sys.stdout.write(f"wrote {out}\n")
    if failed := [f"{r['model']}/{r['config']}" for r in rows if "failed" in r]:
        raise SystemExit(f"step_bench: {len(failed)} configuration(s) failed in some round: "
                         f"{', '.join(failed)} (their errors are above and in {out})")


if __name__ == "__main__":
    main()
