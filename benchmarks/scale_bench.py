"""Host memory at scale: a 2.07B Llama trained from config.json with `offload: {device: nvme}`.

What a new user does with a model whose 16 B/param training state (33 GB here) is larger
than the machine's RAM: write a Hugging Face `config.json`, set `offload: {device: nvme}`
and gradient clipping 1.0 (`--clip`), train a few steps. Per run, in a fresh child process:

- peak RSS growth over the process's RSS after its imports (VmHWM, reset per phase with
  /proc/self/clear_refs, and the parent's wait4 ru_maxrss for the whole child), per phase:
  model construction, engine.initialize (partitioning, writing the state to NVMe), each step;
- the RSS split at each phase's peak: the tier manager's host and device tiers (shards, caches,
  staging pool; the CPU stand-in's device tier is host memory too), the CPU Adam stream's
  pipeline buffers, and the rest (interpreter, torch, activations, allocator slack);
- `tierzero plan`'s predicted host peak for the same config (engine/plan), and its ratio to
  the measured peak growth;
- NVMe bytes per step (/proc/self/io: block-layer bytes of the child; the swap store uses
  O_DIRECT) and the tier manager's moved bytes;
- step time against the disk: the same directory's O_DIRECT sequential write and read
  bandwidth measured in this run (a file of --bw-bytes, 64 MiB requests), each alone and
  both running together (`mixed_gbps`), so `io_bound_s` = max(read/read_bw,
  written/write_bw, (read + written)/mixed_bw) is the least time the step's traffic needs
  with its reads and writes sharing the drive (`io_serial_s` = read/read_bw +
  written/write_bw, one direction at a time, as rows before 2026-12-03 13:00 reported);
- step time against the CPU: the child's CPU seconds in the step (user + system, every
  thread) over the cores it may run on, `cpu_bound_s`, the least time the step's CPU work
  needs with every core busy (a step near it is bound by the CPU, not the drive); on a VM,
  also the seconds its hypervisor took from those cores during the step (`steal_s`, from
  /proc/stat) and `cpu_steal_bound_s` = (CPU seconds + steal) over the cores: the least
  time on the CPU the VM was actually given (some VMs lose a third of their cores while
  their disk has requests in flight: benchmarks/io_steal_bench.py);
- whether the swap files are gone after `close()`; the loss of each step (one fixed batch,
  so a working optimizer lowers it), and a fingerprint of the weights each module's first
  forward call of the step computed with (`weights_seen`, and its `weights_digest`: small
  parameters whole, large ones sampled and their last 4096 elements): rows with equal
  digests ran their forward on the same weights, as far as the fingerprint sees.

`--state-precisions fp32,bf16,int8` runs the tierzero child once per
`offload.optimizer.state_precision` (Adam moments kept as fp32, bf16 or blockwise int8),
one after another in the same run, and adds a table of each choice's NVMe bytes and step
time against fp32's. A choice may carry `+bf16master` (`int8+bf16master`): that row also
sets `offload.optimizer.master_precision: bf16` (no fp32 master: [Note: bf16 master
weights] in offload/bf16_master.py). The disk is measured again right after every row (a
virtual disk drifts between minutes; that measurement is also the next row's "before"):
a row's `disk` is the measurement before it, `disk_after` the one after, and its
`io_bound_s` takes each rate at the faster of the two (bench_report.fastest_drive: the
least time the drive could have needed), `io_bound_before_s` the one before alone; each
step's bytes per direction and tensor class (the tier manager's `moved_by_class`) are in
the row.

DeepSpeed ZeRO-Infinity on the same config.json (`offload_param` and `offload_optimizer` on
NVMe, `stage3_prefetch_bucket_size: 0`, clipping as --clip, bf16, AdamW) runs the same child
in DeepSpeed's own virtualenv when --deepspeed-python is given
(benchmarks/install_deepspeed.sh builds it), once per --ds-builds: `whole` builds the model
in host memory and hands it to `deepspeed.initialize` (a user's script without zero.Init),
`zero_init` builds it under `deepspeed.zero.Init` with the same config (each module's
parameters partitioned and swapped to NVMe as they are made: DeepSpeed's best case).

`--grad-accum K` trains K micro-batches per optimizer step (gradient_accumulation_steps)
through `eng.train_batch`, as `tierzero train` does, and `--schedules layer_major,micro_step`
runs the tierzero child once per `batch.schedule` ([Note: layer-major schedule]) in the
same run; a table compares each schedule's NVMe bytes, step time and tokens/s with the
first's.

`--set KEY=VALUE` (repeatable) sets a dotted key of every tierzero row's config, e.g.
`--set nvme.threads=16 --set offload.optimizer.buffer_count=8`: one run per variant, the
same script and model, so an A/B of a setting is two commands.

`--trace PATH` records each tierzero row's last step (swap/trace.py) into PATH.<row> and
adds where its time went to the row (benchmarks/trace_summary.py: the drive's busy and idle
seconds, what the training thread did while it was idle, each thread's time by kind).

A watchdog in the parent samples each child's RSS (with its subprocesses) every 0.2 s and
kills it when it passes --child-max-rss (default min(14 GiB, 0.6 x the memory available at
the start)), when the machine's available memory falls below --min-available (default
1.5 GiB), or after --child-timeout: on a shared machine without swap an OOM kill could hit
someone else's process. A killed row says "stopped at N GB during <phase>" (N: the child's
peak RSS from wait4; the phase from the marks each child prints as a phase starts), keeps
the phases it finished, and is not a measurement of the step.

    .venv/bin/python benchmarks/scale_bench.py --swap /var/tmp --steps 3
    .venv/bin/python benchmarks/scale_bench.py --quick            # a 30M model, ~1 minute
    .venv/bin/python benchmarks/scale_bench.py --engines tierzero --state-precisions fp32,bf16,int8
    .venv/bin/python benchmarks/scale_bench.py --engines deepspeed \
        --deepspeed-python /work/dsvenv/bin/python --ds-builds whole,zero_init

Everything is written inside one directory this script creates under --swap (0700) and
removed at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import mmap
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import yaml

HERE = Path(__file__).resolve().parent
GiB = 1 << 30
PHASE_MARK = "scale_bench-phase:"  # a child's stderr line as each phase starts

# Llama-shaped, 2,067,130,880 parameters: hidden 2560, 24 layers, 20 heads of 128, SwiGLU
# 6912, vocab 32000 untied (embeddings + lm_head 164M); the 2.07B model
LLAMA_2B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 2560, "intermediate_size": 6912, "num_hidden_layers": 24,
            "num_attention_heads": 20, "num_key_value_heads": 20, "vocab_size": 32000,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "float32"}
# --quick: the same architecture at 33.6M parameters
LLAMA_QUICK = {**LLAMA_2B, "hidden_size": 512, "intermediate_size": 1376,
               "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8}


# -- probes (both children) ---------------------------------------------------------------
def status_bytes(field: str, pid: int | str = "self") -> int:
    """A `VmXXX:` line of /proc/<pid>/status in bytes (0 when absent)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_hwm() -> None:
    """Restart VmHWM at the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def io_bytes() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process has caused at the block layer."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def files_under(path: str) -> list[str]:
    return [str(p) for p in Path(path).rglob("*") if p.is_file()]


# -- the disk -------------------------------------------------------------------------------
def disk_bandwidth(directory: str, nbytes: int, chunk: int = 64 << 20) -> dict[str, float]:
    """GB/s of `nbytes` in `directory` through O_DIRECT: one sequential write (fsynced), one
    sequential read, then a read of that file and a write of a second one running together
    (`mixed_gbps`, both directions' bytes over the time until both end): a step's reads
    and writes share the drive, which may move more or fewer bytes a second then than in
    either direction alone. Those three keep one request in flight per direction;
    `deep_mixed_gbps` reads and writes the same bytes with eight requests of 4 MiB in
    flight, half each way, as the swap store's I/O threads do: the drive's rate for the
    engine's own pattern (a virtual disk can move far more with a deep queue)."""
    path = os.path.join(directory, "bandwidth.bin")
    path2 = os.path.join(directory, "bandwidth2.bin")
    bufs = [mmap.mmap(-1, chunk) for _ in range(2)]  # page-aligned, as O_DIRECT needs
    for buf in bufs:
        buf.write(os.urandom(1 << 20) * (chunk >> 20))
    n = max(1, nbytes // chunk)
    flags = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_DIRECT

    def write(where: str, buf: mmap.mmap) -> None:
        fd = os.open(where, flags | os.O_WRONLY, 0o600)
        try:
            for _ in range(n):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(buf: mmap.mmap) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW)
        try:
            for _ in range(n):
                os.readv(fd, [buf])
        finally:
            os.close(fd)

    def deep(queue: int = 8, request: int = 4 << 20) -> float:
        """GB/s of reads of `path` and writes of `path2` (`n * chunk` bytes each) issued as
        the swap store issues them: `queue` threads with one `request` each in flight, half
        reading, half writing (the engine's default offload.nvme queue and request)."""
        per = n * chunk // request
        views = [mmap.mmap(-1, request) for _ in range(queue)]
        for view in views:  # written bytes as the engine's: not zero pages
            view.write(bufs[0][:request])

        def worker(i: int) -> None:
            reading = i % 2 == 0
            fd = (os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW) if reading
                  else os.open(path2, os.O_WRONLY | os.O_DIRECT | os.O_NOFOLLOW))
            try:
                for k in range(i // 2, per, queue // 2):
                    if reading:
                        os.preadv(fd, [views[i]], k * request)
                    else:
                        os.pwrite(fd, views[i], k * request)
                if not reading:
                    os.fsync(fd)
            finally:
                os.close(fd)

        try:
            with concurrent.futures.ThreadPoolExecutor(queue) as pool:
                t0 = time.perf_counter()
                for f in [pool.submit(worker, i) for i in range(queue)]:
                    f.result()
                return 2 * per * request / (time.perf_counter() - t0) / 1e9
        finally:
            for v in views:
                v.close()

    try:
        t0 = time.perf_counter()
        write(path, bufs[0])
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        read(bufs[0])
        read_s = time.perf_counter() - t0
        # the syscalls release the GIL: the two threads keep the drive busy both ways
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            t0 = time.perf_counter()
            both = [pool.submit(write, path2, bufs[1]), pool.submit(read, bufs[0])]
            for f in both:
                f.result()  # raises what the thread raised
            mixed_s = time.perf_counter() - t0
        deep_gbps = deep()  # both files exist now: path2 is rewritten in place
    finally:
        for buf in bufs:
            buf.close()
        for where in (path, path2):
            if os.path.exists(where):
                os.unlink(where)
    return {"bytes": n * chunk, "write_gbps": n * chunk / write_s / 1e9,
            "read_gbps": n * chunk / read_s / 1e9, "mixed_gbps": 2 * n * chunk / mixed_s / 1e9,
            "deep_mixed_gbps": deep_gbps}


# -- children -------------------------------------------------------------------------------
def cores_steal() -> float | None:
    """The steal seconds so far of the cores this process may run on (bench_report's)."""
    from bench_report import steal_seconds  # benchmarks/bench_report.py

    return steal_seconds(os.sched_getaffinity(0))


def cpu_seconds() -> tuple[float, float]:
    """This process's CPU seconds so far over all its threads: (user + system, system)."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime, u.ru_stime


class Phases:
    """Peak RSS growth per phase over `base` (VmHWM, reset at each phase's start), and the
    process's CPU seconds in the phase (user + system, every thread: getrusage), so a step
    can be set against the CPU's time for its work as well as the drive's, and the system
    part of them (the kernel's: page faults, zeroing fresh memory, I/O calls); and the
    seconds the hypervisor took from the cores the process may run on (`steal_s`:
    bench_report.steal_seconds; None where the kernel does not count them)."""

    def __init__(self) -> None:
        self.base = status_bytes("VmRSS")
        self.rows: list[dict[str, Any]] = []
        self._cpu0 = (0.0, 0.0)
        self._steal0: float | None = None

    def start(self, name: str) -> float:
        """Reset VmHWM; tell the parent which phase runs now (its watchdog names it when it
        stops the child)."""
        sys.stderr.write(f"{PHASE_MARK} {name}\n")
        sys.stderr.flush()
        reset_hwm()
        self._cpu0 = cpu_seconds()
        self._steal0 = cores_steal()
        return time.perf_counter()

    def end(self, name: str, t0: float, **extra: Any) -> dict[str, Any]:
        cpu, cpu_sys = cpu_seconds()
        steal = cores_steal()
        row = {"phase": name, "s": time.perf_counter() - t0,
               "cpu_s": cpu - self._cpu0[0], "cpu_sys_s": cpu_sys - self._cpu0[1],
               "steal_s": (steal - self._steal0 if steal is not None
                           and self._steal0 is not None else None),
               "cores": len(os.sched_getaffinity(0)),
               "peak_growth": status_bytes("VmHWM") - self.base,
               "end_growth": status_bytes("VmRSS") - self.base, **extra}
        self.rows.append(row)
        sys.stderr.write(f"scale_bench: {name}: {row['s']:.1f} s, peak RSS growth "
                         f"{row['peak_growth'] / GiB:.2f} GiB {json.dumps(row)}\n")
        sys.stderr.flush()
        return row


def _batch(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)  # (B, T)
    return ids, torch.roll(ids, -1, 1)


def _fingerprints(model: torch.nn.Module) -> list[dict[str, float]]:
    """Record, for each module with parameters of its own, a fingerprint of the weights its
    first forward call of a step computed with (`_weights_sum`): the step's losses can then
    be traced to the weights each layer saw. The hooks run after the engine's gather hooks
    (registered later), so the parameters are gathered; the caller takes and resets the
    step's record (one dict in a list)."""
    seen: list[dict[str, float]] = [{}]

    def hook(name: str) -> Any:
        def record(module: torch.nn.Module, _inputs: Any) -> None:
            if name not in seen[0]:
                seen[0][name] = sum(_weights_sum(p) for p in module.parameters(recurse=False))
        return record

    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(hook(name))
    return seen


def _weights_sum(p: torch.Tensor) -> float:
    """A parameter's values summed in float64: all of them for a small one (up to 65536
    elements: norms, biases), else every 4099th element plus the last 4096 (the page a
    shard's ragged end shares, read through a different path: swap/blockio.py)."""
    flat = p.detach().reshape(-1)
    if flat.numel() <= 65536:
        return float(flat.double().sum())
    return float(flat[::4099].double().sum()) + float(flat[-4096:].double().sum())


def _digest(prints: dict[str, float]) -> str:
    """A short hash of a step's weight fingerprints (equal rows print equal digests)."""
    text = json.dumps(sorted(prints.items()))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def child_tierzero(args: argparse.Namespace) -> dict[str, Any]:
    import torch.nn.functional as F

    from tierzero import engine
    from tierzero.engine.config import load_config
    from tierzero.engine.shards.tiered import TieredShardStore
    from tierzero.engine.train.model_source import build_model
    from tierzero.swap import trace

    sys.path.insert(0, str(HERE))
    import trace_summary  # benchmarks/trace_summary.py

    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    with torch.device("meta"):  # imports the model's code first: code is not model memory
        build_model(args.model, args.seq)
    ph = Phases()
    torch.manual_seed(0)
    t = ph.start("build")
    with engine.Init(config=config):  # as `tierzero train` builds a stage-3 model
        model = build_model(args.model, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    ph.end("build", t, model_bytes=sum(p.numel() * p.element_size()
                                       for p in model.parameters()))
    t = ph.start("initialize")
    eng, _, _, _ = engine.initialize(model=model, config=config)
    store = eng.store

    def split() -> dict[str, Any]:
        """The engine's own count of what it holds now and at peak (tier manager)."""
        tiers = eng.memory_report()["tiers"] or {}
        return {"tier_current": tiers.get("current"), "tier_peak": tiers.get("peak"),
                # host buffers the tier manager hands out beyond its tiers (CPU Adam ring)
                "outside": tiers.get("outside"), "outside_peak": tiers.get("outside_peak"),
                "grad_home": tiers.get("grad_home"),
                "pipeline_bytes": (store.layout.pipeline_bytes()
                                   if isinstance(store, TieredShardStore) else 0),
                "gathered_peak_bytes": eng.scheduler.gathered_peak_bytes,
                "moved": tiers.get("moved"), "moved_by_class": tiers.get("moved_by_class")}

    ph.end("initialize", t, **split())
    ids, labels = _batch(args.vocab, args.batch, args.seq)
    seen = _fingerprints(model)

    def loss_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = eng(input_ids=mb[0])
        logits = out.logits if hasattr(out, "logits") else out[0]  # (B, T, V)
        # the labels where the logits are (the engine moved the inputs to its device)
        return F.cross_entropy(logits.float().flatten(0, 1), mb[1].to(logits.device).flatten())

    traced: dict[str, Any] | None = None
    for step in range(1, args.steps + 1):
        io0 = io_bytes()
        t = ph.start(f"step {step}")
        # one optimizer step of --grad-accum micro-batches, in the config's batch.schedule;
        # with --trace the last one is recorded (swap/trace.py) and summarized
        rec = (trace.Recorder(cpu_interval_s=0.1) if args.trace and step == args.steps
               else None)
        with trace.recording(rec) if rec is not None else contextlib.nullcontext():
            losses = eng.train_batch([(ids, labels)] * args.grad_accum, loss_fn)
        io1 = io_bytes()
        if rec is not None:
            traced = trace_summary.summarize(rec.document())
            rec.write(args.trace)  # atomic, 0600, never through a planted link
        prints, seen[:] = dict(seen[0]), [{}]
        ph.end(f"step {step}", t, loss=float(sum(float(x) for x in losses) / len(losses)),
               weights_seen=prints, weights_digest=_digest(prints),
               nvme_read=io1[0] - io0[0], nvme_written=io1[1] - io0[1],
               tokens=args.grad_accum * args.batch * args.seq, schedule=eng.schedule,
               # whether clipping fired decides whether the next step is speculated
               # ([Note: speculated step] in engine/step/speculation.py)
               grad_norm=eng.get_global_grad_norm(), clip_coef=eng.get_clip_coef(),
               # how the step's update ran: deferred, speculated, undone, ...
               update=eng.step_driver.last_update, **split())
    report = eng.memory_report()
    eng.close(restore_params=False)  # as `tierzero train` ends: no model rebuilt in RAM
    left = files_under(args.swap_dir)
    return {"engine": "tierzero", "params": n_params, "base_rss": ph.base,
            "phases": ph.rows, "swap_files_left": left,
            "homes": (report["tiers"] or {}).get("homes"),
            "optimizer_step": report.get("optimizer_step"), "trace_summary": traced}


def deepspeed_config(args: argparse.Namespace) -> dict[str, Any]:
    """ZeRO-Infinity for the same run: params and optimizer state on NVMe, bf16, AdamW."""
    nvme = {"device": "nvme", "nvme_path": args.swap_dir, "pin_memory": False}
    zero = {"stage": 3, "offload_param": dict(nvme), "offload_optimizer": dict(nvme),
            # DeepSpeed's NVMe parameter swapper without a GPU (see ds_runner.py)
            "stage3_prefetch_bucket_size": 0}
    if args.ds_sub_group_size:
        # DeepSpeed sizes its optimizer swap buffers (4 by default, fp32) and a gradient
        # buffer to the largest sub-group: 1e9 elements by default, ~20 GB at 2.07B
        zero["sub_group_size"] = args.ds_sub_group_size
    if args.ds_param_buffers:
        # its parameter swapper holds one buffer per parameter in flight; with the
        # defaults (5 of 1e8 elements, max_in_cpu 1e9 elements kept in host memory after
        # their first read) the second step at 2.07B fails ("Not enough buffers 0 for
        # swapping 1"). As ds_runner's ds_all_nvme_nocache: every parameter read from NVMe
        # for each use (as tierzero's are), N buffers the size of the largest parameter
        zero["offload_param"].update(buffer_count=args.ds_param_buffers,
                                     buffer_size=args.ds_param_buffer_elements, max_in_cpu=0)
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "gradient_clipping": args.clip, "steps_per_print": 1 << 30}


def child_deepspeed(args: argparse.Namespace) -> dict[str, Any]:
    """DeepSpeed's run of the same config.json. --ds-build whole: the model built whole in
    host memory, then `deepspeed.initialize` (a user's script without zero.Init);
    zero_init: built under `deepspeed.zero.Init(config_dict_or_path=<the same config>)`,
    which partitions each module's parameters as it is constructed and, with
    offload_param on NVMe, swaps them out (DeepSpeed's own way to build a model larger than
    host memory: its best case here). Under zero.Init the Hugging Face weight init runs on
    the already-partitioned (empty) tensors, so weights keep torch's module defaults: the
    step's time, bytes and memory are what is measured, not the loss."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging
    import socket
    import warnings

    import deepspeed
    import transformers
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    torch.set_num_threads(args.threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(key, value)
    hf = transformers.AutoConfig.from_pretrained(args.model)
    with torch.device("meta"):  # imports the model's code first, as the tierzero child does
        transformers.AutoModelForCausalLM.from_config(hf)
    cfg = deepspeed_config(args)
    # zero.Init needs the process group; the whole build does not, but both start it here
    # so the two rows time the same work per phase
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    ph = Phases()
    torch.manual_seed(0)
    t = ph.start("build")
    init = (deepspeed.zero.Init(config_dict_or_path=cfg) if args.ds_build == "zero_init"
            else contextlib.nullcontext())
    with init:
        model = transformers.AutoModelForCausalLM.from_config(hf)
    # under zero.Init a parameter's full size is its ds_numel (its .numel() is 0)
    n_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    ph.end("build", t, model_bytes=sum(p.numel() * p.element_size()
                                       for p in model.parameters()))
    t = ph.start("initialize")
    eng, _, _, _ = deepspeed.initialize(model=model, config=cfg,
                                        model_parameters=model.parameters())
    ph.end("initialize", t)
    ids, labels = _batch(args.vocab, args.batch, args.seq)
    for step in range(1, args.steps + 1):
        io0 = io_bytes()
        t = ph.start(f"step {step}")
        loss = eng(input_ids=ids, labels=labels).loss
        eng.backward(loss)
        eng.step()
        io1 = io_bytes()
        ph.end(f"step {step}", t, loss=float(loss.item()), nvme_read=io1[0] - io0[0],
               nvme_written=io1[1] - io0[1])
    swap_bytes = sum(os.path.getsize(f) for f in files_under(args.swap_dir))
    eng.destroy()
    return {"engine": f"deepspeed {deepspeed.__version__}", "ds_build": args.ds_build,
            "params": n_params, "base_rss": ph.base, "phases": ph.rows,
            "swap_file_bytes": swap_bytes, "swap_files_left": files_under(args.swap_dir),
            "zero": json.loads(json.dumps(cfg["zero_optimization"]).replace(
                args.swap_dir, "<swap>"))}


# -- the parent -----------------------------------------------------------------------------
def parse_set(item: str) -> tuple[str, Any]:
    """`--set KEY=VALUE`: a dotted key of the tierzero config and a YAML value (so a bare
    `off` is false: quote a string the engine wants, nvme.direct_io='off')."""
    key, eq, text = item.partition("=")
    if not eq or not key or any(not part for part in key.split(".")):
        raise argparse.ArgumentTypeError(f"{item!r}: allowed: KEY=VALUE with a dotted key, "
                                         "e.g. nvme.threads=16")
    return key, yaml.safe_load(text)


def set_dotted(config: dict[str, Any], key: str, value: Any) -> None:
    """config[a][b][c] = value for key "a.b.c", making the sections on the way; the
    engine's config check names a key it does not know."""
    *sections, last = key.split(".")
    node = config
    for name in sections:
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            raise SystemExit(f"scale_bench: --set {key}: {name!r} is not a section")
    node[last] = value


def write_inputs(run_dir: str, args: argparse.Namespace) -> dict[str, str]:
    """The model's config.json and one tierzero config per state precision (`config` is
    the first precision's, `config:<precision>` each one's)."""
    model_dir = os.path.join(run_dir, "model")
    os.mkdir(model_dir, 0o700)
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(LLAMA_QUICK if args.quick else LLAMA_2B, f, indent=1)
    config = {"zero": {"stage": 3}, "precision": "bf16",
              "optimizer": {"type": "adamw", "lr": 1.0e-4},
              "gradient_clipping": args.clip,
              "offload": {"device": "nvme", "path": os.path.join(run_dir, "swap-tierzero")}}
    if args.host_bytes:  # default: the engine's own host budget (from available memory)
        config["offload"]["budgets"] = {"host_bytes": args.host_bytes}
    for name in ("swap-tierzero", "swap-deepspeed"):
        os.mkdir(os.path.join(run_dir, name), 0o700)
    paths = {"model": model_dir}
    for prec in args.state_precisions:
        for schedule in args.schedules:
            state, master = split_variant(prec)
            config["offload"]["optimizer"] = {"state_precision": state,
                                              "master_precision": master}
            config["batch"] = {"gradient_accumulation_steps": args.grad_accum,
                               "schedule": schedule}
            for key, value in args.set:
                set_dotted(config, key, value)
            config_path = os.path.join(run_dir, f"tierzero-{prec}-{schedule}.yaml")
            with open(config_path, "w", encoding="utf-8") as f:
                json.dump(config, f, indent=1)  # JSON is YAML
            paths[f"config:{prec}:{schedule}"] = config_path
    paths["config"] = paths[f"config:{args.state_precisions[0]}:{args.schedules[0]}"]
    return paths


def plan_prediction(model_dir: str, config_path: str, seq: int, batch: int) -> dict[str, Any]:
    """`tierzero plan`'s host prediction for this run (engine/plan), in a child process so
    the parent's RSS stays small; {} when this checkout's plan has no such figure."""
    code = ("import json, sys; from tierzero.engine.plan.planner import predict_run; "
            "print(json.dumps(predict_run(sys.argv[1], sys.argv[2], seq_len=int(sys.argv[3]), "
            "micro_batch=int(sys.argv[4]))))")
    proc = subprocess.run([sys.executable, "-c", code, model_dir, config_path, str(seq),
                           str(batch)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "?"}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def tree_rss(pid: int) -> int:
    """RSS of a process and its descendants (DeepSpeed JIT-builds ops in subprocesses)."""
    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for kid in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += kid.memory_info().rss
    return int(total)


class Watchdog:
    """Samples a child's RSS every `period` s and kills it when the machine's available
    memory falls below `min_available`, when the child's own RSS (with its descendants)
    passes `max_rss`, or after `timeout` s (0: never). On a shared machine without swap an
    OOM kill could hit someone else's process, so the bench stops its own child first."""

    def __init__(self, proc: subprocess.Popen[str], *, max_rss: int, min_available: int,
                 timeout: float, period: float = 0.2) -> None:
        self.proc, self.max_rss, self.min_available = proc, max_rss, min_available
        self.timeout, self.period = timeout, period
        self.t0 = time.perf_counter()
        self.trace: list[tuple[float, int]] = []  # (s since start, child RSS), every ~1 s
        self.rss_max = 0
        self.why: str | None = None  # set when this watchdog killed the child
        self.phase = "startup"  # the child's current phase (its PHASE_MARK lines)
        self.killed_phase: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _kill(self, why: str) -> None:
        self.why, self.killed_phase = why, self.phase
        self.proc.kill()

    def _exited(self) -> bool:
        """The child has ended; it is not reaped here (WNOWAIT): run_child's wait4 reaps it
        and takes its rusage, which a reap by Popen.poll() would lose (ECHILD)."""
        try:
            return os.waitid(os.P_PID, self.proc.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped already
            return True

    def _run(self) -> None:
        last_trace = -1.0
        while not self._exited():
            now = time.perf_counter() - self.t0
            try:
                rss = tree_rss(self.proc.pid)
            except psutil.Error:  # gone between poll() and the read
                return
            self.rss_max = max(self.rss_max, rss)
            if now - last_trace >= 1.0:
                self.trace.append((now, rss))
                last_trace = now
            avail = psutil.virtual_memory().available
            if rss > self.max_rss:
                return self._kill(f"child RSS {rss / 1e9:.1f} GB passed --child-max-rss "
                                  f"{self.max_rss / 1e9:.1f} GB; not a measurement")
            if avail < self.min_available:
                return self._kill(f"machine's available memory fell to {avail / GiB:.2f} GiB "
                                  "(< --min-available); not a measurement")
            if self.timeout and now > self.timeout:
                return self._kill(f"ran past --child-timeout ({now:.0f} s); not a measurement")
            time.sleep(self.period)

    def join(self) -> None:
        self._thread.join()


def _largest_param(args: argparse.Namespace) -> int:
    """Elements of the model's largest parameter: the embedding (vocab x hidden)."""
    cfg = LLAMA_QUICK if args.quick else LLAMA_2B
    return int(cfg["vocab_size"]) * int(cfg["hidden_size"])


def run_child(python: str, which: str, paths: dict[str, str], swap_dir: str,
              args: argparse.Namespace, *, config: str | None = None,
              ds_build: str = "whole", trace_tag: str = "") -> dict[str, Any]:
    cmd = [python, str(Path(__file__).resolve()), "--child", which, "--model", paths["model"],
           "--config", config or paths["config"],
           "--swap-dir", swap_dir, "--steps", str(args.steps), "--ds-build", ds_build,
           "--seq", str(args.seq), "--batch", str(args.batch), "--threads", str(args.threads),
           "--grad-accum", str(args.grad_accum),
           "--clip", str(args.clip), "--ds-sub-group-size", str(args.ds_sub_group_size),
           "--ds-param-buffers", str(args.ds_param_buffers),
           "--ds-param-buffer-elements", str(_largest_param(args)),
           *(["--trace", f"{args.trace}.{trace_tag}"] if args.trace and which == "tierzero"
             else []),
           "--vocab", str(int((LLAMA_QUICK if args.quick else LLAMA_2B)["vocab_size"]))]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    dog = Watchdog(proc, max_rss=args.child_max_rss, min_available=args.min_available,
                   timeout=args.child_timeout)
    stderr_lines: list[str] = []

    def pump() -> None:
        if proc.stderr is None:
            return
        for line in proc.stderr:
            stderr_lines.append(line)
            if line.startswith(PHASE_MARK):
                dog.phase = line[len(PHASE_MARK):].strip()
            elif line.startswith("scale_bench:"):
                sys.stderr.write(f"  [{which}] {line}")

    pumper = threading.Thread(target=pump, daemon=True)
    pumper.start()
    try:
        stdout = proc.stdout.read() if proc.stdout else ""
    except BaseException:
        proc.kill()  # interrupted: the child must not outlive its run directory
        proc.wait()
        raise
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    dog.join()
    pumper.join()
    row: dict[str, Any] = {"wall_s": time.perf_counter() - t0,
                           "peak_rss_wait4": usage.ru_maxrss * 1024,
                           "rss_trace_max": dog.rss_max, "rss_trace": dog.trace,
                           "child_max_rss": args.child_max_rss}
    if dog.why is not None:
        row["killed"], row["killed_phase"] = dog.why, dog.killed_phase
        # the phases the child finished before it was stopped
        row["partial"] = [json.loads(line.split(" GiB ", 1)[1]) for line in stderr_lines
                          if line.startswith("scale_bench:") and " GiB {" in line]
        return row
    if proc.returncode != 0:
        row["failed"] = "".join(x for x in stderr_lines if not x.startswith(PHASE_MARK))[-3000:]
        return row
    row.update(json.loads(stdout.strip().splitlines()[-1]))
    return row


def summarize(row: dict[str, Any], bw: dict[str, float], state_bytes: int) -> dict[str, Any]:
    """Peak growth, its split at the peak phase, per-step figures against the disk."""
    phases = row.get("phases")
    if not phases:
        return {}
    peak = max(phases, key=lambda p: p["peak_growth"])
    steps = [p for p in phases if p["phase"].startswith("step")]
    steady = steps[1:] or steps  # step 1 records the unit trace
    out: dict[str, Any] = {
        "peak_growth": peak["peak_growth"], "peak_phase": peak["phase"],
        "peak_over_state": peak["peak_growth"] / state_bytes,
        "peak_rss": row["peak_rss_wait4"],
        "losses": [p["loss"] for p in steps],
        "weights_digests": [p.get("weights_digest") for p in steps]}
    if steady:
        mid = sorted(steady, key=lambda p: p["s"])[len(steady) // 2]
        from bench_report import drive_seconds  # benchmarks/bench_report.py

        io_s = drive_seconds(mid["nvme_read"], mid["nvme_written"], bw["read_gbps"],
                             bw["write_gbps"], bw["mixed_gbps"])
        # one direction at a time, as rows before the mixed measurement reported
        out["io_serial_s"] = (mid["nvme_read"] / (bw["read_gbps"] * 1e9)
                              + mid["nvme_written"] / (bw["write_gbps"] * 1e9))
        before = phases[phases.index(mid) - 1]
        if mid.get("moved_by_class") and before.get("moved_by_class"):
            # the tier manager's bytes of this step per direction and tensor class
            out["moved_by_class_per_step"] = {
                d: {c: n - before["moved_by_class"].get(d, {}).get(c, 0)
                    for c, n in by.items()}
                for d, by in mid["moved_by_class"].items()}
        if bw.get("deep_mixed_gbps"):
            # the same bytes at the rate of the engine's own queue depth, both directions
            # sharing the drive (disk_bandwidth's deep_mixed_gbps), when that is faster
            deep_s = min(io_s, (mid["nvme_read"] + mid["nvme_written"])
                         / (bw["deep_mixed_gbps"] * 1e9))
            # a swap directory off any block device (tmpfs) moves no block-layer bytes
            out.update(io_bound_deep_s=deep_s,
                       step_over_io_bound_deep=mid["s"] / deep_s if deep_s else None)
        if mid.get("cpu_s") is not None:
            # the CPU's time for the step's work: its CPU seconds spread over every core
            # the child may run on (a lower bound on the step, as the drive's time is)
            cpu_bound = mid["cpu_s"] / mid["cores"]
            out.update(cpu_s=mid["cpu_s"], cpu_sys_s=mid.get("cpu_sys_s"), cores=mid["cores"],
                       cpu_bound_s=cpu_bound,
                       step_over_cpu_bound=mid["s"] / cpu_bound if cpu_bound else None)
            if mid.get("steal_s") is not None:
                # the same with the cores' time the hypervisor took (a VM whose host serves
                # its disk on the cores it lends: bench_report.steal_seconds) counted as
                # busy: the least time the step needs on the CPU time the VM was given
                machine_bound = (mid["cpu_s"] + mid["steal_s"]) / mid["cores"]
                out.update(steal_s=mid["steal_s"], cpu_steal_bound_s=machine_bound,
                           step_over_cpu_steal_bound=(mid["s"] / machine_bound
                                                      if machine_bound else None))
        out.update(step_s=mid["s"], nvme_read_per_step=mid["nvme_read"],
                   nvme_written_per_step=mid["nvme_written"], io_bound_s=io_s,
                   io_bound_share=io_s / mid["s"],
                   step_peak_growth=max(p["peak_growth"] for p in steps))
    if peak.get("tier_peak") is not None:
        host = int(peak["tier_peak"].get("host", 0))
        device = int(peak["tier_peak"].get("device", 0))
        pipe = int(peak.get("outside_peak") or peak.get("pipeline_bytes", 0))
        out["split_at_peak"] = {"tier_host_peak": host, "tier_device_peak": device,
                                "adam_pipeline": pipe,
                                "rest": peak["peak_growth"] - host - device - pipe}
    return out


def schedule_table(rows: dict[str, Any]) -> list[str]:
    """Each tierzero schedule's step against the first's ([Note: layer-major schedule]):
    NVMe bytes per optimizer step and per parameter, step time, tokens/s."""
    runs = [(name, r) for name, r in rows.items() if "@" in name and r.get("summary")]
    if len(runs) < 2:
        return []
    base = runs[0][1]["summary"]

    def tok_s(r: dict[str, Any]) -> float:
        steps = [p for p in r["phases"] if p["phase"].startswith("step")]
        mid = sorted(steps[1:] or steps, key=lambda p: p["s"])[len(steps[1:] or steps) // 2]
        return float(mid.get("tokens", 0)) / mid["s"]

    out = ["row | NVMe B/param/step | vs first | step s | vs first | tokens/s | vs first"]
    for name, r in runs:
        s = r["summary"]
        nvme = s["nvme_read_per_step"] + s["nvme_written_per_step"]
        nvme0 = base["nvme_read_per_step"] + base["nvme_written_per_step"]
        out.append(f"{name} | {nvme / r['params']:.1f} | {nvme / nvme0:.2f}x | "
                   f"{s['step_s']:.1f} | {s['step_s'] / base['step_s']:.2f}x | "
                   f"{tok_s(r):.1f} | {tok_s(r) / tok_s(runs[0][1]):.2f}x")
    return out


def split_variant(variant: str) -> tuple[str, str]:
    """(state_precision, master_precision) of a --state-precisions entry ("int8+bf16master")."""
    state, _, master = variant.partition("+")
    return state, "bf16" if master == "bf16master" else "fp32"


def state_bytes_per_param(precision: str) -> float:
    """Training state per parameter with the Adam moments kept in `precision` (a
    --state-precisions entry): bf16 param and gradient (2 + 2), the fp32 master (4; none
    with +bf16master) and the two moments as the store keeps them."""
    from tierzero.offload.state_codec import bytes_per_param  # not in DeepSpeed's venv

    state, master = split_variant(precision)
    return (8.0 if master == "fp32" else 4.0) + bytes_per_param(state)


def precision_table(rows: dict[str, Any]) -> list[str]:
    """Markdown rows: each tierzero state precision's NVMe bytes and step against fp32's."""
    base = (rows.get("tierzero") or {}).get("summary") or {}
    out = ["| state_precision | NVMe read / step | written / step | bytes vs fp32 | step | "
           "vs fp32 | io_bound_s | at 8 x 4 MiB | CPU s / cores | + steal | "
           "disk w/r/both/deep GB/s |",
           "| --- |" + " ---: |" * 10]
    for name, row in rows.items():
        s = row.get("summary") or {}
        if not name.startswith("tierzero") or "step_s" not in s:
            continue
        vs = vs_step = ""
        if "step_s" in base and name != "tierzero":
            moved = s["nvme_read_per_step"] + s["nvme_written_per_step"]
            b_moved = base["nvme_read_per_step"] + base["nvme_written_per_step"]
            vs = f"{100 * (moved / b_moved - 1):+.1f} %"
            vs_step = f"{100 * (s['step_s'] / base['step_s'] - 1):+.1f} %"
        out.append(f"| {row.get('state_precision', 'fp32')} | "
                   f"{s['nvme_read_per_step'] / 1e9:.2f} GB | "
                   f"{s['nvme_written_per_step'] / 1e9:.2f} GB | {vs} | {s['step_s']:.1f} s | "
                   f"{vs_step} | {s['io_bound_s']:.1f} s | "
                   f"{s.get('io_bound_deep_s', float('nan')):.1f} s | "
                   f"{s.get('cpu_bound_s', float('nan')):.1f} s | "
                   f"{s.get('cpu_steal_bound_s', float('nan')):.1f} s | "
                   f"{row['disk']['write_gbps']:.2f} / {row['disk']['read_gbps']:.2f} / "
                   f"{row['disk']['mixed_gbps']:.2f} / "
                   f"{row['disk'].get('deep_mixed_gbps', float('nan')):.2f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=("tierzero", "deepspeed"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--swap-dir", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=32000, help=argparse.SUPPRESS)
    ap.add_argument("--swap", default="/var/tmp",
                    help="directory on the NVMe drive; a 0700 run directory is made inside")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--bw-bytes", type=int, default=4 * GiB,
                    help="size of the O_DIRECT bandwidth file (default 4 GiB)")
    ap.add_argument("--min-available", type=int, default=3 * GiB // 2,
                    help="kill a child when the machine's available memory falls below this")
    ap.add_argument("--child-max-rss", type=int, default=None, metavar="BYTES",
                    help="kill a child whose RSS (with its subprocesses) passes this and record "
                    "the phase it reached; default min(14 GiB, 0.6 x the memory available "
                    "when the run starts)")
    ap.add_argument("--set", type=parse_set, action="append", default=[], metavar="KEY=VALUE",
                    help="a tierzero config key for every tierzero row (repeatable; dotted, "
                    "YAML value), e.g. --set nvme.threads=16")
    ap.add_argument("--host-bytes", type=int, default=0,
                    help="offload.budgets.host_bytes of the tierzero run (default: unset)")
    ap.add_argument("--child-timeout", type=float, default=0,
                    help="kill a child after this many seconds (0: never); its finished "
                    "phases are kept as `partial`")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="gradient_clipping of both engines (default 1.0; 0: off)")
    ap.add_argument("--engines", default="tierzero,deepspeed")
    ap.add_argument("--state-precisions", default="fp32",
                    help="tierzero rows, one per offload.optimizer.state_precision, in this "
                    "order (fp32,bf16,int8; default fp32); +bf16master also sets "
                    "master_precision bf16 (e.g. int8+bf16master)")
    ap.add_argument("--grad-accum", type=int, default=1,
                    help="micro-batches per optimizer step (gradient_accumulation_steps)")
    ap.add_argument("--schedules", default="auto",
                    help="batch.schedule of each tierzero row: auto, layer_major, micro_step "
                    "(comma-separated: one row each, in the same run)")
    ap.add_argument("--deepspeed-python", help="python of the DeepSpeed virtualenv")
    ap.add_argument("--ds-builds", default="whole,zero_init",
                    help="DeepSpeed rows, one per way to build the model: whole (in host "
                    "memory, then deepspeed.initialize) and/or zero_init (under "
                    "deepspeed.zero.Init); default both")
    ap.add_argument("--ds-build", default="whole", help=argparse.SUPPRESS)
    ap.add_argument("--ds-sub-group-size", type=int, default=0, metavar="ELEMENTS",
                    help="zero_optimization.sub_group_size of the DeepSpeed rows (default: "
                    "unset, DeepSpeed's 1e9 elements; its swap buffers are sized to it)")
    ap.add_argument("--ds-param-buffers", type=int, default=0, metavar="N",
                    help="zero_optimization.offload_param.buffer_count of the DeepSpeed rows, "
                    "each buffer the size of the largest parameter, and max_in_cpu 0 "
                    "(default: unset, DeepSpeed's 5 of 1e8 elements and max_in_cpu 1e9)")
    ap.add_argument("--ds-param-buffer-elements", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true",
                    help="the same architecture at 33.6M parameters")
    ap.add_argument("--trace", metavar="PATH",
                    help="record each tierzero row's last step (swap/trace.py) into PATH.<row> "
                    "and add where its time went (benchmarks/trace_summary.py) to the row")
    ap.add_argument("--plan-only", action="store_true",
                    help="print tierzero plan's host prediction for this run and exit")
    ap.add_argument("--out", default="bench_out/scale_bench.json")
    args = ap.parse_args()
    if args.child:
        fn = child_tierzero if args.child == "tierzero" else child_deepspeed
        sys.stdout.write(json.dumps(fn(args)) + "\n")
        return
    if args.clip < 0:
        ap.error(f"--clip {args.clip}: allowed: a norm > 0, or 0 for no clipping")
    for flag in ("steps", "seq", "batch", "threads", "grad_accum"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} {getattr(args, flag)}: allowed: an integer >= 1")
    if not os.path.isdir(args.swap) or not os.access(args.swap, os.W_OK):
        ap.error(f"--swap {args.swap!r} is not a writable directory; pass one you own")
    engines = args.engines.split(",")
    if bad := set(engines) - {"tierzero", "deepspeed"}:
        ap.error(f"--engines: unknown {sorted(bad)}; allowed: tierzero, deepspeed")
    args.state_precisions = args.state_precisions.split(",")
    from tierzero.offload.state_codec import STATE_PRECISIONS

    if unknown := [p for p in args.state_precisions if split_variant(p)[0] not in
                   STATE_PRECISIONS or p.partition("+")[2] not in ("", "bf16master")]:
        ap.error(f"--state-precisions: unknown {unknown}; allowed: {', '.join(STATE_PRECISIONS)}"
                 ", each optionally +bf16master")
    args.schedules = args.schedules.split(",")
    if bad_s := set(args.schedules) - {"auto", "layer_major", "micro_step"}:
        ap.error(f"--schedules: unknown {sorted(bad_s)}; allowed: auto, layer_major, "
                 "micro_step")
    if args.quick:
        args.bw_bytes = min(args.bw_bytes, 512 << 20)
    args.ds_builds = args.ds_builds.split(",")
    if bad := set(args.ds_builds) - {"whole", "zero_init"}:
        ap.error(f"--ds-builds: unknown {sorted(bad)}; allowed: whole, zero_init")
    if args.child_max_rss is None:
        args.child_max_rss = min(14 * GiB, int(0.6 * psutil.virtual_memory().available))
    if args.ds_sub_group_size < 0:
        ap.error(f"--ds-sub-group-size {args.ds_sub_group_size}: allowed: elements > 0, "
                 "or 0 for DeepSpeed's default")
    if args.ds_param_buffers < 0:
        ap.error(f"--ds-param-buffers {args.ds_param_buffers}: allowed: buffers > 0, or 0 "
                 "for DeepSpeed's default")
    if args.child_max_rss <= 0:
        ap.error(f"--child-max-rss {args.child_max_rss}: allowed: a byte count > 0")

    sys.path.insert(0, str(HERE))
    import machine  # benchmarks/machine.py
    from bench_report import (  # benchmarks/bench_report.py
        fastest_drive,
        scale_result,
        scale_table,
    )

    # SIGTERM unwinds like Ctrl-C, so the finally below removes the run directory (and
    # run_child's kills its child)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("scale_bench: terminated"))
    run_dir = tempfile.mkdtemp(dir=args.swap, prefix="scale_bench-")  # 0700, ours
    result: dict[str, Any] = {"machine": machine.describe(args.swap), "shared_machine": True,
                              "argv": sys.argv[1:], "rows": {}}
    try:
        paths = write_inputs(run_dir, args)
        if args.plan_only:  # the plan's prediction for this config, no training
            plan = plan_prediction(paths["model"], paths["config"], args.seq, args.batch)
            sys.stdout.write(json.dumps(plan) + "\n")
            return
        bw = disk_bandwidth(run_dir, args.bw_bytes)
        result["disk"] = bw
        sys.stderr.write(f"disk: write {bw['write_gbps']:.2f} GB/s, read "
                         f"{bw['read_gbps']:.2f} GB/s, both together {bw['mixed_gbps']:.2f} "
                         f"GB/s, 8 x 4 MiB in flight {bw['deep_mixed_gbps']:.2f} GB/s "
                         f"(O_DIRECT, {bw['bytes'] / GiB:.1f} GiB)\n")
        if "tierzero" in engines:
            result["plan"] = plan_prediction(paths["model"], paths["config"], args.seq,
                                             args.batch)
        runs = [("tierzero", p, s) for p in args.state_precisions for s in args.schedules
                if "tierzero" in engines]
        runs += ([("deepspeed", b, "micro_step") for b in args.ds_builds]
                 if "deepspeed" in engines else [])
        sys.stderr.write(f"children stop at {args.child_max_rss / 1e9:.1f} GB of RSS "
                         f"(--child-max-rss)\n")
        for which, variant, schedule in runs:
            # tierzero rows: one per state precision and batch.schedule; DeepSpeed rows: one
            # per model build
            sub_group = (f":sub_group_size={args.ds_sub_group_size}"
                         if args.ds_sub_group_size else "")
            if args.ds_param_buffers:
                sub_group += f":param_buffers={args.ds_param_buffers}"
            name = (f"deepspeed:{variant}{sub_group}" if which == "deepspeed" else
                    which if variant == "fp32" else f"{which}:{variant}")
            if which == "tierzero" and len(args.schedules) > 1:
                name += f"@{schedule}"
            prec = "fp32" if which == "deepspeed" else variant
            if which == "deepspeed" and not args.deepspeed_python:
                result["rows"][name] = {"skipped": "no --deepspeed-python"}
                continue
            python = sys.executable if which == "tierzero" else args.deepspeed_python
            swap_dir = os.path.join(run_dir, f"swap-{which}")
            os.makedirs(swap_dir, 0o700, exist_ok=True)  # removed after the previous row
            sys.stderr.write(f"{name}: running (disk: write {bw['write_gbps']:.2f}, read "
                             f"{bw['read_gbps']:.2f}, together {bw['mixed_gbps']:.2f} GB/s)\n")
            row = run_child(python, which, paths, swap_dir, args,
                            config=paths.get(f"config:{prec}:{schedule}"),
                            ds_build=variant if which == "deepspeed" else "whole",
                            trace_tag=name.replace(":", "_").replace("@", "_"))
            # the drive right after the row: against the faster of before and after, and
            # the next row's measurement before it
            after = disk_bandwidth(run_dir, args.bw_bytes)
            row["state_precision"], row["disk"], row["disk_after"] = prec, bw, after
            row["schedule"] = schedule if which == "tierzero" else "micro_step"
            params = int(row.get("params", 0))
            if params:
                state = int(state_bytes_per_param(prec) * params)
                row["summary"] = summarize(row, fastest_drive(bw, after), state)
                if "io_bound_s" in row["summary"]:
                    row["summary"]["io_bound_before_s"] = summarize(row, bw, state)[
                        "io_bound_s"]
            else:
                row["summary"] = {}
            bw = after
            own = paths.get(f"config:{prec}:{schedule}", "")
            plan = (plan_prediction(paths["model"], own, args.seq, args.batch)
                    if own != paths["config"] else result.get("plan", {})
                    ) if which == "tierzero" else {}
            if "peak" in plan and row["summary"]:  # predict_run's host peak (bytes)
                s = row["summary"]
                s["plan_host_peak"] = plan["peak"]
                s["plan_over_measured"] = plan["peak"] / s["peak_growth"]
            if "nvme_read_per_step" in plan and row["summary"].get("nvme_read_per_step"):
                s = row["summary"]  # the plan's step bytes against the block layer's
                planned = plan["nvme_read_per_step"] + plan["nvme_written_per_step"]
                s["plan_nvme_per_step"] = planned
                s["plan_nvme_over_measured"] = planned / (s["nvme_read_per_step"]
                                                          + s["nvme_written_per_step"])
            result["rows"][name] = row
            shutil.rmtree(swap_dir, ignore_errors=True)  # ours: made by write_inputs
            brief = {k: v for k, v in row.items() if k not in ("rss_trace", "phases")}
            sys.stderr.write(f"{name}: {scale_result(row)}; "
                             f"{json.dumps(row.get('summary') or brief)[:1500]}\n")
            if row.get("trace_summary"):
                sys.stderr.write(f"{name}: traced step: {json.dumps(row['trace_summary'])}\n")
        result["table"] = scale_table(result["rows"])
        result["schedule_table"] = schedule_table(result["rows"])
        for line in result["table"] + result["schedule_table"]:
            sys.stderr.write(line + "\n")
        result["state_precision_table"] = precision_table(result["rows"])
        if len(result["state_precision_table"]) > 2:  # some tierzero row has a step
            for line in result["state_precision_table"]:
                sys.stderr.write(line + "\n")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    result["parent_peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    sys.stderr.write(f"written: {args.out}\n")


if __name__ == "__main__":
    main()
