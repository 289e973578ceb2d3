"""DeepSpeed `optimizer` and `scheduler` sections -> native optimizer and scheduler.

DeepSpeed facts this relies on (deepspeed/runtime/engine.py, step/lr_schedules.py):
- type names match without regard to case; "Adam" runs in AdamW mode unless
  `adam_w_mode: false` (DeepSpeed's default for adam_w_mode is true);
- the schedulers set the learning rate themselves: WarmupLR and WarmupDecayLR
  use `warmup_max_lr` as the peak (the optimizer's `lr` is overridden), and
  WarmupDecayLR decays linearly back to `warmup_min_lr` at `total_num_steps`;
  WarmupCosineLR scales the optimizer's `lr` by `warmup_min_ratio` and
  `cos_min_ratio`. Ratios become absolute learning rates here.
- the default warm-up curve is "log".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierzero.engine.config import values
from tierzero.engine.config.ds_common import Mapped, check_keys, ds_bool, log
from tierzero.engine.config.errors import ConfigError
from tierzero.engine.config.hf_auto import RunLength

ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam",
               "bias_correction", "amsgrad", "fused"}
SCHEDULERS = {
    "warmuplr": ("WarmupLR", {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                              "warmup_type", "last_batch_iteration"}),
    "warmupdecaylr": ("WarmupDecayLR", {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                        "warmup_type", "total_num_steps",
                                        "last_batch_iteration"}),
    "warmupcosinelr": ("WarmupCosineLR", {"warmup_min_ratio", "warmup_num_steps",
                                          "warmup_type", "total_num_steps", "cos_min_ratio",
                                          "last_batch_iteration"}),
}


def _params(section: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    params = section.get("params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{prefix}.params", f"{params!r} is not allowed; allowed: a JSON object")
    check_keys(section, {"type", "params"}, prefix)
    return params


def map_optimizer(section: Any, out: Mapped) -> None:
    if section is None:
        return
    if not isinstance(section, Mapping):
        raise ConfigError("optimizer", f"{section!r} is not allowed; allowed: a JSON object")
    raw_type = section.get("type", "AdamW")
    name = str(raw_type).strip().lower()
    if name not in ("adam", "adamw"):
        raise ConfigError("optimizer.type", f"{raw_type!r} is not supported"
                          + values.did_you_mean(name, ("adam", "adamw"))
                          + "; allowed: Adam, AdamW (any case)")
    params = _params(section, "optimizer")
    check_keys(params, ADAM_PARAMS, "optimizer.params")
    w_mode = ds_bool(params.get("adam_w_mode", True), "optimizer.params.adam_w_mode")
    out.set("optimizer.type", "adamw" if name == "adamw" or w_mode else "adam", "optimizer.type")
    for key in ("lr", "betas", "eps", "weight_decay"):
        if key in params:
            out.set(f"optimizer.{key}", params[key], f"optimizer.params.{key}")
    for key, bad, why in (("bias_correction", False, "bias correction is always applied"),
                          ("amsgrad", True, "AMSGrad is not implemented")):
        if key in params and ds_bool(params[key], f"optimizer.params.{key}") is bad:
            raise ConfigError(f"optimizer.params.{key}", f"{bad!r} is not supported ({why}); "
                              f"allowed: {not bad!r} or leave it out")
    for key in ("torch_adam", "fused"):
        if key in params:
            out.ignore(f"optimizer.params.{key}", "tierzero always runs its CPU Adam")


def map_scheduler(section: Any, out: Mapped) -> None:
    if section is None:
        return
    if not isinstance(section, Mapping):
        raise ConfigError("scheduler", f"{section!r} is not allowed; allowed: a JSON object")
    raw_type = section.get("type")
    name = str(raw_type).strip().lower()
    if name not in SCHEDULERS:
        raise ConfigError("scheduler.type", f"{raw_type!r} is not supported"
                          + values.did_you_mean(name, SCHEDULERS)
                          + "; allowed: WarmupLR, WarmupDecayLR, WarmupCosineLR")
    params = _params(section, "scheduler")
    check_keys(params, SCHEDULERS[name][1], "scheduler.params")

    def num(key: str, default: float) -> float:
        return float(values.coerce(params.get(key, default), float, {}, f"scheduler.params.{key}"))

    def put(native: str, key: str, value: Any) -> None:
        if isinstance(value, RunLength):  # filled by Config.with_run_length
            out.run_length[f"scheduler.params.{key}"] = value.factor
            return
        out.set(f"scheduler.{native}", value, f"scheduler.params.{key}")

    _warmup(params, put, out)
    if "total_num_steps" in params:
        put("total_steps", "total_num_steps", params["total_num_steps"])
    if name == "warmupcosinelr":
        out.set("scheduler.type", "warmup_cosine", "scheduler.type")
        lr = values.coerce(out.native.get("optimizer", {}).get("lr", 1e-3), float, {"gt": 0},
                           "optimizer.params.lr")
        put("warmup_start_lr", "warmup_min_ratio", num("warmup_min_ratio", 0.0) * lr)
        put("min_lr", "cos_min_ratio", num("cos_min_ratio", 0.0001) * lr)
    else:
        out.set("scheduler.type", "constant" if name == "warmuplr" else "warmup_linear",
                "scheduler.type")
        peak = num("warmup_max_lr", 0.001)
        opt_lr = out.native.get("optimizer", {}).get("lr")
        if opt_lr is not None and values.coerce(opt_lr, float, {}, "optimizer.params.lr") != peak:
            log.warning("scheduler.params.warmup_max_lr (%s) overrides optimizer.params.lr (%s), "
                        "as in DeepSpeed", peak, opt_lr)
        out.set("optimizer.lr", peak, "scheduler.params.warmup_max_lr")
        put("warmup_start_lr", "warmup_min_lr", num("warmup_min_lr", 0.0))
        if name == "warmupdecaylr":
            put("min_lr", "warmup_min_lr", num("warmup_min_lr", 0.0))
    if params.get("last_batch_iteration", -1) != -1:
        out.ignore("scheduler.params.last_batch_iteration", "resume restores the step count")


def _warmup(params: Mapping[str, Any], put: Any, out: Mapped) -> None:
    """DeepSpeed's warm-up: over max(2, warmup_num_steps) steps (its schedulers clamp the
    count, so 0 and 1 warm up over 2 steps, the first at warmup_min_lr), here no longer
    than a known total_num_steps (a run of one step; DeepSpeed would only warn); an unknown
    warmup_type falls back to "log" with a warning, as DeepSpeed does."""
    steps = params.get("warmup_num_steps", 1000)
    if isinstance(steps, RunLength):  # filled by Config.with_run_length, clamped there
        put("warmup_steps", "warmup_num_steps", steps)
    else:
        n = values.coerce(steps, int, {"ge": 0}, "scheduler.params.warmup_num_steps")
        warm, total = max(2, n), params.get("total_num_steps")
        if total is not None and not isinstance(total, RunLength):
            total = values.coerce(total, int, {"gt": 0}, "scheduler.params.total_num_steps")
            warm = min(warm, max(n, total))
        put("warmup_steps", "warmup_num_steps", warm)
    shape = params.get("warmup_type", "log")
    if str(shape).strip().lower() not in ("log", "linear"):
        out.ignore("scheduler.params.warmup_type", f"{shape!r} is not log or linear: DeepSpeed "
                   "warns and warms up on its log curve, and so does tierzero")
        shape = "log"
    put("warmup_shape", "warmup_type", str(shape).strip().lower())
