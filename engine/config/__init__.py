"""Config: typed, frozen dataclasses loaded from native YAML/JSON or DeepSpeed JSON."""

from engine.config.errors import ConfigError
from engine.config.load import load_config
from engine.config.schema import (
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

__all__ = [
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
    "ZeroConfig",
    "load_config",
]
