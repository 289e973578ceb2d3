"""The engine's view of the config: the values it acts on, read once from `engine.Config`.

No defaults live here: every value comes from the config schema (one source
of truth); this only names what the engine uses and checks cross-field rules
the engine itself imposes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSettings:
    stage: int  # 1, 2 or 3
    units: tuple[str, ...] | None  # module class names forming units, or None
    unit_min_bytes: int  # size rule when neither units nor _no_split_modules name blocks
    persistence_threshold_bytes: int  # units smaller than this stay gathered
    precision: str  # fp32 | bf16 | fp16
    optimizer_type: str  # adamw | adam
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    scheduler_type: str  # constant | warmup_linear | warmup_cosine
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    gradient_accumulation_steps: int
    gradient_clipping: float  # 0 disables
    loss_scale_init: float  # fp16 only
    loss_scale_growth_interval: int
    loss_scale_min: float
    seed: int | None

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"zero.stage is {self.stage}; allowed: 1, 2, 3")
        if self.gradient_accumulation_steps < 1:
            raise ValueError(f"batch.gradient_accumulation_steps is "
                             f"{self.gradient_accumulation_steps}; must be >= 1")
        if self.gradient_clipping < 0:
            raise ValueError(f"gradient_clipping is {self.gradient_clipping}; must be >= 0 "
                             "(0 disables clipping)")
