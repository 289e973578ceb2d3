"""engine: ZeRO-3 partitioning, module hooks, training API, config, checkpoints, CLI.

Knows modules and ranks; asks `offload` for residency. Public names are
re-exported here; everything else is private to the package.
"""

from tierzero.engine.config import Config, ConfigError, load_config

from tierzero.engine.access import GatheredParameters, ParameterNotGatheredError  # isort: skip
from tierzero.engine.engine import ZeroEngine  # isort: skip
from tierzero.engine.initialize import initialize  # isort: skip
from tierzero.engine.init.context import Init  # isort: skip
from tierzero.engine.hf.weights import PretrainedLoadError  # isort: skip
from tierzero.engine.hf.pretrained import LoadReport, load_pretrained  # isort: skip
from tierzero.engine.checkpoint.layout import CheckpointError  # isort: skip
from tierzero.engine.checkpoint.background import PendingSave  # isort: skip
from tierzero.engine.checkpoint.consolidate import consolidate, consolidate_to_safetensors  # isort: skip
from tierzero.engine.step.offloaded_adam import OffloadedAdam  # isort: skip
from tierzero.engine.late_grads import LateGradientError  # isort: skip
from tierzero.engine.collectives import RanksDivergedError  # isort: skip

__all__: list[str] = ["Config", "ConfigError", "load_config"]
__all__ += ["GatheredParameters", "ParameterNotGatheredError", "ZeroEngine", "initialize"]
__all__ += ["Init", "LoadReport", "PretrainedLoadError", "load_pretrained"]
__all__ += ["CheckpointError", "PendingSave", "consolidate", "consolidate_to_safetensors"]
__all__ += ["LateGradientError", "OffloadedAdam", "RanksDivergedError"]
