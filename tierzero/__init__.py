"""tierzero: ZeRO-3 training with parameters, gradients and optimizer state offloaded to
pinned host memory and NVMe swap files.

The user API lives here (`tierzero.initialize`, `tierzero.Init`, `tierzero.load_config`,
...); the layers are the subpackages `tierzero.engine` (partitioning, hooks, training
API, config, checkpoints, CLI), `tierzero.offload` (memory tiers, CPU Adam),
`tierzero.swap` (NVMe swap files) and `tierzero.configs` (example configs).

[Note: package layout] The repository keeps engine/, offload/, swap/ and configs/ at
its top level; tierzero/ holds this file and one symlink per layer, so a checkout,
an editable install and the wheel all import the same names (`tierzero.engine.*`),
and no top-level `engine` or `configs` package of ours can collide with a user's.
"""

import os

# torch's CPU allocator puts every tensor of 2 MiB or more on transparent huge pages when
# this is set at its first allocation: [Note: huge pages for per-step host buffers] in
# offload/huge_pages.py. Set only where the environment does not say (0 turns it off).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from tierzero.engine import (
    CheckpointError,
    Config,
    ConfigError,
    GatheredParameters,
    Init,
    LateGradientError,
    LoadReport,
    OffloadedAdam,
    ParameterNotGatheredError,
    PendingSave,
    PretrainedLoadError,
    RanksDivergedError,
    ZeroEngine,
    consolidate,
    consolidate_to_safetensors,
    initialize,
    load_config,
    load_pretrained,
)
from tierzero.engine.hf import export_hf
from tierzero.offload import CPUAdam
from tierzero.offload.step_seam import TrainingStateError
from tierzero.swap import SwapError, SwapStore

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`tierzero.TierZeroTrainer` and `tierzero.TierZeroMixin`, imported on first use: they
    need transformers, which `import tierzero` does not."""
    if name in ("TierZeroTrainer", "TierZeroMixin"):
        from tierzero.engine.hf import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module 'tierzero' has no attribute {name!r}")


__all__ = [
    "CPUAdam",
    "CheckpointError",
    "Config",
    "ConfigError",
    "GatheredParameters",
    "Init",
    "LateGradientError",
    "LoadReport",
    "OffloadedAdam",
    "ParameterNotGatheredError",
    "PendingSave",
    "PretrainedLoadError",
    "RanksDivergedError",
    "SwapError",
    "SwapStore",
    "TierZeroMixin",
    "TierZeroTrainer",
    "TrainingStateError",
    "ZeroEngine",
    "consolidate",
    "consolidate_to_safetensors",
    "export_hf",
    "initialize",
    "load_config",
    "load_pretrained",
]
