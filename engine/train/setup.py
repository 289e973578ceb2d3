"""What `tierzero train` settles before its loop: the checks on everything the user gave
(before any work), the process group, the run directory and its locks, the TensorBoard
sink, and the small collectives every rank takes the same branch on."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from tierzero.engine.config import Config
from tierzero.engine.config.train import TrainConfig
from tierzero.engine.models import SIZES
from tierzero.engine.train import checkpoints
from tierzero.engine.train.checkpoints import TrainError
from tierzero.engine.train.data import check_data_settings
from tierzero.engine.train.run_lock import RunLock
from tierzero.engine.train.tensorboard import TensorBoardSink, require_tensorboard
from tierzero.swap.safe_files import OutputModes, make_output_dir, output_modes


@dataclass(frozen=True)
class TrainOptions:
    """Command-line additions to config.train."""

    trace_path: str | None = None  # Chrome trace-event JSON of the traced steps
    trace_steps: tuple[int, int] = (2, 2)  # (first step, count), 1-based
    plot_path: str | None = None
    progress: bool = True


def check_settings(config: Config, options: TrainOptions) -> None:
    """Refuse what cannot be done, before any work starts."""
    tc = config.train
    checkpoints.check_checkpoint_settings(tc)
    check_data_settings(tc)
    first, count = options.trace_steps
    if options.trace_path and (first < 1 or count < 1 or first > tc.steps):
        raise TrainError(f"--trace-steps {first},{count}: needs FIRST >= 1, COUNT >= 1 and FIRST "
                         f"<= train.steps ({tc.steps})")
    for flag, path in (("--trace", options.trace_path), ("--plot", options.plot_path)):
        parent = os.path.dirname(os.path.abspath(path)) if path else None
        if parent is not None and not os.path.isdir(parent):
            raise TrainError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if options.plot_path:
        from tierzero.engine.train.plot import require_matplotlib
        require_matplotlib()
    if tc.report_to == "tensorboard":
        require_tensorboard()
    check_hf_settings(tc)


def tensorboard_sink(tc: TrainConfig, run_dir: str, modes: OutputModes) -> TensorBoardSink | None:
    """train.report_to: the TensorBoard writer of this run (rank 0), or None."""
    if tc.report_to != "tensorboard":
        return None
    return TensorBoardSink(os.path.join(run_dir, "tensorboard"), modes)


def check_hf_settings(tc: TrainConfig) -> None:
    """train.lora and train.export: what they need is there, nothing would be overwritten."""
    hf_model = not (tc.model.startswith("builtin:") or tc.model in SIZES)
    if tc.lora.r and importlib.util.find_spec("peft") is None:
        raise TrainError("train.lora.r > 0 needs the peft package: pip install 'tierzero[hf]'")
    if tc.lora.r and not hf_model and not tc.lora.target_modules:
        raise TrainError(f"train.lora on the built-in model {tc.model!r} needs "
                         "train.lora.target_modules (peft knows defaults for Hugging Face "
                         "architectures only), e.g. [qkv, proj]")
    if tc.export.at_checkpoints and not hf_model:
        raise TrainError(f"train.export.at_checkpoints: the built-in model {tc.model!r} has no "
                         "Hugging Face format; use a Hugging Face model or set it to false")
    if tc.export.at_checkpoints and not tc.checkpoint_interval:
        raise TrainError("train.export.at_checkpoints needs train.checkpoint_interval > 0 "
                         "(exports are written at checkpoints)")
    if tc.export.dir is not None and tc.export.at_end and hf_model:
        final = Path(tc.export.dir) / "final"
        if final.exists():
            raise TrainError(f"train.export.dir '{tc.export.dir}' already holds {final}; "
                             "exports are never overwritten: pick another directory")


def init_process_group() -> bool:
    """Join the torchrun group when launched by torchrun; True if this call created it."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return True


def mean_over_ranks(value: float, world_size: int) -> float:
    if world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / world_size


def run_dir_for(config: Config, rank0: bool) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = os.path.join(config.train.out_dir, f"{stamp}-{os.getpid()}")
    if rank0:
        modes = output_modes(config.outputs.permissions)
        make_output_dir(config.train.out_dir, modes)
        os.mkdir(path, modes.dir)  # a new run directory: never an existing one
        os.chmod(path, modes.dir)
    return path


@contextmanager
def run_locks(tc: TrainConfig) -> Iterator[None]:
    """Hold this run's locks ([Note: run locks] in run_lock.py): the checkpoint directory,
    whose leftovers of interrupted saves are then ours to remove, and the metrics file.
    Taken by rank 0 (every rank of one job shares them), before any work."""
    with ExitStack() as stack:
        if int(os.environ.get("RANK", "0")) == 0:
            if tc.checkpoint_dir is not None:
                os.makedirs(tc.checkpoint_dir, exist_ok=True)
                stack.enter_context(RunLock(Path(tc.checkpoint_dir) / ".lock",
                                            f"train.checkpoint_dir '{tc.checkpoint_dir}'"))
                checkpoints.remove_partial_saves(tc.checkpoint_dir)
            if tc.metrics_path is not None:
                where = Path(os.path.abspath(tc.metrics_path))
                where.parent.mkdir(parents=True, exist_ok=True)  # as MetricsWriter would
                stack.enter_context(RunLock(where.parent / f".{where.name}.lock",
                                            f"train.metrics_path '{tc.metrics_path}'"))
        yield


def any_over_ranks(flag: float, world: int) -> float:
    """The largest of every rank's `flag` (so all ranks take the same branch)."""
    if world == 1:
        return flag
    t = torch.tensor([flag], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
