"""Compute dtypes and the dynamic loss scaler for fp16 training."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def compute_dtype(precision: str) -> torch.dtype:
    dtype = COMPUTE_DTYPES.get(precision)
    if dtype is None:
        raise ValueError(f"precision {precision!r} is not one of {sorted(COMPUTE_DTYPES)}")
    return dtype


class DynamicLossScaler:
    """fp16 loss scaling: halve on overflow (the step is skipped), double after
    `growth_interval` overflow-free steps, never below `min_scale`."""

    def __init__(self, init_scale: float, growth_interval: int, min_scale: float) -> None:
        if init_scale <= 0 or min_scale <= 0 or growth_interval < 1:
            raise ValueError(
                f"loss scaler needs init_scale > 0, min_scale > 0, growth_interval >= 1; got "
                f"{init_scale}, {min_scale}, {growth_interval}")
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self._good_steps = 0
        self.overflows = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            old = self.scale
            self.scale = max(self.scale / 2.0, self.min_scale)
            self._good_steps = 0
            self.overflows += 1
            log.warning("fp16 gradient overflow: optimizer step skipped, loss scale %g -> %g",
                        old, self.scale)
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= 2.0
            self._good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self._good_steps, "overflows": self.overflows}


def has_overflow(grads: list[torch.Tensor]) -> bool:
    """True when any gradient holds inf or NaN (local to this rank)."""
    return any(not bool(torch.isfinite(g).all()) for g in grads)
