"""DeepSpeed configs as fine-tuning projects ship them (tests/data/deepspeed_configs/) load
and train a tiny model, and every value DeepSpeed's config parsing takes for a key loads
with DeepSpeed's meaning or is reported with the reason ([Note: DeepSpeed's values] in
engine/config/deepspeed.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import make_batches, make_model, train_steps

from tierzero import engine

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "deepspeed_configs"
NAMES = sorted(p.name for p in FIXTURES.glob("*.json"))
# What the HF Trainer fills "auto" from; fp32, so the tiny runs are fast on a CPU.
TRAINING_ARGS = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                 "learning_rate": 1e-2, "max_steps": 3, "world_size": 1, "bf16": False,
                 "fp16": False}


def ds(**sections: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, **sections}


def reasons(config: engine.Config) -> dict[str, str]:
    return dict(zip(config.ignored_keys, config.ignored_reasons, strict=True))


@pytest.fixture
def nvme_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TIERZERO_FIXTURE_NVME", str(tmp_path))
    return tmp_path


def test_the_shipped_configs_are_all_here() -> None:
    axolotl = {"zero1", "zero1_torch_compile", "zero2", "zero2_torch_compile", "zero3",
               "zero3_bf16", "zero3_bf16_cpuoffload_all", "zero3_bf16_cpuoffload_params"}
    assert {f"axolotl_{n}.json" for n in axolotl} <= set(NAMES)
    assert {"llamafactory_ds_z3_config.json", "llamafactory_ds_z3_offload_config.json",
            "llamafactory_ds_z2_config.json", "llamafactory_ds_z2_offload_config.json"} <= set(
        NAMES)
    assert len(NAMES) == 26


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_fixture_loads_and_trains(name: str, nvme_dir: Path) -> None:
    config = engine.load_config(FIXTURES / name, auto_values=TRAINING_ARGS)
    assert config.source == "deepspeed"
    assert len(config.ignored_keys) == len(config.ignored_reasons)
    assert all(r.strip() for r in config.ignored_reasons)
    eng, *_ = engine.initialize(device="cpu", model=make_model(), config=config)
    try:
        losses = train_steps(eng, make_batches(4))
    finally:
        eng.close()
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses


def test_axolotl_zero3_values() -> None:
    """sub_group_size 0 (DeepSpeed: one sub-group per parameter) keeps tierzero's piece size
    and says so; max_live_parameters / max_reuse_distance 0 are DeepSpeed's: nothing
    fetched ahead beyond the next use, nothing kept for reuse."""
    config = engine.load_config(FIXTURES / "axolotl_zero3_bf16_cpuoffload_all.json",
                                auto_values=TRAINING_ARGS)
    why = reasons(config)
    assert "one sub-group per parameter" in why["zero_optimization.sub_group_size"]
    assert config.offload.optimizer.chunk_numel is None  # the default
    assert (config.zero.max_live_bytes, config.zero.max_reuse_distance_bytes) == (0, 0)
    assert config.precision.dtype == "bf16"  # "enabled": true, whatever the Trainer says
    assert config.offload.params.device == config.offload.optimizer.device == "cpu"
    assert config.zero.overlap_comm is True
    # fp16 is off (auto -> false): its scaling keys are unused, as in DeepSpeed
    plain = engine.load_config(FIXTURES / "axolotl_zero3.json", auto_values=TRAINING_ARGS)
    assert reasons(plain)["fp16.initial_scale_power"] == "unused: fp16.enabled is false"
    assert plain.precision.dtype == "fp32"


def test_fp16_scaling_keys_used_when_fp16_is_on() -> None:
    config = engine.load_config(FIXTURES / "axolotl_zero3.json",
                                auto_values={**TRAINING_ARGS, "fp16": True})
    ls = config.precision.loss_scale
    assert (config.precision.dtype, ls.value, ls.initial_scale_power, ls.growth_interval) == (
        "fp16", 0.0, 32, 1000)
    assert (ls.hysteresis, ls.min_scale) == (2, 1.0)


def test_llamafactory_z3_values() -> None:
    config = engine.load_config(FIXTURES / "llamafactory_ds_z3_config.json",
                                auto_values=TRAINING_ARGS)
    assert config.offload.optimizer.chunk_numel == 10**9  # sub_group_size 1e9
    assert config.zero.max_live_bytes == 4 * 10**9  # 1e9 fp32 elements
    assert config.zero.overlap_comm is False


def test_transformers_docs_nvme_and_unfilled_autos(nvme_dir: Path) -> None:
    config = engine.load_config(FIXTURES / "transformers_zero3_nvme.json",
                                auto_values=TRAINING_ARGS)
    p = config.offload.params
    assert (p.device, p.path, p.buffer_count, p.buffer_bytes) == (
        "nvme", str(nvme_dir), 5, 4 * 10**8)
    assert config.nvme.block_size == 262144
    # text-generation-webui: "auto" where the HF integration fills nothing is dropped by
    # DeepSpeed's config models (the key's default): here as if left out, tierzero's default
    webui = engine.load_config(FIXTURES / "textgen_webui_zero3_nvme.json")
    assert webui.zero.max_live_bytes is None and webui.zero.max_reuse_distance_bytes is None
    assert "zero_optimization.stage3_max_live_parameters" in webui.ignored_keys


def test_aio_nested_in_zero_optimization_is_refused_with_the_fix() -> None:
    """The transformers guide's NVMe example nests aio in zero_optimization; DeepSpeed's
    ZeRO config model forbids unknown keys, so DeepSpeed refuses it too."""
    with pytest.raises(engine.ConfigError, match=r"zero_optimization\.aio: unknown DeepSpeed "
                                                 r"key; aio is a top-level section"):
        engine.load_config(ds(zero_optimization={"stage": 3, "aio": {"block_size": 262144}}))


# (DeepSpeed config, native field read through a dotted path, expected value)
ACCEPTED = [
    # element counts: 0, integral floats and their strings
    (ds(zero_optimization={"stage": 3, "reduce_bucket_size": 0}), "zero.reduce_bucket_bytes", 0),
    (ds(zero_optimization={"stage": 3, "stage3_prefetch_bucket_size": "5e7"}),
     "zero.prefetch_bytes", 2 * 10**8),
    (ds(zero_optimization={"stage": 3, "sub_group_size": 1e9}),
     "offload.optimizer.chunk_numel", 10**9),
    (ds(zero_optimization={"stage": 3, "sub_group_size": "1000"}),
     "offload.optimizer.chunk_numel", 1000),
    (ds(zero_optimization={"stage": 3, "sub_group_size": 0}),
     "offload.optimizer.chunk_numel", None),
    # overlap_comm: null is DeepSpeed's default, on at stage 3 only
    (ds(zero_optimization={"stage": 3, "overlap_comm": None}), "zero.overlap_comm", True),
    (ds(zero_optimization={"stage": 2, "overlap_comm": None}), "zero.overlap_comm", False),
    # booleans as DeepSpeed's config models read them
    (ds(zero_optimization={"stage": 3, "overlap_comm": "no"}), "zero.overlap_comm", False),
    (ds(zero_optimization={"stage": 3, "overlap_comm": 0}), "zero.overlap_comm", False),
    (ds(bf16={"enabled": "True"}), "precision.dtype", "bf16"),
    (ds(fp16={"enabled": "on"}), "precision.dtype", "fp16"),
    (ds(fp16={"enabled": 1}), "precision.dtype", "fp16"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"device": "cpu", "pin_memory": "off"}}),
     "offload.params.pin_memory", False),
    (ds(activation_checkpointing={"cpu_checkpointing": "yes"}), "activations.cpu_offload",
     True),
    (ds(wall_clock_breakdown="1"), "logging.wall_clock_breakdown", True),
    # "auto" the HF integration does not fill, inside zero_optimization: DeepSpeed drops it
    # (its default), here the key as if left out (tierzero's default)
    (ds(zero_optimization={"stage": 3, "stage3_max_live_parameters": "auto"}),
     "zero.max_live_bytes", None),
    (ds(zero_optimization={"stage": 3, "sub_group_size": "auto"}),
     "offload.optimizer.chunk_numel", None),
    (ds(zero_optimization={"stage": "auto"}), "zero.stage", 0),
    # the deprecated boolean form of zero_optimization
    (ds(zero_optimization=True), "zero.stage", 1),
    (ds(zero_optimization=False), "zero.stage", 0),
    # fp16 scaling keys DeepSpeed checks only while used
    (ds(fp16={"enabled": False, "loss_scale_window": 0, "min_loss_scale": 0}),
     "precision.loss_scale.growth_interval", 1000),
    (ds(fp16={"enabled": True, "loss_scale": 128, "hysteresis": 0}),
     "precision.loss_scale.value", 128.0),
    # swap-buffer sizes of a cpu offload: DeepSpeed uses them with nvme only
    (ds(zero_optimization={"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 0,
                                                         "buffer_size": 0}}),
     "offload.params.buffer_count", 5),
    # warm-up: DeepSpeed's schedulers warm up over max(2, warmup_num_steps) steps
    (ds(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 1}}),
     "scheduler.warmup_steps", 2),
    (ds(scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 0,
                                                       "total_num_steps": 10}}),
     "scheduler.warmup_steps", 2),
    (ds(scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 0,
                                                       "total_num_steps": 1}}),
     "scheduler.warmup_steps", 1),
    (ds(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cosine"}}),
     "scheduler.warmup_shape", "log"),
    (ds(steps_per_print=None), "logging.steps_per_print", 10),
]


@pytest.mark.parametrize(("data", "path", "expected"), ACCEPTED)
def test_values_deepspeed_accepts(data: dict[str, Any], path: str, expected: Any) -> None:
    value: Any = engine.load_config(data)
    for part in path.split("."):
        value = getattr(value, part)
    assert value == expected


@pytest.mark.parametrize(("data", "key", "reason"), [
    (ds(zero_optimization={"stage": 3, "sub_group_size": 0}), "zero_optimization.sub_group_size",
     "one sub-group per parameter"),
    (ds(zero_optimization={"stage": 3, "stage3_max_live_parameters": "auto"}),
     "zero_optimization.stage3_max_live_parameters", "takes the key's default"),
    (ds(fp16={"enabled": False, "loss_scale_window": 0}), "fp16.loss_scale_window",
     "unused: fp16.enabled is false"),
    (ds(fp16={"enabled": True, "loss_scale": 128, "hysteresis": 0}), "fp16.hysteresis",
     "unused: fp16.loss_scale is static"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 0}}),
     "zero_optimization.offload_param.buffer_count", "unused: device is cpu"),
    (ds(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cosine"}}),
     "scheduler.params.warmup_type", "log curve"),
    (ds(steps_per_print=None), "steps_per_print", "DeepSpeed prints no step lines"),
    (ds(compile={"disable": False, "backend": "inductor"}), "compile", "does not compile"),
    (ds(tensor_parallel={"autotp_size": 2}), "tensor_parallel", "not supported"),
])
def test_values_reported_with_the_reason(data: dict[str, Any], key: str, reason: str) -> None:
    assert reason in reasons(engine.load_config(data))[key]


@pytest.mark.parametrize(("data", "start"), [
    # values DeepSpeed refuses stay errors that name the key
    (ds(zero_optimization={"stage": 3, "sub_group_size": -1}),
     "zero_optimization.sub_group_size: -1 is out of range"),
    (ds(zero_optimization={"stage": 3, "overlap_comm": "sometimes"}),
     "zero_optimization.overlap_comm: 'sometimes' is not allowed; allowed: true or false"),
    (ds(fp16={"enabled": 2}), "fp16.enabled: 2 is not allowed; allowed: true or false"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"device": "cpu", "buffer_count": -1}}),
     "zero_optimization.offload_param.buffer_count: -1 is out of range"),
    (ds(zero_optimization=3), "zero_optimization: 3 is not allowed; allowed: a JSON object"),
    (ds(steps_per_print="auto"), "steps_per_print: 'auto' is not allowed here"),
])
def test_values_deepspeed_refuses(data: dict[str, Any], start: str) -> None:
    with pytest.raises(engine.ConfigError) as err:
        engine.load_config(data)
    assert str(err.value).startswith(start)
