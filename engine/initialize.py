"""`engine.initialize`: the DeepSpeed-shaped entry point."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from tierzero.engine.collectives import Comm
from tierzero.engine.config import Config, load_config
from tierzero.engine.config.load import ConfigSource
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.step.device import factory_from_user, torch_adam_factory

log = logging.getLogger(__name__)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _offloaded_optimizer_config(config: Config, optimizer: object) -> Config:
    """With optimizer state offloaded the engine runs its CPU Adam (engine/step/offloaded_adam.py),
    not a user optimizer: a torch Adam/AdamW passes its hyper-parameters, anything else is
    refused by name."""
    if optimizer is None or config.offload.optimizer.device == "none":
        return config
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and isinstance(
            optimizer, torch.optim.Optimizer):
        d = optimizer.defaults
        if d.get("amsgrad") or d.get("maximize"):
            raise ValueError("optimizer= with amsgrad/maximize cannot run with "
                             "offload.optimizer.device != 'none' (the CPU Adam has neither)")
        adamw = isinstance(optimizer, torch.optim.AdamW) or bool(
            d.get("decoupled_weight_decay"))
        opt = dataclasses.replace(config.optimizer, type="adamw" if adamw else "adam",
                                  lr=float(d["lr"]), betas=tuple(d["betas"]),
                                  eps=float(d["eps"]), weight_decay=float(d["weight_decay"]))
        return dataclasses.replace(config, optimizer=opt)
    raise ValueError(f"optimizer={type(optimizer).__name__} cannot be used with "
                     f"offload.optimizer.device={config.offload.optimizer.device!r}: offloaded "
                     "optimizer state is updated by the engine's CPU Adam. Pass a "
                     "torch.optim.Adam/AdamW (its hyper-parameters are used), or set "
                     "config.optimizer and leave optimizer= unset")


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
    config.require_run_length()
    config = _offloaded_optimizer_config(config, optimizer)
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
    eng = ZeroEngine(model, config, factory,
                     comm=Comm(check_order=config.zero.check_unit_order,
                               timeout_s=config.zero.collective_timeout_s),
                     device=torch.device(device) if device is not None else None)
    return eng, eng.optimizer, None, eng.lr_scheduler
