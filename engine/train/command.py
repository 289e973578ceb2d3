"""`tierzero train [CONFIG]`: argument parsing and error reporting for the training job."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from tierzero import engine
from tierzero.engine.config import ConfigError, load_config
from tierzero.engine.hf import ExportError, LoraError
from tierzero.engine.train.checkpoints import TrainError
from tierzero.engine.train.data import DataError
from tierzero.engine.train.loop import TrainStopped, run, with_steps
from tierzero.engine.train.model_source import ModelError
from tierzero.engine.train.plot import PlotError
from tierzero.engine.train.setup import TrainOptions
from tierzero.offload import PlanError

Subparsers = Any  # argparse's _SubParsersAction is private


def add_train(sub: Subparsers) -> None:
    train = sub.add_parser(
        "train", help="train the model a config names (omitted: the embedded default)",
        description="Train what CONFIG's train section names (model, dataset, steps). Without "
        "CONFIG: the built-in byte-level causal LM on the shipped corpus, as configured in "
        "the embedded default. Multi-rank: torchrun --nproc-per-node N -m tierzero train "
        "[CONFIG]. Writes a JSONL metrics file per run (train.out_dir/<run>/metrics.jsonl).",
    )
    train.add_argument("config", nargs="?", metavar="CONFIG",
                       help="native YAML/JSON or DeepSpeed JSON; omit for the embedded default")
    train.add_argument("--steps", type=int, metavar="N", help="override train.steps")
    train.add_argument("--trace", metavar="FILE",
                       help="write a Chrome/Perfetto trace-event JSON of the traced steps")
    train.add_argument("--trace-steps", metavar="FIRST,COUNT",
                       help="steps to trace, 1-based (default 2,2: the first step warms up; "
                       "1,1 when train.steps is 1)")
    train.add_argument("--plot", metavar="FILE.png",
                       help="draw per-tier memory and stall time per step (needs matplotlib)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(run=run_train)


def _trace_steps(text: str | None, steps: int) -> tuple[int, int]:
    if text is None:
        return (2, 2) if steps > 1 else (1, 1)
    first, sep, count = text.partition(",")
    try:
        return int(first), int(count) if sep else 1
    except ValueError:
        raise TrainError(f"--trace-steps {text!r}: allowed: FIRST,COUNT, e.g. 2,2") from None


def run_train(args: argparse.Namespace) -> int:
    try:
        config = with_steps(load_config(args.config), args.steps)
        options = TrainOptions(trace_path=args.trace,
                               trace_steps=_trace_steps(args.trace_steps, config.train.steps),
                               plot_path=args.plot, progress=not args.no_progress)
        logging.getLogger("tierzero.engine").setLevel(config.logging.level.upper())
        run(config, options)
    except TrainStopped as stopped:  # SIGINT/SIGTERM: [Note: stopping a run]
        sys.stderr.write(f"tierzero train: {stopped.line}\n")
        return stopped.exit_code
    except (ConfigError, TrainError, DataError, ModelError, PlotError,
            engine.PretrainedLoadError, ExportError, LoraError, PlanError) as exc:
        sys.stderr.write(f"tierzero train: error: {exc}\n")
        return 1
    return 0
