"""One step_bench configuration under DeepSpeed ZeRO-3, in DeepSpeed's own virtualenv.

step_bench.py runs in the project's .venv, which has no `deepspeed`; it starts this script
with the DeepSpeed virtualenv's python (`--deepspeed-python`, built by
benchmarks/install_deepspeed.sh) once per round and configuration, exactly as it starts its
own children, and reads the one JSON row this prints last (same keys as step_bench's rows).

Configurations (ZeRO-3, bf16 with fp32 master weights, AdamW lr 1e-4 as step_bench's
tierzero configs; DeepSpeed picks the optimizer kernel from its config as a user's run would):
  ds_none      everything on the device (CPU here); DeepSpeed's FusedAdam op
  ds_cpu       params and optimizer state offloaded to host memory; DeepSpeedCPUAdam
  ds_opt_nvme  optimizer state on NVMe (DeepSpeed's async_io op, libaio); DeepSpeedCPUAdam
  ds_all_nvme  params and optimizer state on NVMe; `stage3_prefetch_bucket_size: 0`, which
               DeepSpeed's NVMe parameter swapper needs without a GPU; otherwise DeepSpeed's
               defaults, whose `max_in_cpu` keeps the params in host memory after their
               first read at these model sizes (see [Note: DeepSpeed max_in_cpu])
  ds_all_nvme_nocache  ds_all_nvme with `max_in_cpu: 0`: params read from NVMe at each use
Each may carry `:clip` (e.g. ds_cpu:clip): `gradient_clipping` = --clip (default 1.0), the
twin of step_bench's `:clip` rows; without it, no clipping (tierzero's default).
The models are step_bench's own builders (imported), so they are identical parameter for
parameter. World size 1 over gloo (DeepSpeed's CPU accelerator falls back to gloo when
oneCCL's bindings are not installed), `DS_ACCELERATOR=cpu`.

NVMe bytes read/written per step come from /proc/self/io (`read_bytes`/`write_bytes`,
block-layer bytes of this process over the timed steps). DeepSpeed's swapper opens its
files with O_DIRECT, so the page cache hides none of them; ds_none/ds_cpu rows show the
floor (near 0). `swap_file_bytes` is the size of DeepSpeed's swap files after the run.

    <ds-venv>/bin/python benchmarks/ds_runner.py --model mlp --config ds_cpu --quick
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks an accelerator

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_bench  # benchmarks/step_bench.py: its model builders and RSS probes

CONFIGS = ("ds_none", "ds_cpu", "ds_opt_nvme", "ds_all_nvme", "ds_all_nvme_nocache")


def split_config(config: str) -> tuple[str, bool]:
    """"ds_cpu:clip" -> ("ds_cpu", True); anything else than CONFIGS[:clip] is an error."""
    base, *flags = config.split(":")
    if base not in CONFIGS or set(flags) - {"clip"} or len(flags) > 1:
        raise ValueError(f"--config {config!r} is not a DeepSpeed configuration; allowed: "
                         f"{', '.join(CONFIGS)}, each optionally with :clip")
    return base, bool(flags)


def zero_config(config: str, path: str, model: nn.Module) -> dict[str, Any]:
    """DeepSpeed `zero_optimization` section for one of CONFIGS (`:clip` aside)."""
    config, _ = split_config(config)
    # persistence 0: every parameter is partitioned, as step_bench's tierzero configs do
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    nvme = {"device": "nvme", "nvme_path": path, "pin_memory": False}
    if config == "ds_cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    elif config == "ds_opt_nvme":
        zero["offload_optimizer"] = dict(nvme)
    elif config in ("ds_all_nvme", "ds_all_nvme_nocache"):
        zero["offload_optimizer"] = dict(nvme)
        zero["offload_param"] = dict(nvme)
        # issue 6's note; checked: with the default 5e7 and params really swapped
        # (max_in_cpu 0) DeepSpeed fails: "param 27 already assigned swap buffer id 22"
        zero["stage3_prefetch_bucket_size"] = 0
    if config == "ds_all_nvme_nocache":
        # [Note: DeepSpeed max_in_cpu] DeepSpeed's default offload_param.max_in_cpu (1e9
        # elements) keeps every partition of a model this size in host memory after its
        # first read, so ds_all_nvme reads no params from NVMe per step. With 0 they are
        # read for each use; one buffer per in-flight param, so size them to the largest
        # param and allow 32 in flight (its default 5 x 1e8 runs out: "Not enough buffers").
        largest = max(p.numel() for p in model.parameters())
        zero["offload_param"].update(max_in_cpu=0, buffer_count=32, buffer_size=largest)
    return zero


def _io_bytes() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process has caused at the block layer."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StepTimer:
    """Wraps an optimizer's `step` to record the seconds each call takes.

    DeepSpeed's ZeRO-3 optimizer calls its inner optimizer's `step` once per sub-group
    (after swapping that sub-group in); `take()` returns the sum since the last take,
    which is the CPU Adam kernel time of one training step.
    """

    def __init__(self, step: Callable[..., Any]) -> None:
        self._step = step
        self._seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._step(*args, **kwargs)
        finally:
            self._seconds += time.perf_counter() - t0

    def take(self) -> float:
        s, self._seconds = self._seconds, 0.0
        return s


def child(args: argparse.Namespace) -> dict[str, Any]:
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    # torch warns on each reduce_scatter_tensor call DeepSpeed makes, every step
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    torch.set_num_threads(args.threads)
    raw, _units, vocab = step_bench.build(args.model, args.quick)
    model: nn.Module = raw if args.model == "mlp" else step_bench.HFLoss(raw)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    labels = torch.roll(ids, -1, 1)
    n_params = sum(p.numel() for p in model.parameters())
    path = tempfile.mkdtemp(dir=args.swap, prefix="ds_runner-")
    try:
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
            os.environ.setdefault(key, value)
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        zero = zero_config(args.config, path, model)
        cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
               "bf16": {"enabled": True}, "zero_optimization": zero,
               # weight decay 0 as step_bench's tierzero rows; clipping as their :clip rows
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
               "gradient_clipping": args.clip if split_config(args.config)[1] else 0.0,
               "steps_per_print": 1 << 30}
        eng, opt, _, _ = deepspeed.initialize(model=model, config=cfg,
                                              model_parameters=model.parameters())
        inner = opt.optimizer  # the AdamW DeepSpeed built (FusedAdam / DeepSpeedCPUAdam)
        timer = StepTimer(inner.step)
        inner.step = timer  # measurement only: DeepSpeed's object, not the user's model
        fb: list[float] = []
        opt_s: list[float] = []
        adam_s: list[float] = []

        def one() -> None:
            t0 = time.perf_counter()
            loss = eng(ids, labels)
            eng.backward(loss)
            t1 = time.perf_counter()
            eng.step()
            fb.append(t1 - t0)
            opt_s.append(time.perf_counter() - t1)
            adam_s.append(timer.take())
            if not torch.isfinite(loss.detach()):
                raise RuntimeError(f"{args.model}/{args.config}: loss is {loss.item()}")

        step_bench.warm_up(one, args.warmup, fb, opt_s, adam_s)
        io0 = _io_bytes()
        steps, total = step_bench.timed_steps(one, args.steps)
        io1 = _io_bytes()
        swap_bytes = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        import resource

        return {"config": args.config, "model": args.model, "params": n_params,
                "step_s": statistics.median(steps), "mean_step_s": total / args.steps,
                "fwd_bwd_s": statistics.median(fb), "opt_s": statistics.median(opt_s),
                "adam_s": statistics.median(adam_s),
                "nvme_read_per_step": (io1[0] - io0[0]) / args.steps,
                "nvme_write_per_step": (io1[1] - io0[1]) / args.steps,
                "peak_rss_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "peak_rss_train": step_bench._hwm(),
                "nvme_bytes_source": "/proc/self/io", "swap_file_bytes": swap_bytes,
                "deepspeed": deepspeed.__version__, "ds_optimizer": type(inner).__name__,
                "gradient_clipping": cfg["gradient_clipping"],
                "ds_zero": json.loads(json.dumps(zero).replace(path, "<swap>/ds_runner-*"))}
    finally:
        shutil.rmtree(path, ignore_errors=True)  # the directory mkdtemp made above


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # the same flags step_bench gives its own children (run_child), so it can start either
    ap.add_argument("--child", action="store_true", help="accepted; this script is a child")
    ap.add_argument("--model", choices=("mlp", "hf"), default="mlp")
    ap.add_argument("--config", default="ds_none",
                    help=f"one of {', '.join(CONFIGS)}, optionally with :clip")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="gradient_clipping of a :clip configuration (default 1.0)")
    ap.add_argument("--swap", default=tempfile.gettempdir(), help="NVMe directory")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true", help="step_bench's small models")
    ns = ap.parse_args()
    if not os.path.isdir(ns.swap) or not os.access(ns.swap, os.W_OK):
        ap.error(f"--swap {ns.swap!r} is not a writable directory; pass one you own")
    try:
        split_config(ns.config)
    except ValueError as e:
        ap.error(str(e))
    if ns.clip <= 0:
        ap.error(f"--clip {ns.clip} is not allowed; allowed: a norm > 0")
    for flag in ("steps", "warmup", "batch", "seq", "threads"):
        if getattr(ns, flag) < (0 if flag == "warmup" else 1):
            ap.error(f"--{flag} {getattr(ns, flag)} is not allowed; allowed: a positive integer")
    sys.stdout.write(json.dumps(child(ns)) + "\n")


if __name__ == "__main__":
    main()
