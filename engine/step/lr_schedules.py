"""Learning-rate schedules (config `scheduler.*`) as `LambdaLR` multipliers of optimizer.lr.

The engine calls `step()` once per optimizer step: not per micro-step, and
not for an fp16 step skipped on overflow. Step t (0 before the first step):

  warm-up (t < warmup_steps): warmup_start_lr -> lr, linear in t/warmup_steps
      or, for warmup_shape "log", in log(t + 1) / log(warmup_steps) (DeepSpeed's
      WarmupLR curve);
  then constant: lr; warmup_linear: linear down to min_lr at total_steps;
      warmup_cosine: half cosine down to min_lr at total_steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from tierzero.engine.config import SchedulerConfig


def lr_at(cfg: SchedulerConfig, peak: float) -> Callable[[int], float]:
    """The learning rate at optimizer step t under `cfg`, peak `peak` (optimizer.lr)."""
    warm, start = cfg.warmup_steps, cfg.warmup_start_lr
    total = cfg.total_steps if cfg.total_steps is not None else warm

    def warmup(t: int) -> float:
        if cfg.warmup_shape == "log":
            frac = math.log(t + 1) / math.log(warm) if warm > 1 else 1.0
        else:
            frac = t / warm
        return start + (peak - start) * min(1.0, frac)

    def lr(t: int) -> float:
        if t < warm:
            return warmup(t)
        if cfg.type == "constant":
            return peak
        frac = min(1.0, (t - warm) / max(1, total - warm))
        if cfg.type == "warmup_linear":
            return peak + (cfg.min_lr - peak) * frac
        return cfg.min_lr + (peak - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))

    return lr


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig) -> LambdaLR:
    """One LambdaLR over every param group; each group's own lr is its peak."""
    peaks = [float(g["lr"]) for g in optimizer.param_groups]
    curves = [lr_at(cfg, p) for p in peaks]
    lambdas: list[Callable[[int], float]] = [
        _ratio(c, p) for c, p in zip(curves, peaks, strict=True)]
    return LambdaLR(optimizer, lambdas)


def _ratio(curve: Callable[[int], float], peak: float) -> Callable[[int], float]:
    return lambda t: curve(t) / peak
