"""Learning-rate schedules as `LambdaLR` multipliers of the optimizer's base lr.

`step()` is called by the engine once per optimizer step (not per micro-step,
and not on an fp16 step skipped for overflow).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("constant", "warmup_linear", "warmup_cosine")


def lr_multiplier(
    kind: str, warmup_steps: int, total_steps: int, min_ratio: float
) -> Callable[[int], float]:
    """Multiplier of the base lr at optimizer step `t` (0 before the first step).

    constant: 1. warmup_linear: linear 0 -> 1 over `warmup_steps`, then linear
    down to `min_ratio` at `total_steps`. warmup_cosine: same warmup, then a
    half cosine down to `min_ratio` at `total_steps`.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"scheduler type {kind!r} is not one of {list(SCHEDULES)}")
    if warmup_steps < 0 or (kind != "constant" and total_steps < warmup_steps):
        raise ValueError(f"scheduler needs 0 <= warmup_steps <= total_steps; got "
                         f"warmup_steps={warmup_steps}, total_steps={total_steps}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"scheduler min_ratio must be in [0, 1]; got {min_ratio}")

    def warm(t: int) -> float | None:
        if t < warmup_steps:
            return (t + 1) / (warmup_steps + 1)
        return None

    def constant(t: int) -> float:
        w = warm(t) if warmup_steps else None
        return 1.0 if w is None else w

    def linear(t: int) -> float:
        w = warm(t)
        if w is not None:
            return w
        span = max(1, total_steps - warmup_steps)
        frac = min(1.0, (t - warmup_steps) / span)
        return 1.0 - (1.0 - min_ratio) * frac

    def cosine(t: int) -> float:
        w = warm(t)
        if w is not None:
            return w
        span = max(1, total_steps - warmup_steps)
        frac = min(1.0, (t - warmup_steps) / span)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))

    return {"constant": constant, "warmup_linear": linear, "warmup_cosine": cosine}[kind]


def build_scheduler(
    optimizer: torch.optim.Optimizer, kind: str, warmup_steps: int, total_steps: int,
    min_ratio: float,
) -> LambdaLR:
    return LambdaLR(optimizer, lr_multiplier(kind, warmup_steps, total_steps, min_ratio))
