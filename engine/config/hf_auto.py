"""Hugging Face's `"auto"` values in DeepSpeed JSON, resolved from training arguments.

The HF Trainer fills `"auto"` from its TrainingArguments before DeepSpeed sees
the file. We do the same from the `auto_values` mapping given to
load_config (TrainingArguments names, plus `world_size` and the model's
`hidden_size`); a name not given takes the TrainingArguments default below.
`"auto"` anywhere else is an error.

[Note: auto run length] `scheduler.params.total_num_steps` (and
`warmup_num_steps` from `warmup_ratio`) need the run length. Without
`max_steps` they resolve to a `RunLength` marker; the DeepSpeed mapping
records them in `Config.run_length_auto`, and `Config.with_run_length(steps)`
fills them once the run length is known (`tierzero train`: train.steps or the
epochs' steps; the Trainer: its max_steps). `initialize` refuses a config
that still waits, naming the DeepSpeed key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tierzero.engine.config import values
from tierzero.engine.config.errors import ConfigError

# TrainingArguments defaults (transformers); world_size and hidden_size have none.
HF_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5e-5,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "warmup_steps": 0,
    "warmup_ratio": 0.0,
    "max_steps": -1,
    "fp16": False,
    "bf16": False,
    "world_size": None,
    "hidden_size": None,
}

Args = Mapping[str, Any]


@dataclass(frozen=True)
class RunLength:
    """An "auto" that waits for the run length: ceil(factor x steps) ([Note: auto run length])."""

    factor: float


def _train_batch(a: Args) -> Any:
    if a["world_size"] is None:
        return None  # checked by Config.check_world_size at initialize
    return a["per_device_train_batch_size"] * a["gradient_accumulation_steps"] * a["world_size"]


def _warmup(a: Args) -> Any:
    if a["warmup_steps"] > 0:
        return a["warmup_steps"]
    if a["warmup_ratio"] > 0:
        return _of_run(a, a["warmup_ratio"])
    return 0


def _of_run(a: Args, factor: float) -> Any:
    if a["max_steps"] is None or a["max_steps"] <= 0:
        return RunLength(factor)
    return math.ceil(factor * a["max_steps"])


def _total(a: Args) -> Any:
    return _of_run(a, 1.0)


def _hidden(square: float, default: float) -> Callable[[Args], Any]:
    def rule(a: Args) -> Any:
        h = a["hidden_size"]
        return default if h is None else int(square * h * h)
    return rule


def _persistence(a: Args) -> Any:
    return 100_000 if a["hidden_size"] is None else 10 * a["hidden_size"]


# DeepSpeed key path -> how "auto" there is resolved.
RULES: dict[str, Callable[[Args], Any]] = {
    "train_micro_batch_size_per_gpu": lambda a: a["per_device_train_batch_size"],
    "gradient_accumulation_steps": lambda a: a["gradient_accumulation_steps"],
    "train_batch_size": _train_batch,
    "gradient_clipping": lambda a: a["max_grad_norm"],
    "fp16.enabled": lambda a: a["fp16"],
    "bf16.enabled": lambda a: a["bf16"],
    "bfloat16.enabled": lambda a: a["bf16"],
    "optimizer.params.lr": lambda a: a["learning_rate"],
    "optimizer.params.betas": lambda a: [a["adam_beta1"], a["adam_beta2"]],
    "optimizer.params.eps": lambda a: a["adam_epsilon"],
    "optimizer.params.weight_decay": lambda a: a["weight_decay"],
    "scheduler.params.warmup_min_lr": lambda a: 0.0,
    "scheduler.params.warmup_max_lr": lambda a: a["learning_rate"],
    "scheduler.params.warmup_num_steps": _warmup,
    "scheduler.params.total_num_steps": _total,
    "zero_optimization.reduce_bucket_size": _hidden(1.0, 5e8),
    "zero_optimization.stage3_prefetch_bucket_size": _hidden(0.9, 5e7),
    "zero_optimization.prefetch_bucket_size": _hidden(0.9, 5e7),
    "zero_optimization.stage3_param_persistence_threshold": _persistence,
    "zero_optimization.param_persistence_threshold": _persistence,
    # accelerate's DeepSpeedPlugin fills it from zero3_save_16bit_model (default false)
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": lambda a: False,
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": lambda a: False,
    "zero_optimization.gather_16bit_weights_on_model_save": lambda a: False,
}


def training_args(auto_values: Mapping[str, Any] | None) -> dict[str, Any]:
    """HF_DEFAULTS overridden by `auto_values`; unknown names are errors."""
    merged = dict(HF_DEFAULTS)
    for name, value in (auto_values or {}).items():
        if name not in HF_DEFAULTS:
            raise ConfigError(f"auto_values.{name}", "unknown name"
                              + values.did_you_mean(name, HF_DEFAULTS)
                              + "; allowed: " + ", ".join(HF_DEFAULTS))
        if value is not None and not isinstance(value, bool | int | float):
            raise ConfigError(f"auto_values.{name}",
                              f"{value!r} is not allowed; allowed: a number or true/false")
        merged[name] = value
    return merged


# Sections DeepSpeed reads through its pydantic config models, which drop an "auto" the
# HF integration left (DeepSpeedConfigModel, strict=False): the key takes DeepSpeed's
# default. Top-level keys and the other sections are read as written, so "auto" there
# is an error.
DEFAULTED_SECTIONS = ("zero_optimization.", "fp16.", "bf16.", "bfloat16.")
_DROPPED = object()


def resolve(data: Any, args: Args, prefix: str = "", dropped: list[str] | None = None) -> Any:
    """`data` with every "auto" replaced by its resolved value (a new tree). An "auto" no
    rule fills inside DEFAULTED_SECTIONS is left out (DeepSpeed's default) and its key
    appended to `dropped`."""
    if isinstance(data, Mapping):
        out = {}
        for k, v in data.items():
            value = resolve(v, args, f"{prefix}{k}.", dropped)
            if value is not _DROPPED:
                out[k] = value
        return out
    if isinstance(data, str) and data.strip().lower() == "auto":
        key = prefix.rstrip(".")
        rule = RULES.get(key)
        if rule is None and dropped is not None and key.startswith(DEFAULTED_SECTIONS):
            dropped.append(key)
            return _DROPPED
        if rule is None:
            raise ConfigError(key, "'auto' is not allowed here; 'auto' is allowed only at: "
                              + ", ".join(RULES) + ", and (meaning DeepSpeed's default) at any "
                              "key of " + ", ".join(s.rstrip(".") for s in DEFAULTED_SECTIONS))
        return rule(args)
    return data
