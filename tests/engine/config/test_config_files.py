"""Every file in configs/ loads, says what its name promises, and ships as package data."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierzero import engine

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
FILES = sorted(p.relative_to(CONFIGS).as_posix() for p in CONFIGS.rglob("*")
               if p.suffix in (".yaml", ".json"))


def test_expected_files_exist() -> None:
    for name in ("default.yaml", "zero3_cpu.yaml", "zero3_nvme.yaml", "zero3_auto.yaml",
                 "deepspeed/zero3_offload.json", "deepspeed/zero2_cpu.json"):
        assert name in FILES


@pytest.mark.parametrize("name", FILES)
def test_every_config_loads(name: str) -> None:
    config = engine.load_config(CONFIGS / name)
    assert config.source == ("deepspeed" if name.startswith("deepspeed/") else "native")


def test_default_is_the_embedded_default() -> None:
    embedded = engine.load_config()
    assert embedded == engine.load_config(CONFIGS / "default.yaml")
    assert embedded.precision.dtype == "bf16"
    assert embedded.zero.stage == 3
    assert embedded.offload.params.device == embedded.offload.optimizer.device == "nvme"
    assert embedded.offload.params.path == "/var/tmp"


def test_zero3_cpu() -> None:
    config = engine.load_config(CONFIGS / "zero3_cpu.yaml")
    assert (config.offload.params.device, config.offload.optimizer.device) == ("cpu", "cpu")
    assert config.zero.prefetch_bytes == 256 << 20
    assert config.scheduler.type == "warmup_cosine"


def test_zero3_nvme_per_class_form() -> None:
    config = engine.load_config(CONFIGS / "zero3_nvme.yaml")
    assert (config.offload.params.device, config.offload.optimizer.device) == ("nvme", "nvme")
    assert config.offload.params.max_in_cpu_bytes == 4 << 30
    assert config.offload.budgets.host_bytes == 32 << 30
    assert config.nvme.queue_depth == 16


def test_zero3_auto() -> None:
    config = engine.load_config(CONFIGS / "zero3_auto.yaml")
    assert (config.offload.params.device, config.offload.optimizer.device) == ("auto", "auto")
    assert config.offload.budgets.device_bytes is None
    assert config.offload.budgets.host_reserve_bytes == 8 << 30
    assert config.offload.budgets.nvme_bytes == 500 * 10**9


def test_deepspeed_zero3_offload_with_training_args() -> None:
    path = CONFIGS / "deepspeed" / "zero3_offload.json"
    config = engine.load_config(path, auto_values={
        "bf16": True, "learning_rate": 1e-5, "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4, "world_size": 8, "warmup_steps": 30})
    assert config.zero.stage == 3
    assert config.precision.dtype == "bf16"
    assert (config.offload.params.device, config.offload.optimizer.device) == ("cpu", "nvme")
    # DeepSpeed sizes swap buffers for nvme only: a cpu offload_param reports them
    assert config.offload.params.buffer_bytes is None
    assert "zero_optimization.offload_param.buffer_size" in config.ignored_keys
    assert config.optimizer.lr == 1e-5
    assert (config.scheduler.type, config.scheduler.warmup_steps) == ("constant", 30)
    assert config.batch.global_batch_size == 64
    assert "zero_optimization.offload_param.nvme_path" in config.ignored_keys


def test_deepspeed_zero2_cpu() -> None:
    config = engine.load_config(CONFIGS / "deepspeed" / "zero2_cpu.json")
    assert (config.zero.stage, config.precision.dtype) == (2, "fp16")
    assert config.offload.optimizer.device == "cpu"
    assert config.optimizer.type == "adamw"  # DeepSpeed "Adam" defaults to adam_w_mode
    assert config.check_world_size(4).batch.gradient_accumulation_steps == 4  # 64 / (4 x 4)
    assert "tensorboard" in config.ignored_keys
