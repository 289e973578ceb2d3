"""The main job, `tierzero train`: data, model source, step loop, metrics, timeline, plot."""

from tierzero.engine.train.checkpoints import TrainError
from tierzero.engine.train.data import ByteBatches, DataError, load_bytes
from tierzero.engine.train.loop import TrainOptions, TrainResult, run
from tierzero.engine.train.metrics import StepRecord
from tierzero.engine.train.model_source import ModelError, build_model
from tierzero.engine.train.timeline import TraceWindow
from tierzero.swap.trace import KINDS

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
