"""DeepSpeed `offload_param` / `offload_optimizer` (and their legacy forms) -> native offload."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tierzero.engine.config import values
from tierzero.engine.config.ds_common import Mapped, check_keys, ds_bool, elements_to_bytes
from tierzero.engine.config.errors import ConfigError

log = logging.getLogger(__name__)

PARAM_KEYS = {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"}
OPT_KEYS = {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "pipeline",
            "pipeline_read", "pipeline_write", "fast_init", "ratio", "super_offload",
            "cpuadam_cores_perc", "convert_grad_on_cpu", "max_in_nvme"}
OPT_IGNORED = {
    "ratio": "partial offload is not supported: the whole optimizer state is offloaded",
    "pipeline_read": "always on: the streamed CPU Adam reads the next state ahead",
    "pipeline_write": "always on: the streamed CPU Adam writes state back behind the update",
    "pipeline": "always on: the streamed CPU Adam reads ahead and writes behind",
    "fast_init": "no equivalent setting",
    "super_offload": "Superchip-specific (not supported)",
    "cpuadam_cores_perc": "no equivalent setting (SuperOffload only)",
    "convert_grad_on_cpu": "no equivalent setting",
    "max_in_nvme": "the NVMe budget is offload.budgets.nvme_bytes",
}
# Legacy booleans: key -> (the section they stand for, native class)
LEGACY = {"cpu_offload": ("offload_optimizer", "optimizer"),
          "cpu_offload_param": ("offload_param", "params")}


def map_offload(zero: Mapping[str, tuple[str, Any]], stage: int, itemsize: int,
                out: Mapped) -> None:
    """`zero` maps canonical DeepSpeed names to (key as written, value)."""
    sections: dict[str, tuple[str, Mapping[str, Any]]] = {}
    for name in ("offload_param", "offload_optimizer"):
        if name in zero and zero[name][1] is not None:
            key, value = zero[name]
            if not isinstance(value, Mapping):
                raise ConfigError(f"zero_optimization.{key}",
                                  f"{value!r} is not allowed; allowed: a JSON object or null")
            sections[name] = (f"zero_optimization.{key}", value)
    for legacy, (name, _cls) in LEGACY.items():
        if legacy not in zero:
            continue
        key, raw = zero[legacy]
        ds_key = f"zero_optimization.{key}"
        if ds_bool(raw, ds_key):
            if name in sections:
                raise ConfigError(ds_key, f"true conflicts with zero_optimization.{name} (the "
                                  f"legacy and the current spelling); keep {name}")
            sections[name] = (ds_key, {"device": "cpu"})
    pin: bool | None = None
    if "cpu_offload_use_pin_memory" in zero:
        key, raw = zero["cpu_offload_use_pin_memory"]
        pin = ds_bool(raw, f"zero_optimization.{key}")
    for name, cls in (("offload_param", "params"), ("offload_optimizer", "optimizer")):
        if name in sections:
            ds_key, body = sections[name]
            if cls == "params" and stage != 3:
                out.ignore(ds_key, f"DeepSpeed acts on it at stage 3 only; stage is {stage}")
                continue
            _map_class(body, ds_key, cls, itemsize, out)
            if pin is not None and "pin_memory" not in body:
                out.set(f"offload.{cls}.pin_memory", pin,
                        "zero_optimization.cpu_offload_use_pin_memory")


def _map_class(body: Mapping[str, Any], prefix: str, cls: str, itemsize: int,
               out: Mapped) -> None:
    check_keys(body, PARAM_KEYS if cls == "params" else OPT_KEYS, prefix)
    raw_device = body.get("device", "none")
    device = str(raw_device).strip().lower() if raw_device is not None else "none"
    if device not in ("none", "cpu", "nvme"):
        raise ConfigError(f"{prefix}.device", f"{raw_device!r} is not allowed"
                          + values.did_you_mean(device, ("none", "cpu", "nvme"))
                          + "; allowed: none, cpu, nvme")
    native = f"offload.{cls}"
    out.set(f"{native}.device", device, f"{prefix}.device")
    out.origin[f"{native}.path"] = f"{prefix}.nvme_path"  # errors about a missing path
    if "nvme_path" in body:
        if device == "nvme":
            out.set(f"{native}.path", body["nvme_path"], f"{prefix}.nvme_path")
        else:
            out.ignore(f"{prefix}.nvme_path", f"unused: device is {device}")
    if "pin_memory" in body:
        out.set(f"{native}.pin_memory", ds_bool(body["pin_memory"], f"{prefix}.pin_memory"),
                f"{prefix}.pin_memory")
    # Parameter buffers hold compute-dtype elements; optimizer buffers fp32 state.
    size = itemsize if cls == "params" else 4
    if cls == "params" and device == "nvme" and "max_in_cpu" not in body:
        log.info("%s.max_in_cpu is not set: DeepSpeed's default (1e9 elements) would keep "
                 "parameter partitions up to that size in host memory; tierzero's default "
                 "is 0 (offload.params.max_in_cpu_bytes): every parameter shard is homed on "
                 "NVMe. Set %s.max_in_cpu to keep some in host memory", prefix, prefix)
    for ds, nat in (("buffer_count", "buffer_count"), ("buffer_size", "buffer_bytes"),
                    ("max_in_cpu", "max_in_cpu_bytes")):
        if ds not in body:
            continue
        if device != "nvme":  # DeepSpeed sizes its swap buffers only for nvme
            values.coerce(body[ds], int, {"ge": 0}, f"{prefix}.{ds}")  # still checked, as there
            out.ignore(f"{prefix}.{ds}", f"unused: device is {device} (swap buffers are "
                       "for nvme)")
        elif ds == "buffer_count":
            out.set(f"{native}.{nat}", body[ds], f"{prefix}.{ds}")
        else:
            out.set(f"{native}.{nat}", elements_to_bytes(body[ds], size, f"{prefix}.{ds}"),
                    f"{prefix}.{ds}")
    for ds, reason in OPT_IGNORED.items():
        if ds in body:
            out.ignore(f"{prefix}.{ds}", reason)
