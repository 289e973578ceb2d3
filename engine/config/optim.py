"""The `optimizer` and `scheduler` sections: Adam's hyper-parameters and the lr schedule.

Part of the config tree (schema.py's module doc says how a field is written);
ds_optim.py maps DeepSpeed's optimizer and scheduler blocks onto these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tierzero.engine.config.fields import meta

OptimizerType = Literal["adamw", "adam"]
SchedulerType = Literal["constant", "warmup_linear", "warmup_cosine"]
WarmupShape = Literal["linear", "log"]


@dataclass(frozen=True)
class OptimizerConfig:
    """Adam on the CPU (offload.CPUAdam)."""

    type: OptimizerType = field(
        default="adamw", metadata=meta("adamw = decoupled weight decay, adam = L2 in the gradient")
    )
    lr: float = field(default=1e-3, metadata=meta("peak learning rate", gt=0))
    betas: tuple[float, float] = field(
        default=(0.9, 0.999), metadata=meta("moment decay rates, each in [0, 1)")
    )
    eps: float = field(default=1e-8, metadata=meta("added to the denominator", gt=0))
    weight_decay: float = field(default=0.0, metadata=meta("weight decay coefficient", ge=0))


@dataclass(frozen=True)
class SchedulerConfig:
    """Learning-rate schedule, stepped once per optimizer step."""

    type: SchedulerType = field(
        default="constant",
        metadata=meta(
            "constant = warm up then hold lr; warmup_linear / warmup_cosine = warm up then decay "
            "to min_lr at total_steps"
        ),
    )
    warmup_steps: int = field(
        default=0, metadata=meta("steps from warmup_start_lr to optimizer.lr", ge=0)
    )
    warmup_shape: WarmupShape = field(
        default="linear", metadata=meta("warm-up curve: linear or log (DeepSpeed's)")
    )
    warmup_start_lr: float = field(default=0.0, metadata=meta("learning rate at step 0", ge=0))
    total_steps: int | None = field(
        default=None, metadata=meta("last step of the decay; required by the decaying types", gt=0)
    )
    min_lr: float = field(default=0.0, metadata=meta("learning rate reached at total_steps", ge=0))
