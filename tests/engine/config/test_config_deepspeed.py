"""DeepSpeed JSON -> Config: stages, offload, precision, "auto", string numbers, legacy keys."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tierzero import engine


def ds(**sections: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, **sections}


def error_of(data: Any, **kwargs: Any) -> str:
    with pytest.raises(engine.ConfigError) as err:
        engine.load_config(data, **kwargs)
    return str(err.value)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stages(stage: int) -> None:
    config = engine.load_config(ds(zero_optimization={"stage": stage}))
    assert config.source == "deepspeed"
    assert config.zero.stage == stage
    assert config.zero.overlap_comm is (stage == 3)  # DeepSpeed's default


def test_no_zero_section_is_stage_0_fp32() -> None:
    config = engine.load_config({"train_batch_size": 8})
    assert config.zero.stage == 0
    assert config.precision.dtype == "fp32"
    assert config.batch.global_batch_size == 8


def test_stage3_cpu_offload_and_element_counts_bf16() -> None:
    # DeepSpeed counts these in elements; bf16 elements are 2 bytes.
    config = engine.load_config(ds(
        bf16={"enabled": True},
        zero_optimization={
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": False, "buffer_count": 6,
                              "buffer_size": 1e8, "max_in_cpu": "1e9"},
            "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.3},
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": "1e5",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 0,
            "reduce_bucket_size": 5e8,
            "overlap_comm": False,
            "stage3_gather_16bit_weights_on_model_save": True,
        }))
    p, o, z = config.offload.params, config.offload.optimizer, config.zero
    assert (p.device, p.pin_memory) == ("cpu", False)
    assert (o.device, o.pin_memory) == ("cpu", True)
    assert (z.prefetch_bytes, z.persistence_threshold_bytes) == (10**8, 2 * 10**5)
    assert (z.max_live_bytes, z.max_reuse_distance_bytes) == (2 * 10**9, 0)
    assert z.reduce_bucket_bytes == 10**9
    assert z.overlap_comm is False
    # accepted, not acted on (issue 19): partial offload, the gather-on-save switch; and
    # the swap-buffer sizes, which DeepSpeed uses with nvme only (issue 32)
    assert config.ignored_keys == (
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.offload_param.buffer_count",
        "zero_optimization.offload_param.buffer_size",
        "zero_optimization.offload_param.max_in_cpu",
        "zero_optimization.offload_optimizer.ratio")


def test_element_counts_fp32_are_4_bytes() -> None:
    config = engine.load_config(ds(zero_optimization={"stage": 3, "prefetch_bucket_size": 1000}))
    assert config.precision.dtype == "fp32"
    assert config.zero.prefetch_bytes == 4000


def test_stage3_nvme_offload(tmp_path: Path) -> None:
    config = engine.load_config(ds(zero_optimization={
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 6,
                          "buffer_size": 1e8, "max_in_cpu": "1e9"},
        "offload_optimizer": {"device": "NVMe", "nvme_path": str(tmp_path),
                              "pipeline_read": True, "pipeline_write": False},
    }, aio={"block_size": 262144, "queue_depth": 16, "thread_count": 2,
            "single_submit": False, "overlap_events": True}, bf16={"enabled": True}))
    assert config.offload.params.device == config.offload.optimizer.device == "nvme"
    p = config.offload.params  # element counts of bf16: 2 bytes each
    assert (p.buffer_count, p.buffer_bytes, p.max_in_cpu_bytes) == (6, 2 * 10**8, 2 * 10**9)
    assert config.offload.params.path == config.offload.optimizer.path == str(tmp_path)
    assert (config.nvme.block_size, config.nvme.queue_depth, config.nvme.threads) == (
        262144, 16, 2)
    # the streamed step always reads ahead and writes behind: the switches are reported
    assert config.ignored_keys == ("zero_optimization.offload_optimizer.pipeline_read",
                                   "zero_optimization.offload_optimizer.pipeline_write",
                                   "aio.single_submit", "aio.overlap_events")


def test_nvme_path_next_to_cpu_is_legal_and_unused() -> None:
    config = engine.load_config(ds(zero_optimization={
        "stage": 3, "offload_optimizer": {"device": "cpu", "nvme_path": "/does/not/exist"}}))
    assert config.offload.optimizer.path is None
    assert "zero_optimization.offload_optimizer.nvme_path" in config.ignored_keys


def test_offload_param_below_stage3_is_reported_not_fatal() -> None:
    config = engine.load_config(ds(zero_optimization={
        "stage": 2, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}))
    assert config.offload.params.device == "none"
    assert config.offload.optimizer.device == "cpu"
    assert "zero_optimization.offload_param" in config.ignored_keys


def test_fp16_loss_scale() -> None:
    config = engine.load_config(ds(fp16={"enabled": True, "loss_scale": 0, "loss_scale_window": 500,
                                         "initial_scale_power": 12, "hysteresis": 3,
                                         "consecutive_hysteresis": True, "min_loss_scale": 0.25}))
    ls = config.precision.loss_scale
    assert config.precision.dtype == "fp16"
    assert (ls.value, ls.growth_interval, ls.initial_scale_power, ls.hysteresis) == (
        0.0, 500, 12, 3)
    assert (ls.consecutive_hysteresis, ls.min_scale) == (True, 0.25)
    static = engine.load_config(ds(fp16={"enabled": "true", "loss_scale": 1024}))
    assert static.precision.loss_scale.value == 1024.0


@pytest.mark.parametrize("section", ["bf16", "bfloat16"])
def test_bf16_and_legacy_bfloat16(section: str) -> None:
    config = engine.load_config(ds(**{section: {"enabled": True}}))
    assert config.precision.dtype == "bf16"


def test_fp16_and_bf16_together() -> None:
    msg = error_of(ds(fp16={"enabled": True}, bf16={"enabled": True}))
    assert msg.startswith("fp16.enabled: true together with bf16.enabled true")


def test_string_numbers_and_float_integers() -> None:
    config = engine.load_config({
        "train_batch_size": "32", "train_micro_batch_size_per_gpu": 4.0,
        "gradient_accumulation_steps": "2", "gradient_clipping": "1.0",
        "zero_optimization": {"stage": "3", "reduce_bucket_size": "5e8"},
        "optimizer": {"type": "AdamW", "params": {"lr": "3e-5", "weight_decay": "0.1"}},
    })
    assert (config.batch.global_batch_size, config.batch.micro_batch_size,
            config.batch.gradient_accumulation_steps) == (32, 4, 2)
    assert config.gradient_clipping == 1.0
    assert config.zero.stage == 3
    assert config.zero.reduce_bucket_bytes == 4 * 5 * 10**8
    assert (config.optimizer.lr, config.optimizer.weight_decay) == (3e-5, 0.1)


def test_legacy_cpu_offload_flags() -> None:
    config = engine.load_config(ds(zero_optimization={
        "stage": 3, "cpu_offload": True, "cpu_offload_params": True,
        "cpu_offload_use_pin_memory": False}))
    assert config.offload.params.device == "cpu"
    assert config.offload.optimizer.device == "cpu"
    assert config.offload.params.pin_memory is False
    assert config.offload.optimizer.pin_memory is False
    singular = engine.load_config(ds(zero_optimization={"stage": 3, "cpu_offload_param": True}))
    assert singular.offload.params.device == "cpu"
    off = engine.load_config(ds(zero_optimization={"stage": 2, "cpu_offload": False}))
    assert off.offload.optimizer.device == "none"


def test_legacy_and_current_offload_together() -> None:
    msg = error_of(ds(zero_optimization={"stage": 3, "cpu_offload": True,
                                         "offload_optimizer": {"device": "cpu"}}))
    assert msg.startswith("zero_optimization.cpu_offload: true conflicts with "
                          "zero_optimization.offload_optimizer")


@pytest.mark.parametrize("key", ["stage3_gather_16bit_weights_on_model_save",
                                 "stage3_gather_fp16_weights_on_model_save",
                                 "gather_16bit_weights_on_model_save"])
def test_gather_on_save_spellings(key: str) -> None:
    """Accepted under every spelling and reported as not acted on, with the reason."""
    config = engine.load_config(ds(zero_optimization={"stage": 3, key: True}))
    assert config.ignored_keys == (f"zero_optimization.{key}",)
    assert "checkpoints stay sharded" in config.ignored_reasons[0]


@pytest.mark.parametrize(("prefixed", "plain", "native"), [
    ("stage3_prefetch_bucket_size", "prefetch_bucket_size", "prefetch_bytes"),
    ("stage3_param_persistence_threshold", "param_persistence_threshold",
     "persistence_threshold_bytes"),
    ("stage3_max_live_parameters", "max_live_parameters", "max_live_bytes"),
    ("stage3_max_reuse_distance", "max_reuse_distance", "max_reuse_distance_bytes"),
])
def test_unprefixed_stage3_keys(prefixed: str, plain: str, native: str) -> None:
    for key in (prefixed, plain):
        config = engine.load_config(ds(zero_optimization={"stage": 3, key: 1234}))
        assert getattr(config.zero, native) == 4 * 1234
    same = engine.load_config(ds(zero_optimization={"stage": 3, prefixed: 10, plain: 10}))
    assert getattr(same.zero, native) == 40
    msg = error_of(ds(zero_optimization={"stage": 3, prefixed: 10, plain: 20}))
    assert "(two spellings of one key); keep one" in msg


def test_aio_thread_count_new_name() -> None:
    config = engine.load_config(ds(aio={"intra_op_parallelism": 3}))
    assert config.nvme.threads == 3


@pytest.mark.parametrize(("name", "w_mode", "expected"), [
    ("AdamW", None, "adamw"), ("adamw", None, "adamw"), ("ADAM", None, "adamw"),
    ("Adam", False, "adam"), ("Adam", True, "adamw"),
])
def test_optimizer_type_any_case_and_adam_w_mode(name: str, w_mode: bool | None,
                                                 expected: str) -> None:
    params: dict[str, Any] = {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    if w_mode is not None:
        params["adam_w_mode"] = w_mode
    config = engine.load_config(ds(optimizer={"type": name, "params": params}))
    opt = config.optimizer
    assert (opt.type, opt.lr, opt.betas, opt.eps, opt.weight_decay) == (
        expected, 1e-4, (0.9, 0.95), 1e-6, 0.1)


def test_warmup_lr_and_decay() -> None:
    config = engine.load_config(ds(
        optimizer={"type": "AdamW", "params": {"lr": 1e-4}},
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-6, "warmup_max_lr": 1e-4,
                                                 "warmup_num_steps": 100,
                                                 "warmup_type": "linear"}}))
    s = config.scheduler
    assert (s.type, s.warmup_steps, s.warmup_start_lr, s.warmup_shape) == (
        "constant", 100, 1e-6, "linear")
    decay = engine.load_config(ds(scheduler={"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 3e-4, "total_num_steps": 5000}}))
    d = decay.scheduler
    assert (d.type, d.total_steps, d.min_lr) == ("warmup_linear", 5000, 0.0)
    assert (d.warmup_steps, d.warmup_shape) == (1000, "log")  # DeepSpeed's defaults
    assert decay.optimizer.lr == 3e-4  # the scheduler's peak is the lr, as in DeepSpeed


def test_warmup_max_lr_overrides_optimizer_lr(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = engine.load_config(ds(
            optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
            scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 2e-4}}))
    assert config.optimizer.lr == 2e-4
    assert "warmup_max_lr (0.0002) overrides optimizer.params.lr (0.001)" in caplog.text


def test_warmup_cosine_ratios_become_lrs() -> None:
    config = engine.load_config(ds(
        optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
        scheduler={"type": "WarmupCosineLR", "params": {
            "total_num_steps": 500, "warmup_num_steps": 50, "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.01}}))
    s = config.scheduler
    assert (s.type, s.total_steps, s.warmup_steps) == ("warmup_cosine", 500, 50)
    assert s.warmup_start_lr == pytest.approx(1e-4, rel=1e-12)  # 0.1 x lr
    assert s.min_lr == pytest.approx(1e-5, rel=1e-12)  # 0.01 x lr


HF_STYLE = {
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
}


def test_auto_from_training_arguments() -> None:
    config = engine.load_config(HF_STYLE, auto_values={
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 8, "world_size": 2,
        "learning_rate": 2e-5, "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6,
        "weight_decay": 0.05, "max_grad_norm": 0.5, "max_steps": 1000, "warmup_ratio": 0.1,
        "bf16": True, "hidden_size": 1000})
    assert config.precision.dtype == "bf16"
    opt = config.optimizer
    assert (opt.lr, opt.betas, opt.eps, opt.weight_decay) == (2e-5, (0.8, 0.95), 1e-6, 0.05)
    s = config.scheduler
    assert (s.warmup_start_lr, s.warmup_steps, s.total_steps) == (0.0, 100, 1000)
    assert (config.batch.micro_batch_size, config.batch.gradient_accumulation_steps,
            config.batch.global_batch_size) == (4, 8, 64)
    assert config.gradient_clipping == 0.5
    # hidden_size rules (HF): bucket h*h, prefetch 0.9*h*h, persistence 10*h elements x 2 bytes
    assert config.zero.reduce_bucket_bytes == 2 * 1000 * 1000
    assert config.zero.prefetch_bytes == 2 * 900_000
    assert config.zero.persistence_threshold_bytes == 2 * 10_000


def test_auto_documented_defaults() -> None:
    config = engine.load_config(HF_STYLE, auto_values={"max_steps": 10})
    assert config.precision.dtype == "fp32"  # TrainingArguments fp16/bf16 default False
    assert config.optimizer.lr == 5e-5
    assert config.optimizer.betas == (0.9, 0.999)
    assert config.batch.micro_batch_size == 8
    assert config.batch.global_batch_size is None  # no world size: checked at initialize
    assert config.gradient_clipping == 1.0
    # warmup_steps 0 -> warmup_num_steps 0, which DeepSpeed's schedulers clamp to 2 steps
    assert config.scheduler.warmup_steps == 2
    assert config.zero.reduce_bucket_bytes == 4 * 5 * 10**8  # DeepSpeed defaults, fp32
    assert config.zero.prefetch_bytes == 4 * 5 * 10**7
    assert config.zero.persistence_threshold_bytes == 4 * 10**5


def test_auto_total_steps_waits_for_the_run_length() -> None:
    """Without max_steps, "auto" run lengths load and wait ([Note: auto run length]);
    initialize refuses them still unknown, naming the DeepSpeed key (before: a load error)."""
    config = engine.load_config(HF_STYLE)
    assert config.run_length_auto == (("scheduler.params.total_num_steps", 1.0),)
    assert config.scheduler.total_steps is None
    filled = config.with_run_length(120)
    assert (filled.scheduler.total_steps, filled.run_length_auto) == (120, ())
    assert filled.with_run_length(7) == filled  # nothing waits any more
    with pytest.raises(engine.ConfigError) as err:
        engine.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert str(err.value).startswith("scheduler.params.total_num_steps: 'auto' needs the run "
                                     "length, which is still unknown")
    with pytest.raises(engine.ConfigError, match=r"total_num_steps: 'auto' resolved with run "
                                                 r"length 0; allowed: an int >= 1"):
        config.with_run_length(0)


def test_auto_warmup_ratio_waits_for_the_run_length() -> None:
    # TrainingArguments: warmup steps = ceil(warmup_ratio x run length)
    config = engine.load_config(HF_STYLE, auto_values={"warmup_ratio": 0.1})
    assert dict(config.run_length_auto) == {"scheduler.params.total_num_steps": 1.0,
                                            "scheduler.params.warmup_num_steps": 0.1}
    s = config.with_run_length(55).scheduler
    assert (s.warmup_steps, s.total_steps) == (6, 55)
    known = engine.load_config(HF_STYLE, auto_values={"warmup_ratio": 0.1, "max_steps": 55})
    assert known.scheduler == s and known.run_length_auto == ()


@pytest.mark.parametrize("key", ["stage3_gather_16bit_weights_on_model_save",
                                 "stage3_gather_fp16_weights_on_model_save",
                                 "gather_16bit_weights_on_model_save"])
def test_auto_gather_16bit_is_accelerates_default(key: str) -> None:
    """"auto" resolves (to accelerate's default) and the key is then reported as ignored."""
    config = engine.load_config(ds(zero_optimization={"stage": 3, key: "auto"}))
    assert config.ignored_keys == (f"zero_optimization.{key}",)


def test_zero_bucket_sizes() -> None:
    """DeepSpeed takes 0 for its stage-3 sizes: reduce_bucket_size 0 reduces every gradient
    on its own (one reduction in flight), prefetch 0 fetches nothing ahead, and so on."""
    config = engine.load_config(ds(zero_optimization={
        "stage": 3, "reduce_bucket_size": 0, "stage3_prefetch_bucket_size": 0,
        "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
        "stage3_max_reuse_distance": 0, "allgather_bucket_size": 0}))
    z = config.zero
    assert (z.reduce_bucket_bytes, z.prefetch_bytes, z.persistence_threshold_bytes,
            z.max_live_bytes, z.max_reuse_distance_bytes) == (0, 0, 0, 0, 0)
    assert "zero_optimization.allgather_bucket_size" in config.ignored_keys


def test_auto_where_not_allowed() -> None:
    msg = error_of(ds(steps_per_print="auto"))
    assert msg.startswith("steps_per_print: 'auto' is not allowed here; 'auto' is "
                          "allowed only at: train_micro_batch_size_per_gpu,")
    assert "and (meaning DeepSpeed's default) at any key of zero_optimization," in msg
    assert error_of(ds(aio={"block_size": "auto"})).startswith("aio.block_size: 'auto'")


def test_unknown_auto_value_name() -> None:
    msg = error_of(HF_STYLE, auto_values={"learning_rte": 1e-4})
    assert msg.startswith("auto_values.learning_rte: unknown name (did you mean "
                          "'learning_rate'?)")


def test_ignored_keys_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = engine.load_config(ds(
            tensorboard={"enabled": True}, flops_profiler={"enabled": False},
            comms_logger={"enabled": False}, wall_clock_breakdown=True, steps_per_print=50,
            zero_optimization={"stage": 3, "sub_group_size": 1e9, "contiguous_gradients": True},
            my_own_key=1))
    assert config.ignored_keys == (  # in the order written
        "zero_optimization.contiguous_gradients",
        "tensorboard", "flops_profiler", "comms_logger", "my_own_key")
    # sub_group_size is acted on: the CPU Adam's piece size, in elements
    assert config.offload.optimizer.chunk_numel == 10**9
    assert len(config.ignored_reasons) == len(config.ignored_keys)
    assert config.logging.wall_clock_breakdown is True
    assert config.logging.steps_per_print == 50
    reports = [r for r in caplog.records if "not acted on" in r.getMessage()]
    assert len(reports) == 1
    for key in config.ignored_keys:
        assert key in reports[0].getMessage()


def test_unknown_top_level_key_gets_suggestion() -> None:
    config = engine.load_config(ds(gradient_clippin=1.0))
    i = config.ignored_keys.index("gradient_clippin")
    assert "did you mean 'gradient_clipping'?" in config.ignored_reasons[i]


@pytest.mark.parametrize(("data", "start"), [
    (ds(zero_optimization={"stage": 3, "stage3_prefech_bucket_size": 1}),
     "zero_optimization.stage3_prefech_bucket_size: unknown DeepSpeed key (did you mean "
     "'stage3_prefetch_bucket_size'?)"),
    (ds(zero_optimization={"stage": 4}),
     "zero_optimization.stage: 4 is out of range; allowed: an integer >= 0 and <= 3 "
     "(as tierzero's zero.stage)"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"device": "disk"}}),
     "zero_optimization.offload_param.device: 'disk' is not allowed; allowed: none, cpu, nvme"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}),
     "zero_optimization.offload_param.nvme_path: required when offload.params.device is 'nvme'"),
    (ds(zero_optimization={"stage": 3, "stage3_max_live_parameters": -5}),
     "zero_optimization.stage3_max_live_parameters: -5 is out of range"),
    (ds(optimizer={"type": "Lamb", "params": {"lr": 1e-3}}),
     "optimizer.type: 'Lamb' is not supported; allowed: Adam, AdamW (any case)"),
    (ds(optimizer={"type": "AdamW", "params": {"lr": -1}}),
     "optimizer.params.lr: -1.0 is out of range; allowed: a number > 0"),
    (ds(optimizer={"type": "AdamW", "params": {"amsgrad": True}}),
     "optimizer.params.amsgrad: True is not supported (AMSGrad is not implemented)"),
    (ds(optimizer={"type": "AdamW", "params": {"bias_correction": False}}),
     "optimizer.params.bias_correction: False is not supported"),
    (ds(optimizer={"type": "AdamW", "params": {"momentum": 0.9}}),
     "optimizer.params.momentum: unknown DeepSpeed key"),
    (ds(scheduler={"type": "OneCycle", "params": {}}),
     "scheduler.type: 'OneCycle' is not supported; allowed: WarmupLR, WarmupDecayLR, "
     "WarmupCosineLR"),
    (ds(amp={"enabled": True}), "amp.enabled: true is not supported (apex AMP)"),
    (ds(fp16={"enabled": True, "loss_scael": 0}),
     "fp16.loss_scael: unknown DeepSpeed key (did you mean 'loss_scale'?)"),
    (ds(zero_optimization=3), "zero_optimization: 3 is not allowed; allowed: a JSON object"),
    ({"zero_optimization": {"stage": 3}, "precision": "bf16"},
     "precision: is a native tierzero key in a DeepSpeed config"),
    (ds(train_batch_size=10, train_micro_batch_size_per_gpu=4),
     "train_batch_size: 10 is not a multiple of micro_batch_size"),
])
def test_deepspeed_errors_name_the_deepspeed_key(data: Any, start: str) -> None:
    assert error_of(data).startswith(start)


def test_detected_by_content_not_extension(tmp_path: Path) -> None:
    ds_as_yaml = tmp_path / "ds.yaml"
    ds_as_yaml.write_text(json.dumps(ds(zero_optimization={"stage": 2})))
    assert engine.load_config(ds_as_yaml).source == "deepspeed"
    native_as_json = tmp_path / "native.json"
    native_as_json.write_text(json.dumps({"zero": {"stage": 1}, "optimizer": {"lr": 1e-4}}))
    config = engine.load_config(native_as_json)
    assert (config.source, config.zero.stage) == ("native", 1)


def test_older_offload_spellings(tmp_path: Path) -> None:
    config = engine.load_config(ds(bf16={"enabled": True}, zero_optimization={
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "pipeline": True,
                              "pipeline_write": False, "buffer_size": 1000,
                              "max_in_nvme": 1e9}}))
    opt = config.offload.optimizer
    assert opt.buffer_bytes == 4000  # fp32 optimizer state, 4 bytes per element
    assert "zero_optimization.offload_optimizer.max_in_nvme" in config.ignored_keys
    assert "zero_optimization.offload_optimizer.pipeline" in config.ignored_keys


def test_reported_sub_keys() -> None:
    config = engine.load_config(ds(
        fp16={"enabled": True, "auto_cast": False},
        optimizer={"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 1e-4,
                                                 "last_batch_iteration": 10}},
        aio={"use_gds": False}))
    for key in ("fp16.auto_cast", "optimizer.params.torch_adam",
                "scheduler.params.last_batch_iteration", "aio.use_gds"):
        assert key in config.ignored_keys
    bf16 = engine.load_config(ds(bf16={"enabled": True, "immediate_grad_update": True}))
    assert bf16.ignored_keys == ("bf16.immediate_grad_update",)


def test_default_last_batch_iteration_is_not_reported() -> None:
    config = engine.load_config(ds(scheduler={"type": "WarmupLR", "params": {
        "last_batch_iteration": -1}}))
    assert config.ignored_keys == ()


@pytest.mark.parametrize(("data", "start"), [
    (ds(aio={"thread_count": 2, "intra_op_parallelism": 4}),
     "aio.thread_count: 2 conflicts with aio.intra_op_parallelism = 4"),
    (ds(zero_optimization={"stage": 3, "offload_param": "cpu"}),
     "zero_optimization.offload_param: 'cpu' is not allowed; allowed: a JSON object or null"),
    (ds(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme",
                                                             "nvme_path": "/no/such/dir"}}),
     "zero_optimization.offload_optimizer.nvme_path: '/no/such/dir' does not exist"),
    (ds(zero_optimization={"stage": 3, "overlap_comm": "often"}),
     "zero_optimization.overlap_comm: 'often' is not allowed; allowed: true or false"),
    (ds(optimizer=["AdamW"]), "optimizer: ['AdamW'] is not allowed; allowed: a JSON object"),
    (ds(amp={"enabled": "true"}), "amp.enabled: true is not supported"),
])
def test_more_deepspeed_errors(data: Any, start: str) -> None:
    assert error_of(data).startswith(start)


def test_null_offload_sections_mean_none() -> None:
    config = engine.load_config(ds(zero_optimization={"stage": 3, "offload_param": None,
                                                      "offload_optimizer": None}))
    assert config.offload.params.device == config.offload.optimizer.device == "none"
    assert engine.load_config(ds(amp={"enabled": "false"})).ignored_keys == ("amp",)
