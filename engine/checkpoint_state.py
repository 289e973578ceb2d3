"""The small, non-shard part of a checkpoint: counters, optimizer scalars, schedule, loss
scaler and RNG states, as JSON (exact: floats round-trip through repr) plus a few tensors.

Optimizer state is split three ways per trainable group ([Note: checkpoint
layout]): tensors the shard store owns (`exp_avg`, `exp_avg_sq`) are saved as
shards; other tensors with one value per shard element (an optimizer's own
buffers) are saved beside them as `<key>::optim.<name>`; scalars (`step`) go
into this JSON.

The engine's CPU Adam (`OffloadedAdam`, optimizer state offloaded to cpu/nvme)
keeps no per-tensor torch state: its moments are the store's shards and its
step count is one integer. It is saved in the same form as torch's AdamW
(`{"step": {"tensor": n, "dtype": "torch.float32"}}` per group), so a
checkpoint of either loads into the other.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tierzero.engine.checkpoint_layout import RNG_PREFIX, CheckpointError
from tierzero.engine.offload_step import OffloadedAdam

if TYPE_CHECKING:
    from tierzero.engine.engine import ZeroEngine

OPTIM_PREFIX = "optim."
_SCALER_FIELDS = ("scale", "_hysteresis", "_good_steps", "overflows")
_COUNTERS = ("micro_steps", "global_steps", "skipped_steps", "last_grad_norm")


@dataclass
class OptimizerSplit:
    """One group's optimizer state, split for saving."""

    elementwise: dict[str, torch.Tensor] = field(default_factory=dict)  # shard-sized tensors
    scalars: dict[str, Any] = field(default_factory=dict)  # JSON: {"tensor": v, "dtype": d}|v


def split_optimizer_state(eng: ZeroEngine, key: str) -> OptimizerSplit:
    store, out = eng.store, OptimizerSplit()
    if isinstance(eng.optimizer, OffloadedAdam):  # moments are shards; the step is shared
        out.scalars["step"] = {"tensor": float(eng.optimizer.steps), "dtype": str(torch.float32)}
        return out
    master = store.tensor(key, "master")
    for name, value in eng.optimizer.state.get(master, {}).items():
        if isinstance(value, torch.Tensor):
            if store.has(key, name) and value is store.tensor(key, name):
                continue  # saved as the shard itself
            if value.numel() == master.numel() and value.dim() == 1:
                out.elementwise[OPTIM_PREFIX + name] = value
            elif value.numel() == 1:
                out.scalars[name] = {"tensor": value.item(), "dtype": str(value.dtype)}
            else:
                raise CheckpointError(f"optimizer state {name!r} of group {key!r} has shape "
                                      f"{list(value.shape)}: neither per-element nor scalar, "
                                      "so it cannot be saved with the shards")
        elif isinstance(value, bool | int | float | str) or value is None:
            out.scalars[name] = value
        else:
            raise CheckpointError(f"optimizer state {name!r} of group {key!r} is a "
                                  f"{type(value).__name__}; checkpoints hold tensors and "
                                  "JSON scalars")
    return out


def restore_optimizer_scalars(eng: ZeroEngine, key: str, scalars: dict[str, Any]) -> None:
    master = eng.store.tensor(key, "master")
    state = eng.optimizer.state.setdefault(master, {})
    for name, value in scalars.items():
        if isinstance(value, dict):
            cur = state.get(name)
            device = cur.device if isinstance(cur, torch.Tensor) else torch.device("cpu")
            dtype = getattr(torch, value["dtype"].removeprefix("torch."))
            state[name] = torch.tensor(value["tensor"], dtype=dtype, device=device)
        else:
            state[name] = value


def restore_offloaded_step(opt: OffloadedAdam, saved: dict[str, dict[str, Any]]) -> None:
    """The CPU Adam keeps one step count for every group: the saved groups (torch AdamW
    keeps one per group) must agree."""
    steps: dict[str, int] = {}
    for key, scalars in saved.items():
        unknown = sorted(set(scalars) - {"step"})
        if unknown:
            raise CheckpointError(
                f"optimizer state {unknown} of group {key!r} has no place in the engine's CPU "
                "Adam (offload.optimizer.device cpu/nvme); it was saved by another optimizer "
                "type: load with offload.optimizer.device 'none' and that optimizer")
        value = scalars.get("step", 0)
        step = float(value["tensor"] if isinstance(value, dict) else value)
        if step != int(step) or step < 0:
            raise CheckpointError(f"optimizer step {step} of group {key!r} is not a count")
        steps[key] = int(step)
    if len(set(steps.values())) > 1:
        raise CheckpointError(f"optimizer groups were saved at different steps {steps}; the "
                              "engine's CPU Adam keeps one step count for every group")
    opt.steps = next(iter(steps.values()), 0)


def engine_state(eng: ZeroEngine) -> dict[str, Any]:
    """Counters, param-group hyperparameters, schedule and loss scaler (identical on ranks)."""
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()
               if k != "params" and _jsonable(v)} for g in eng.optimizer.param_groups]
    sched = {k: v for k, v in eng.lr_scheduler.state_dict().items() if k != "lr_lambdas"}
    scaler = ({f: getattr(eng.loss_scaler, f) for f in _SCALER_FIELDS}
              if eng.loss_scaler is not None else None)
    return {"counters": {c: getattr(eng, c) for c in _COUNTERS}, "param_groups": groups,
            "lr_scheduler": sched, "loss_scaler": scaler}


def restore_engine_state(eng: ZeroEngine, state: dict[str, Any]) -> None:
    for c, v in state["counters"].items():
        setattr(eng, c, v)
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(eng.optimizer.param_groups):
        raise CheckpointError(f"checkpoint has {len(saved_groups)} optimizer param groups, "
                              f"the engine {len(eng.optimizer.param_groups)}")
    offloaded = isinstance(eng.optimizer, OffloadedAdam)
    for group, saved_group in zip(eng.optimizer.param_groups, saved_groups, strict=True):
        saved = saved_group
        if offloaded:  # torch's AdamW saves flags the CPU Adam does not have
            unsupported = [k for k in ("amsgrad", "maximize") if saved.get(k)]
            if unsupported:
                raise CheckpointError(f"the checkpoint's optimizer uses {unsupported}, which "
                                      "the engine's CPU Adam (offload.optimizer.device cpu/"
                                      "nvme) does not implement; load with offload.optimizer."
                                      "device 'none'")
            saved = {k: v for k, v in saved.items() if k in group}
        for k, v in saved.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    sched = dict(eng.lr_scheduler.state_dict())
    sched.update(state["lr_scheduler"])
    eng.lr_scheduler.load_state_dict(sched)
    scaler = state["loss_scaler"]
    if (scaler is None) != (eng.loss_scaler is None):
        raise CheckpointError("the checkpoint and the engine disagree on fp16 loss scaling "
                              f"(saved: {scaler is not None}); load with the same precision")
    if eng.loss_scaler is not None and scaler is not None:
        for f in _SCALER_FIELDS:
            setattr(eng.loss_scaler, f, scaler[f])


def _jsonable(v: Any) -> bool:
    if isinstance(v, list | tuple):
        return all(_jsonable(x) for x in v)
    return isinstance(v, bool | int | float | str) or v is None


def rng_state(device: torch.device) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This process's RNG states: python and numpy as JSON, torch (CPU, CUDA) as tensors."""
    version, mt, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    js = {"python": [version, list(mt), gauss],
          "numpy": {"key": np_state["state"]["key"].tolist(), "pos": np_state["state"]["pos"],
                    "has_gauss": np_state["has_gauss"], "gauss": np_state["gauss"]}}
    tensors = {RNG_PREFIX + "torch": torch.get_rng_state()}
    if device.type == "cuda":
        tensors[RNG_PREFIX + "cuda"] = torch.cuda.get_rng_state(device)
    return js, tensors


def restore_rng(js: dict[str, Any], tensors: dict[str, torch.Tensor],
                device: torch.device) -> None:
    version, mt, gauss = js["python"]
    random.setstate((version, tuple(mt), gauss))
    n = js["numpy"]
    np.random.set_state({"bit_generator": "MT19937",
                         "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    torch.set_rng_state(tensors[RNG_PREFIX + "torch"])
    cuda = tensors.get(RNG_PREFIX + "cuda")
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)
