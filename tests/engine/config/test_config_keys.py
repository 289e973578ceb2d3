"""Every native key: its default, and a non-default value parsed from YAML-like input.

ROWS must name every leaf key of the schema (test_rows_cover_every_key), so a
new knob cannot be added without a parsing test and a stated default.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from tierzero import engine
from tierzero.engine.config.checks import hints
from tierzero.engine.config.native import as_dict

HOME = os.path.expanduser("~")

# (dotted key, expected default, raw value as a user writes it, parsed value,
#  other keys the value needs to be legal)
ROWS: list[tuple[str, Any, Any, Any, dict[str, Any]]] = [
    ("seed", 0, 7, 7, {}),
    ("precision.dtype", "bf16", "fp16", "fp16", {}),
    ("precision.loss_scale.value", 0.0, 128, 128.0, {}),
    ("precision.loss_scale.initial_scale_power", 16, "12", 12, {}),
    ("precision.loss_scale.growth_interval", 1000, 500.0, 500, {}),
    ("precision.loss_scale.hysteresis", 2, 4, 4, {}),
    ("precision.loss_scale.consecutive_hysteresis", False, True, True, {}),
    ("precision.loss_scale.min_scale", 1.0, 0.5, 0.5, {}),
    ("precision.grad_dtype", "auto", "fp32", "fp32", {}),
    ("precision.cpu_matmul", "auto", "fp32", "fp32", {}),
    ("zero.stage", 3, 2, 2, {}),
    ("zero.units", (), ["LlamaDecoderLayer", "Block"], ("LlamaDecoderLayer", "Block"), {}),
    ("zero.unit_min_bytes", 16 << 20, "1MiB", 1 << 20, {}),
    ("zero.leaf_modules", (), ["MyMoE"], ("MyMoE",), {}),
    ("zero.auto_leaf_moe", True, False, False, {}),
    ("zero.check_unit_order", True, False, False, {}),
    ("zero.collective_timeout_s", 600.0, 30, 30.0, {}),
    ("zero.prefetch_bytes", 100_000_000, "5e8", 500_000_000, {}),
    ("zero.max_live_bytes", None, 1e9, 1_000_000_000, {}),
    ("zero.init_live_bytes", 32 << 20, "64MiB", 64 << 20, {}),
    ("zero.persistence_threshold_bytes", 200_000, 0, 0, {}),
    ("zero.max_reuse_distance_bytes", None, "2GB", 2_000_000_000, {}),
    ("zero.overlap_comm", True, False, False, {}),
    ("zero.reduce_bucket_bytes", 1_000_000_000, "256 MiB", 256 << 20, {}),
    ("offload.params.device", "none", "cpu", "cpu", {}),
    ("offload.params.path", None, "~/swap", f"{HOME}/swap", {}),
    ("offload.params.pin_memory", True, False, False, {}),
    ("offload.params.buffer_count", 5, 8, 8, {}),
    ("offload.params.buffer_bytes", None, "64MiB", 64 << 20, {}),
    ("offload.params.max_in_cpu_bytes", 0, "1GiB", 1 << 30, {}),
    ("offload.optimizer.device", "none", "cpu", "cpu", {}),
    ("offload.optimizer.path", None, "$HOME/swap", f"{HOME}/swap", {}),
    ("offload.optimizer.pin_memory", True, False, False, {}),
    ("offload.optimizer.buffer_count", 4, 6, 6, {}),
    ("offload.optimizer.buffer_bytes", None, 4096, 4096, {}),
    ("offload.optimizer.chunk_numel", None, 4096, 4096, {}),
    ("offload.optimizer.state_precision", "fp32", "int8", "int8",
     {"offload": {"optimizer": {"device": "cpu"}}}),
    ("offload.optimizer.master_precision", "fp32", "bf16", "bf16",
     {"precision": "bf16", "offload": {"optimizer": {"device": "cpu"}}}),
    ("offload.optimizer.grad_device", "auto", "cpu", "cpu",
     {"offload": {"optimizer": {"device": "cpu"}}}),
    ("offload.optimizer.overlap_step", True, False, False, {}),
    ("offload.optimizer.speculate_step", True, False, False, {}),
    ("offload.budgets.device_bytes", None, "80GB", 80 * 10**9, {}),
    ("offload.budgets.host_bytes", None, "256GiB", 256 << 30, {}),
    ("offload.budgets.nvme_bytes", None, "2TB", 2 * 10**12, {}),
    ("offload.budgets.host_reserve_bytes", None, "8GiB", 8 << 30, {}),
    ("offload.budgets.nvme_reserve_fraction", 0.02, "0.1", 0.1, {}),
    ("nvme.block_size", 4 << 20, "1MiB", 1 << 20, {}),
    ("nvme.queue_depth", 8, 32, 32, {}),
    ("nvme.threads", 8, 2, 2, {}),
    ("nvme.direct_io", "auto", "off", "off", {}),
    ("nvme.verify", True, False, False, {}),
    ("optimizer.type", "adamw", "adam", "adam", {}),
    ("optimizer.lr", 1e-3, "3e-4", 3e-4, {}),
    ("optimizer.betas", (0.9, 0.999), [0.8, "0.95"], (0.8, 0.95), {}),
    ("optimizer.eps", 1e-8, 1e-6, 1e-6, {}),
    ("optimizer.weight_decay", 0.0, 0.1, 0.1, {}),
    ("scheduler.type", "constant", "warmup_cosine", "warmup_cosine",
     {"scheduler": {"total_steps": 100}}),
    ("scheduler.warmup_steps", 0, 10, 10, {}),
    ("scheduler.warmup_shape", "linear", "log", "log", {}),
    ("scheduler.warmup_start_lr", 0.0, 1e-5, 1e-5, {}),
    ("scheduler.total_steps", None, 100, 100, {}),
    ("scheduler.min_lr", 0.0, 1e-6, 1e-6, {}),
    ("batch.micro_batch_size", None, 2, 2, {}),
    ("batch.gradient_accumulation_steps", None, 4, 4, {}),
    ("batch.global_batch_size", None, 16, 16, {}),
    ("batch.schedule", "auto", "micro_step", "micro_step", {}),
    ("gradient_clipping", 0.0, 1, 1.0, {}),
    ("activations.cpu_offload", False, "true", True, {}),
    ("logging.level", "info", "debug", "debug", {}),
    ("logging.progress", "auto", "off", "off", {}),
    ("logging.steps_per_print", 10, 5, 5, {}),
    ("logging.wall_clock_breakdown", False, True, True, {}),
    ("outputs.permissions", "private", "group", "group", {}),
    ("outputs.background_save_share", 0.5, "0.25", 0.25, {}),
    ("outputs.background_save_copy_bytes", 256 << 20, "1GiB", 1 << 30, {}),
    ("train.model", "builtin:small", "builtin:tiny", "builtin:tiny", {}),
    ("train.tokenizer", None, "~/tok", f"{HOME}/tok", {}),
    ("train.dataset", None, "~/data.txt", f"{HOME}/data.txt", {}),
    ("train.packing", "auto", "pad", "pad", {}),
    ("train.shuffle", True, "false", False, {}),
    ("train.epochs", 0, "3", 3, {}),
    ("train.eval_dataset", None, "~/eval.jsonl", f"{HOME}/eval.jsonl", {}),
    ("train.eval_fraction", 0.0, "0.1", 0.1, {}),
    ("train.eval_interval", 0, 50, 50, {}),
    ("train.eval_batches", 0, 8.0, 8, {}),
    ("train.steps", 40, "100", 100, {}),
    ("train.seq_len", 128, 256.0, 256, {}),
    ("train.checkpoint_interval", 0, 10, 10, {}),
    ("train.checkpoint_dir", None, "$HOME/ckpt", f"{HOME}/ckpt", {}),
    ("train.resume", False, "true", True, {}),
    ("train.checkpoint_background", True, "false", False, {}),
    ("train.save_on_interrupt", False, "true", True, {}),
    ("train.max_nonfinite_steps", 3, 5, 5, {}),
    ("train.out_dir", "runs", "~/runs", f"{HOME}/runs", {}),
    ("train.lora.r", 0, "8", 8, {}),
    ("train.lora.alpha", 16.0, 32, 32.0, {}),
    ("train.lora.dropout", 0.0, "0.05", 0.05, {}),
    ("train.lora.target_modules", (), ["q_proj", "v_proj"], ("q_proj", "v_proj"), {}),
    ("train.export.at_end", True, False, False, {}),
    ("train.export.at_checkpoints", False, "true", True, {}),
    ("train.export.dir", None, "~/hf", f"{HOME}/hf", {}),
    ("train.export.dtype", "fp32", "bf16", "bf16", {}),
    ("train.export.lora", "adapter", "merged", "merged", {}),
    ("train.export.max_shard_bytes", 5 * 10**9, "2GiB", 2 << 30, {}),
    ("train.report_to", "none", "tensorboard", "tensorboard", {}),
    ("train.metrics_path", None, "m.jsonl", "m.jsonl", {}),
]


def leaf_keys(cls: type[Any], prefix: str = "") -> list[str]:
    keys: list[str] = []
    types_ = hints(cls)
    for f in dataclasses.fields(cls):
        hint = types_[f.name]
        if f.metadata.get("internal"):
            continue
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            keys += leaf_keys(hint, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def nested(key: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def get(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def test_rows_cover_every_key() -> None:
    assert [row[0] for row in ROWS] == leaf_keys(engine.Config)


@pytest.mark.parametrize(("key", "default", "raw", "parsed", "extra"), ROWS,
                         ids=[row[0] for row in ROWS])
def test_key_default_and_parse(key: str, default: Any, raw: Any, parsed: Any,
                               extra: dict[str, Any]) -> None:
    assert get(engine.load_config({}), key) == default
    config = engine.load_config(merge(nested(key, raw), extra))
    value = get(config, key)
    assert value == parsed
    assert type(value) is type(parsed)


def test_empty_mapping_is_all_defaults() -> None:
    config = engine.load_config({})
    assert config == engine.Config()
    assert config.source == "native"
    assert config.ignored_keys == ()


def test_config_is_frozen() -> None:
    config = engine.load_config({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.zero.stage = 1  # type: ignore[misc]


def test_precision_shorthand_equals_mapping() -> None:
    assert engine.load_config({"precision": "fp16"}) == engine.load_config(
        {"precision": {"dtype": "fp16"}})


def test_offload_shorthand_sets_both_classes(tmp_path: Any) -> None:
    config = engine.load_config({"offload": {"device": "nvme", "path": str(tmp_path),
                                             "pin_memory": False, "overlap_step": False,
                                             "max_in_cpu_bytes": "1GB"}})
    for cls in (config.offload.params, config.offload.optimizer):
        assert (cls.device, cls.path, cls.pin_memory) == ("nvme", str(tmp_path), False)
    assert config.offload.optimizer.overlap_step is False
    assert config.offload.params.max_in_cpu_bytes == 10**9


def test_per_class_section_overrides_shorthand(tmp_path: Any) -> None:
    config = engine.load_config({"offload": {"device": "cpu",
                                             "optimizer": {"device": "nvme",
                                                           "path": str(tmp_path)}}})
    assert config.offload.params.device == "cpu"
    assert config.offload.optimizer.device == "nvme"
    assert config.offload.optimizer.path == str(tmp_path)
    assert config.offload.params.path is None


def test_as_dict_round_trips() -> None:
    config = engine.load_config({"zero": {"units": ["A"]}, "precision": "fp16", "seed": 3})
    tree = as_dict(config)
    for f in dataclasses.fields(config):  # the loader's own fields (source, ignored keys, ...)
        if f.metadata.get("internal"):
            del tree[f.name]
    assert engine.load_config(tree) == config
