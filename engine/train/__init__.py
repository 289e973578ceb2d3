"""The main job, `tierzero train`: data, model source, step loop, metrics, timeline, plot."""

from engine.train.checkpoints import TrainError
from engine.train.data import ByteBatches, DataError, load_bytes
from engine.train.loop import TrainOptions, TrainResult, run
from engine.train.metrics import StepRecord
from engine.train.model_source import ModelError, build_model
from engine.train.timeline import TraceWindow
from swap.trace import KINDS

__all__ = [
    "KINDS",
    "ByteBatches",
    "DataError",
    "ModelError",
    "StepRecord",
    "TraceWindow",
    "TrainError",
    "TrainOptions",
    "TrainResult",
    "build_model",
    "load_bytes",
    "run",
]
