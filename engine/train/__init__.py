"""The main job, `tierzero train`: data, model source, step loop, metrics, timeline, plot."""

from tierzero.engine.train.checkpoints import TrainError
from tierzero.engine.train.data import (
    IGNORE,
    ByteBatches,
    DataError,
    ExampleBatches,
    TrainData,
    load_bytes,
    load_data,
    load_tokenizer,
)
from tierzero.engine.train.evaluation import evaluate, token_loss
from tierzero.engine.train.loop import TrainResult, run
from tierzero.engine.train.metrics import StepRecord
from tierzero.engine.train.model_source import ModelError, build_model
from tierzero.engine.train.setup import TrainOptions
from tierzero.engine.train.timeline import TraceWindow
from tierzero.swap.trace import KINDS

__all__ = [
    "IGNORE",
    "KINDS",
    "ByteBatches",
    "DataError",
    "ExampleBatches",
    "ModelError",
    "StepRecord",
    "TraceWindow",
    "TrainData",
    "TrainError",
    "TrainOptions",
    "TrainResult",
    "build_model",
    "evaluate",
    "load_bytes",
    "load_data",
    "load_tokenizer",
    "run",
    "token_loss",
]
