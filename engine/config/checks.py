"""One validation pass over a built Config: field types and bounds, then cross-field rules.

Runs from Config.__post_init__, so every way of building a Config (native
file, DeepSpeed file, dict, direct construction) is checked once, with the
dotted key path of whatever is wrong.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import tempfile
import typing
from typing import TYPE_CHECKING, Any

from tierzero.engine.config import values
from tierzero.engine.config.errors import ConfigError

if TYPE_CHECKING:
    from tierzero.engine.config.schema import BatchConfig, Config


def hints(cls: type[Any]) -> dict[str, Any]:
    """Resolved type hints of a config dataclass."""
    return typing.get_type_hints(cls)


def validate(config: Config) -> None:
    """Raise ConfigError for the first wrong value in `config`."""
    _check_fields(config, "")
    if len(config.ignored_keys) != len(config.ignored_reasons):
        raise ConfigError("ignored_reasons", "needs one reason per entry of ignored_keys")
    _check_offload(config)
    _check_optimizer(config)
    _check_scheduler(config)
    _check_batch(config.batch)
    if config.nvme.block_size % 4096:
        raise ConfigError("nvme.block_size", f"{config.nvme.block_size} is not allowed; "
                          "allowed: a multiple of 4096 bytes (O_DIRECT alignment)")
    budgets = config.offload.budgets
    if (budgets.host_bytes is not None and budgets.host_reserve_bytes is not None
            and budgets.host_reserve_bytes >= budgets.host_bytes):
        raise ConfigError("offload.budgets.host_reserve_bytes",
                          f"{budgets.host_reserve_bytes} is not below offload.budgets.host_bytes "
                          f"({budgets.host_bytes}); the reserve must leave room for the tier")


def _check_fields(node: Any, prefix: str) -> None:
    # Types and bounds of every leaf, recursing into sections. Coercing an
    # already-typed value is the identity, so this re-uses the parser's checks.
    types_ = hints(type(node))
    for f in dataclasses.fields(node):
        key = f"{prefix}{f.name}"
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _check_fields(value, key + ".")
            continue
        if f.metadata.get("internal"):
            continue
        if f.metadata.get("path") and not isinstance(value, bool):  # bool: `resume: true`
            # Already expanded by the parser; expanding twice could mangle a literal '$'.
            if value is not None and not (isinstance(value, str) and value):
                raise ConfigError(key, f"{value!r} is not allowed; allowed: null or a path")
            continue
        raw = list(value) if isinstance(value, tuple) else value
        coerced = values.coerce(raw, types_[f.name], f.metadata, key)
        int_for_float = isinstance(coerced, float) and type(value) is int
        if coerced != value or (type(coerced) is not type(value) and not int_for_float):
            raise ConfigError(key, f"{value!r} is not allowed; allowed: "
                              f"{values.describe(types_[f.name], f.metadata)}")


def _check_offload(config: Config) -> None:
    stage = config.zero.stage
    params, opt = config.offload.params, config.offload.optimizer
    if params.device != "none" and stage != 3:
        raise ConfigError("offload.params.device",
                          f"{params.device!r} needs zero.stage 3 (parameters are partitioned only "
                          f"at stage 3) but zero.stage is {stage}; set offload.params.device: none "
                          "or zero.stage: 3")
    if opt.device != "none" and stage == 0:
        raise ConfigError("offload.optimizer.device",
                          f"{opt.device!r} needs zero.stage 1, 2 or 3 but zero.stage is 0")
    if opt.grad_device != "auto" and opt.device == "none":
        raise ConfigError("offload.optimizer.grad_device",
                          f"{opt.grad_device!r} needs an offloaded optimizer (the gradient shards "
                          "live on the device with device Adam) but offload.optimizer.device is "
                          "'none'; set grad_device: auto or offload the optimizer")
    if opt.state_precision != "fp32" and opt.device == "none":
        raise ConfigError("offload.optimizer.state_precision",
                          f"{opt.state_precision!r} needs the CPU Adam (the moments are "
                          "compressed on the host or NVMe tier) but offload.optimizer.device "
                          "is 'none'; set state_precision: fp32 or offload.optimizer.device: "
                          "cpu / nvme / auto")
    _check_master(config)
    if opt.grad_device == "nvme" and opt.path is None and params.path is None:
        raise ConfigError("offload.optimizer.grad_device",
                          "'nvme' needs a swap directory; set offload.optimizer.path")
    for name, cls in (("params", params), ("optimizer", opt)):
        key = f"offload.{name}"
        if cls.device == "nvme" and cls.path is None:
            raise ConfigError(f"{key}.path", f"required when {key}.device is 'nvme'; set it to a "
                              "writable directory on a local NVMe drive")
        if cls.device in ("nvme", "auto") and cls.path is not None:
            check_swap_dir(cls.path, f"{key}.path")


def _check_master(config: Config) -> None:
    """offload.optimizer.master_precision bf16 needs a bf16 compute copy to be the master
    and the CPU Adam to round it ([Note: bf16 master weights] in offload/bf16_master.py)."""
    opt = config.offload.optimizer
    if opt.master_precision == "fp32":
        return
    key = "offload.optimizer.master_precision"
    if config.precision.dtype != "bf16":
        raise ConfigError(key, f"{opt.master_precision!r} makes the compute copy the master, "
                          f"which needs precision.dtype bf16 but it is "
                          f"{config.precision.dtype!r}; allowed with it: 'fp32'. Set "
                          "precision: bf16 or master_precision: fp32")
    if opt.device == "none":
        raise ConfigError(key, f"{opt.master_precision!r} needs the CPU Adam (it rounds the "
                          "bf16 master stochastically) but offload.optimizer.device is 'none'; "
                          "allowed with it: 'fp32'. Set offload.optimizer.device: cpu / nvme / "
                          "auto, or master_precision: fp32")


def check_swap_dir(path: str, key: str) -> None:
    """The directory exists and we can create files in it (tried, not guessed)."""
    if not os.path.exists(path):
        raise ConfigError(key, f"'{path}' does not exist (errno {errno.ENOENT}, ENOENT); create it "
                          f"(mkdir -p '{path}') or choose an existing directory")
    if not os.path.isdir(path):
        raise ConfigError(key, f"'{path}' is not a directory (errno {errno.ENOTDIR}, ENOTDIR); "
                          "choose a directory for the swap files")
    try:
        with tempfile.TemporaryFile(dir=path, prefix=".tierzero-probe-"):
            pass
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, "?")
        raise ConfigError(key, f"'{path}' is not writable (errno {exc.errno}, {code}: "
                          f"{exc.strerror}); choose a directory you own") from exc


def _check_optimizer(config: Config) -> None:
    for i, beta in enumerate(config.optimizer.betas):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"optimizer.betas[{i}]",
                              f"{beta} is out of range; allowed: 0 <= beta < 1")


def of_run_length(factor: float, steps: int) -> int:
    """ceil(factor x steps): a run-length "auto" ([Note: auto run length] in hf_auto.py)."""
    return math.ceil(factor * steps)


def _check_scheduler(config: Config) -> None:
    sched, lr = config.scheduler, config.optimizer.lr
    waiting = {key for key, _ in config.run_length_auto}
    if waiting - {"scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps"}:
        raise ConfigError("run_length_auto", f"unknown keys {sorted(waiting)}; allowed: "
                          "scheduler.params.total_num_steps, scheduler.params.warmup_num_steps")
    if sched.type != "constant" and not waiting:
        if sched.total_steps is None:
            raise ConfigError("scheduler.total_steps",
                              f"required by scheduler.type {sched.type!r}; set the last step of "
                              "the decay (an integer >= scheduler.warmup_steps)")
        # Equal is legal, as in DeepSpeed: no decay phase, min_lr right after warm-up.
        if sched.total_steps < sched.warmup_steps:
            raise ConfigError("scheduler.total_steps",
                              f"{sched.total_steps} is not allowed; allowed: at least "
                              f"scheduler.warmup_steps ({sched.warmup_steps})")
    for key, value in (("warmup_start_lr", sched.warmup_start_lr), ("min_lr", sched.min_lr)):
        if value > lr:
            raise ConfigError(f"scheduler.{key}",
                              f"{value} is above optimizer.lr ({lr}); allowed: 0 <= {key} <= lr")


def _check_batch(batch: BatchConfig) -> None:
    # What can be checked before the world size is known: divisibility.
    glob, micro, accum = (batch.global_batch_size, batch.micro_batch_size,
                          batch.gradient_accumulation_steps)
    if glob is None:
        return
    per_rank = (micro or 1) * (accum or 1)
    if glob % per_rank:
        raise ConfigError("batch.global_batch_size",
                          f"{glob} is not a multiple of micro_batch_size x "
                          f"gradient_accumulation_steps = {micro or 1} x {accum or 1} = "
                          f"{per_rank}; allowed: micro x accumulation x world size")


def resolve_batch(batch: BatchConfig, world: int) -> BatchConfig:
    """All three batch fields for `world` ranks (DeepSpeed's rules for unset ones)."""
    glob, micro, accum = (batch.global_batch_size, batch.micro_batch_size,
                          batch.gradient_accumulation_steps)
    if glob is not None:
        if micro is None and accum is None:
            accum = 1
        if micro is None:
            micro = _divide(glob, world * (accum or 1), "batch.micro_batch_size", batch, world)
        if accum is None:
            accum = _divide(glob, world * micro, "batch.gradient_accumulation_steps", batch, world)
    micro, accum = micro or 1, accum or 1
    if glob is not None and glob != micro * accum * world:
        raise ConfigError("batch.global_batch_size",
                          f"{glob} != micro_batch_size x gradient_accumulation_steps x world size "
                          f"= {micro} x {accum} x {world} = {micro * accum * world}; change one "
                          "of them or leave global_batch_size unset")
    return dataclasses.replace(batch, micro_batch_size=micro, gradient_accumulation_steps=accum,
                               global_batch_size=micro * accum * world)


def _divide(total: int, by: int, key: str, batch: BatchConfig, world: int) -> int:
    if total % by:
        raise ConfigError(key, f"cannot be derived: global_batch_size {total} is not divisible by "
                          f"{by} (world size {world} x the other batch factor); batch is {batch}")
    return total // by
