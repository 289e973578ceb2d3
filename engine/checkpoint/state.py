"""The small, non-shard part of a checkpoint: counters, optimizer scalars, schedule, loss
scaler and RNG states, as JSON (exact: floats round-trip through repr) plus a few tensors.

Optimizer state comes from the step driver's own `state_dict()` ([Note: the
optimizer-step seam] in offload/step_seam.py), split three ways per trainable group
([Note: checkpoint layout]): tensors the shard store owns (`exp_avg`, `exp_avg_sq`)
are saved as shards; other tensors with one value per shard element (an optimizer's
own buffers) are saved beside them as `<key>::optim.<name>`; scalars (`step`) go
into the rank file's JSON. Both drivers save the same form, so a checkpoint of
either loads into the other.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tierzero.engine.checkpoint.layout import RNG_PREFIX, CheckpointError

if TYPE_CHECKING:
    from tierzero.engine.engine import ZeroEngine

OPTIM_PREFIX = "optim."


def engine_state(eng: ZeroEngine) -> dict[str, Any]:
    """Counters, param-group hyperparameters, schedule and loss scaler (identical on ranks);
    restore_engine_state restores all but the hyper-parameters, which the step driver's
    load_state_dict takes."""
    groups = eng.step_driver.state_dict()["param_groups"]
    sched = {k: v for k, v in eng.lr_scheduler.state_dict().items() if k != "lr_lambdas"}
    scaler = eng.loss_scaler.state_dict() if eng.loss_scaler is not None else None
    return {"counters": eng.counters_state(), "param_groups": groups,
            "lr_scheduler": sched, "loss_scaler": scaler}


def restore_engine_state(eng: ZeroEngine, state: dict[str, Any]) -> None:
    eng.load_counters(state["counters"])
    sched = dict(eng.lr_scheduler.state_dict())
    sched.update(state["lr_scheduler"])
    eng.lr_scheduler.load_state_dict(sched)
    scaler = state["loss_scaler"]
    if (scaler is None) != (eng.loss_scaler is None):
        raise CheckpointError("the checkpoint and the engine disagree on fp16 loss scaling "
                              f"(saved: {scaler is not None}); load with the same precision")
    if eng.loss_scaler is not None and scaler is not None:
        eng.loss_scaler.load_state_dict(scaler)


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


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent module buffers (BatchNorm statistics, ...) by name: replicated, saved by
    rank 0. Found without module.state_dict(), whose engine hook would wait for a deferred
    optimizer update ([Note: saving a deferred step] in engine/checkpoint/deferred.py)."""
    skip = {f"{prefix}.{name}" if prefix else name
            for prefix, mod in module.named_modules() for name in mod._non_persistent_buffers_set}
    return {n: b for n, b in module.named_buffers() if n not in skip}


def hf_config_json(module: torch.nn.Module) -> str | None:
    """The model's Hugging Face config as JSON, when it has one."""
    cfg = getattr(module, "config", None)
    to_json = getattr(cfg, "to_json_string", None)
    return str(to_json()) if callable(to_json) else None
