"""`engine.initialize`: the DeepSpeed-shaped entry point."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from engine.collectives import Comm
from engine.config import Config, load_config
from engine.config.load import ConfigSource
from engine.engine import ZeroEngine
from engine.optim import factory_from_user, torch_adam_factory

log = logging.getLogger(__name__)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _warn_unwired_offload(config: Config) -> None:
    """Offload tiers are not wired into the engine yet: say so, never ignore it silently."""
    asked = {f"offload.{cls}.device": getattr(config.offload, cls).device
             for cls in ("params", "optimizer")}
    asked = {k: v for k, v in asked.items() if v != "none"}
    if asked:
        log.warning("%s: offload is not wired into the engine yet; every shard stays in %s "
                    "memory (numerics are unaffected, memory use is not reduced)",
                    ", ".join(f"{k}={v!r}" for k, v in asked.items()),
                    "device" if torch.cuda.is_available() else "CPU")


def initialize(
    model: nn.Module,
    config: Config | ConfigSource,
    model_parameters: Iterable[nn.Parameter] | None = None,
    optimizer: object | None = None,
    lr_scheduler: object | None = None,
    *,
    device: torch.device | str | None = None,
) -> tuple[ZeroEngine, torch.optim.Optimizer, None, torch.optim.lr_scheduler.LRScheduler]:
    """Partition `model` over the ranks and return (engine, optimizer, None, scheduler).

    `config`: an engine.Config, or anything engine.load_config takes (a path to
    native YAML/JSON or DeepSpeed JSON, a mapping, None for the default).
    `model_parameters`: the parameters to train (others are frozen); default
    every parameter with requires_grad. `optimizer`: a torch Optimizer (rebuilt
    over the flat fp32 master shards with its defaults) or a callable
    params -> Optimizer; default `config.optimizer`. The returned optimizer and
    scheduler act on the master shards; the engine steps both. `device`: where
    shards and gathered parameters live; default the current CUDA device, else CPU.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(model=...) needs a torch.nn.Module; got "
                        f"{type(model).__name__}")
    if not isinstance(config, Config):
        config = load_config(config)
    _warn_unwired_offload(config)
    if lr_scheduler is not None:
        raise ValueError("initialize(lr_scheduler=...) is not supported: the schedule comes "
                         "from config.scheduler (constant, warmup_linear, warmup_cosine)")
    if model_parameters is not None:
        chosen = {id(p) for p in model_parameters}
        unknown = len(chosen - {id(p) for p in model.parameters()})
        if unknown:
            raise ValueError(f"model_parameters holds {unknown} tensors that are not "
                             "parameters of model")
        for p in model.parameters():
            if id(p) not in chosen:
                p.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model has no trainable parameters (requires_grad=False everywhere)")
    _seed_everything(config.seed)
    opt = config.optimizer
    factory = (factory_from_user(optimizer) if optimizer is not None
               else torch_adam_factory(opt.type, opt.lr, opt.betas, opt.eps, opt.weight_decay))
    eng = ZeroEngine(model, config, factory, comm=Comm(),
                     device=torch.device(device) if device is not None else None)
    return eng, eng.optimizer, None, eng.lr_scheduler
