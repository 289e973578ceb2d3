"""The `batch` and `activations` sections: how a step splits its batch, where saved
activations wait for backward.

Part of the config tree (schema.py's module doc says how a field is written).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tierzero.engine.config.fields import meta

Schedule = Literal["auto", "layer_major", "micro_step"]


@dataclass(frozen=True)
class BatchConfig:
    """Batch sizes; global = micro x accumulation x world size (checked at initialize)."""

    micro_batch_size: int | None = field(
        default=None, metadata=meta("samples per rank per forward; null = derived, else 1", gt=0)
    )
    gradient_accumulation_steps: int | None = field(
        default=None,
        metadata=meta("micro-batches per optimizer step; null = derived, else 1", gt=0),
    )
    global_batch_size: int | None = field(
        default=None,
        metadata=meta("samples per optimizer step over all ranks; null = not checked", gt=0),
    )
    schedule: Schedule = field(
        default="auto",
        metadata=meta("how train_batch runs an accumulated step: layer_major (every "
                      "micro-batch through each unit while it is gathered: one gather per "
                      "unit per pass, the gradient summed in fp32 while resident), "
                      "micro_step (forward and backward per micro-batch), auto = "
                      "layer_major when gradient_accumulation_steps > 1 and parameters or "
                      "gradients live below the device"),
    )


@dataclass(frozen=True)
class ActivationsConfig:
    """Activations saved for backward (the model chooses what to recompute)."""

    cpu_offload: bool = field(
        default=False,
        metadata=meta("keep tensors saved for backward (checkpointed blocks' inputs included) "
                      "in pinned host memory until backward, and a layer-major pass's "
                      "unit-boundary tensors too; CUDA only, a no-op on CPU"),
    )
