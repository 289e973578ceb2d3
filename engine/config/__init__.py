"""Config: typed, frozen dataclasses loaded from native YAML/JSON or DeepSpeed JSON."""

from tierzero.engine.config.errors import ConfigError
from tierzero.engine.config.load import load_config
from tierzero.engine.config.schema import (
    ActivationsConfig,
    BatchConfig,
    BudgetsConfig,
    Config,
    LoggingConfig,
    LossScaleConfig,
    NvmeConfig,
    OffloadConfig,
    OptimizerConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
    PrecisionConfig,
    SchedulerConfig,
    ZeroConfig,
)
from tierzero.engine.config.train import TrainConfig

__all__ = [
    "ActivationsConfig",
    "BatchConfig",
    "BudgetsConfig",
    "Config",
    "ConfigError",
    "LoggingConfig",
    "LossScaleConfig",
    "NvmeConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "OptimizerOffloadConfig",
    "ParamOffloadConfig",
    "PrecisionConfig",
    "SchedulerConfig",
    "TrainConfig",
    "ZeroConfig",
    "load_config",
]
