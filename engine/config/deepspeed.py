"""DeepSpeed JSON -> native config mapping, done once at the boundary.

DeepSpeed's legacy spellings and aliases are accepted here and only here
(`cpu_offload`, `cpu_offload_param(s)`, `cpu_offload_use_pin_memory`, a
`bfloat16` section, `stage3_*` / unprefixed / `fp16`-named stage-3 keys,
`aio.thread_count`); the native schema has one name per knob.

[Note: DeepSpeed element counts] DeepSpeed sizes the stage-3 buckets and
thresholds (`stage3_prefetch_bucket_size`, `..._param_persistence_threshold`,
`..._max_live_parameters`, `..._max_reuse_distance`, `reduce_bucket_size`,
`offload_param.buffer_size`, `offload_param.max_in_cpu`) in *elements* of the
compute dtype. tierzero sizes them in bytes, so they are multiplied here by
the compute dtype's size (2 for fp16/bf16, 4 for fp32), and nowhere else.
`aio.block_size` is already in bytes.

Keys DeepSpeed knows but tierzero does not act on are collected (dotted
paths) and reported once; unknown keys inside a section we map are errors
(DeepSpeed itself rejects them), with a did-you-mean.

[Note: DeepSpeed's values] Every value DeepSpeed's config parsing takes
(deepspeed/runtime/zero/config.py, offload_config.py, precision_config.py,
lr_schedules.py) loads here with DeepSpeed's meaning, or is reported as not
acted on with the reason: 0 for the stage-3 element counts and for
sub_group_size, null for overlap_comm (DeepSpeed's default: on at stage 3),
the strings and numbers its models read as booleans (ds_common.ds_bool), an
"auto" the HF integration does not fill inside a section DeepSpeed parses with
its config models (DeepSpeed drops it: the key as if left out, which here means
tierzero's default; hf_auto.DEFAULTED_SECTIONS), fp16
scaling keys while fp16 or dynamic scaling is off (DeepSpeed checks them only
when used), swap-buffer sizes of a cpu offload (used with nvme only), the
deprecated boolean `zero_optimization`, and warm-up lengths below 2 (DeepSpeed
warms up over max(2, warmup_num_steps) steps). Fixtures from the projects that
ship DeepSpeed configs are in tests/data/deepspeed_configs/.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierzero.engine.config import ds_offload, ds_optim, hf_auto, values
from tierzero.engine.config.ds_common import (
    Mapped,
    check_keys,
    ds_bool,
    elements_to_bytes,
    section,
)
from tierzero.engine.config.errors import ConfigError

# Top-level keys that only a DeepSpeed config has (native files never use them).
MARKERS = frozenset({
    "zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps", "fp16", "bf16", "bfloat16", "aio", "amp",
    "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
    "activation_checkpointing",
})

# DeepSpeed keys accepted and reported, with why tierzero does not act on them.
IGNORED_TOP = {
    "tensorboard": "monitoring backend", "wandb": "monitoring backend",
    "csv_monitor": "monitoring backend", "comet": "monitoring backend",
    "flops_profiler": "profiler", "comms_logger": "profiler",
    "memory_breakdown": "see engine.memory_report()", "dump_state": "debug output",
    "prescale_gradients": "gradients are averaged once in fp32",
    "gradient_predivide_factor": "gradients are averaged once in fp32",
    "sparse_gradients": "not supported", "zero_allow_untested_optimizer": "only Adam(W)",
    "zero_force_ds_cpu_optimizer": "the CPU optimizer is always tierzero's",
    "communication_data_type": "communication uses the compute dtype",
    "checkpoint": "tierzero's checkpoint format", "data_types": "see precision.grad_dtype",
    "elasticity": "not supported", "autotuning": "not supported",
    "compression_training": "not supported", "data_efficiency": "not supported",
    "curriculum_learning": "not supported", "sparse_attention": "not supported",
    "pipeline": "not supported", "quantize_training": "not supported",
    "eigenvalue": "not supported", "progressive_layer_drop": "not supported",
    "timers": "see logging.wall_clock_breakdown", "disable_allgather": "not supported",
    "torch_autocast": "precision sets the compute dtype", "nebula": "not supported",
    "hybrid_engine": "not supported", "weight_quantization": "not supported",
    "load_universal_checkpoint": "tierzero's checkpoint format",
    "compile": "tierzero does not compile the model (DeepSpeed compiles on engine.compile())",
    "tensor_parallel": "tensor parallelism is not supported (data parallel ZeRO only)",
    "expert_parallel": "expert parallelism is not supported (data parallel ZeRO only)",
    "use_data_before_expert_parallelism": "expert parallelism is not supported",
    "seq_parallel_communication_data_type": "sequence parallelism is not supported",
    "gradient_allreduce_op": "gradients are averaged once in fp32",
    "managed_gradient_accumulation": "the engine counts micro-batches itself",
    "graph_harvesting": "not used", "log_level": "use Python logging (logger 'tierzero')",
    "dataloader_drop_last": "the data loader is the caller's",
    "allgather_size": "units are the gather grain",
    "datastates_ckpt": "tierzero's checkpoint format",
}
IGNORED_ZERO = {
    "contiguous_gradients": "gradients are flat shards by design", "reduce_scatter": "always on",
    "allgather_partitions": "always on", "allgather_bucket_size": "units are the gather grain",
    "use_multi_rank_bucket_allreduce": "not used",
    "load_from_fp32_weights": "always", "elastic_checkpoint": "not supported",
    "ignore_unused_parameters": "unused parameters are always allowed",
    "legacy_stage1": "not supported", "round_robin_gradients": "not used",
    "model_persistence_threshold": "not used", "memory_efficient_linear": "not used",
    "zero_hpz_partition_size": "not supported", "zero_quantized_weights": "not supported",
    "zero_quantized_nontrainable_weights": "not supported",
    "zero_quantized_gradients": "not supported", "zeropp_loco_param": "not supported",
    "mics_shard_size": "not supported", "mics_hierarchical_params_gather": "not supported",
    "pipeline_loading_checkpoint": "not used", "override_module_apply": "not used",
    "log_trace_cache_warnings": "order changes are always logged",
    "module_granularity_threshold": "units are set by zero.units / unit_min_bytes",
    "use_all_reduce_for_fetch_params": "not used", "allgather_sequential": "not used",
    "enable_sanity_checks": "not used", "leaf_module": "use zero.leaf_modules (class names)",
    "gather_16bit_weights_on_model_save": (
        "checkpoints stay sharded; whole weights are written by TierZeroTrainer.save_model, "
        "train.export or tierzero.engine.consolidate_to_safetensors whatever this says"),
    "zenflow": "not supported", "save_muon_momentum_buffer_in_memory": "only Adam(W)",
}
ZERO_ALIASES = {  # DeepSpeed spelling -> its canonical (unprefixed) name
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential": "allgather_sequential",
    "cpu_offload_params": "cpu_offload_param",
}
ZERO_ELEMENTS = {  # canonical DeepSpeed name -> native key, counted in elements
    "prefetch_bucket_size": "zero.prefetch_bytes",
    "param_persistence_threshold": "zero.persistence_threshold_bytes",
    "max_live_parameters": "zero.max_live_bytes",
    "max_reuse_distance": "zero.max_reuse_distance_bytes",
    "reduce_bucket_size": "zero.reduce_bucket_bytes",
}
ZERO_PLAIN = {
    "stage": "zero.stage", "overlap_comm": "zero.overlap_comm",
}
ZERO_STRUCT = ("offload_param", "offload_optimizer", "cpu_offload", "cpu_offload_param",
               "cpu_offload_use_pin_memory")


def is_deepspeed(data: Mapping[str, Any]) -> bool:
    """A DeepSpeed config, judged by its keys (not the file name)."""
    if any(k in MARKERS or k in IGNORED_TOP for k in data):
        return True
    return any(isinstance(data.get(k), Mapping) and "params" in data[k]
               for k in ("optimizer", "scheduler"))


def to_native(data: Mapping[str, Any], auto_values: Mapping[str, Any] | None) -> Mapped:
    """Map a DeepSpeed config to the native schema (values checked later by native.build)."""
    dropped: list[str] = []
    data = hf_auto.resolve(data, hf_auto.training_args(auto_values), dropped=dropped)
    out = Mapped()
    for key in dropped:
        out.ignore(key, "'auto' that the HF integration does not fill: DeepSpeed drops it and "
                   "takes the key's default; here the key is as if left out (tierzero's "
                   "default for it)")
    if isinstance(data.get("zero_optimization"), bool):
        # DeepSpeed's deprecated form: true is stage 1, false stage 0
        data = {**data, "zero_optimization": {"stage": 1 if data["zero_optimization"] else 0}}
    itemsize = _precision(data, out)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "train_batch_size"):
        if data.get(key) is not None:
            native = {"train_micro_batch_size_per_gpu": "batch.micro_batch_size",
                      "gradient_accumulation_steps": "batch.gradient_accumulation_steps",
                      "train_batch_size": "batch.global_batch_size"}[key]
            out.set(native, data[key], key)
    if "gradient_clipping" in data:
        out.set("gradient_clipping", data["gradient_clipping"], "gradient_clipping")
    if data.get("steps_per_print", 0) is None:  # DeepSpeed: null prints no step lines
        out.ignore("steps_per_print", "null: DeepSpeed prints no step lines; tierzero's step "
                   "log keeps logging.steps_per_print (default 10)")
    elif "steps_per_print" in data:
        out.set("logging.steps_per_print", data["steps_per_print"], "steps_per_print")
    if "wall_clock_breakdown" in data:
        out.set("logging.wall_clock_breakdown",
                ds_bool(data["wall_clock_breakdown"], "wall_clock_breakdown"),
                "wall_clock_breakdown")
    handled = {"fp16", "bf16", "bfloat16", "train_micro_batch_size_per_gpu",
               "gradient_accumulation_steps", "train_batch_size", "gradient_clipping",
               "steps_per_print", "wall_clock_breakdown", "zero_optimization", "aio",
               "optimizer", "scheduler", "amp", "activation_checkpointing"}
    _zero(section(data, "zero_optimization"), itemsize, out)
    _aio(section(data, "aio"), out)
    _activations(section(data, "activation_checkpointing"), out)
    ds_optim.map_optimizer(data.get("optimizer"), out)
    ds_optim.map_scheduler(data.get("scheduler"), out)
    amp = section(data, "amp")
    if ds_bool(amp.get("enabled", False), "amp.enabled"):
        raise ConfigError("amp.enabled", "true is not supported (apex AMP); use "
                          "\"bf16\": {\"enabled\": true} or \"fp16\": {\"enabled\": true}")
    if "amp" in data:
        out.ignore("amp", "disabled")
    for key in data:
        if key in handled:
            continue
        if key in IGNORED_TOP:
            out.ignore(key, IGNORED_TOP[key])
        else:
            known = list(handled | IGNORED_TOP.keys())
            out.ignore(key, "not a DeepSpeed key tierzero knows (DeepSpeed does not read "
                       "top-level keys it does not know either)" + values.did_you_mean(key, known))
    return out


def _precision(data: Mapping[str, Any], out: Mapped) -> int:
    fp16, bf16 = section(data, "fp16"), {**section(data, "bfloat16"), **section(data, "bf16")}
    bf16_key = "bf16" if "bf16" in data else "bfloat16"
    on16 = ds_bool(fp16.get("enabled", False), "fp16.enabled")
    onbf = ds_bool(bf16.get("enabled", False), f"{bf16_key}.enabled")
    if on16 and onbf:
        raise ConfigError("fp16.enabled", f"true together with {bf16_key}.enabled true; allowed: "
                          "at most one of them")
    dtype = "fp16" if on16 else "bf16" if onbf else "fp32"
    out.set("precision.dtype", dtype, "fp16.enabled" if on16 else f"{bf16_key}.enabled")
    check_keys(fp16, {"enabled", "auto_cast", "loss_scale", "initial_scale_power",
                      "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                      "min_loss_scale", "fp16_master_weights_and_grads"}, "fp16")
    _loss_scale(fp16, on16, out)
    if "auto_cast" in fp16:
        out.ignore("fp16.auto_cast", "inputs are not cast; modules run in precision.dtype")
    if "fp16_master_weights_and_grads" in fp16:
        out.ignore("fp16.fp16_master_weights_and_grads", "master weights are always fp32")
    check_keys(bf16, {"enabled", "immediate_grad_update", "check_grad_overflow",
                      "bf16_master_weights_and_grads", "bf16_optimizer_states"}, bf16_key)
    for ds in bf16:
        if ds != "enabled":
            out.ignore(f"{bf16_key}.{ds}", "master weights are fp32 unless "
                       "offload.optimizer.master_precision is bf16 (rounded stochastically); "
                       "gradients follow precision.grad_dtype")
    return 2 if dtype in ("fp16", "bf16") else 4


def _loss_scale(fp16: Mapping[str, Any], on: bool, out: Mapped) -> None:
    """fp16's scaling keys. DeepSpeed checks and uses them only while fp16 is on, the
    dynamic ones only with loss_scale 0 (dynamic scaling); otherwise they are reported."""
    static = "loss_scale" in fp16 and values.coerce(fp16["loss_scale"], float, {"ge": 0},
                                                    "fp16.loss_scale") > 0
    for ds, native in (("loss_scale", "value"), ("initial_scale_power", "initial_scale_power"),
                       ("loss_scale_window", "growth_interval"), ("hysteresis", "hysteresis"),
                       ("consecutive_hysteresis", "consecutive_hysteresis"),
                       ("min_loss_scale", "min_scale")):
        if ds not in fp16:
            continue
        if not on:
            out.ignore(f"fp16.{ds}", "unused: fp16.enabled is false")
        elif static and ds != "loss_scale":
            out.ignore(f"fp16.{ds}", "unused: fp16.loss_scale is static (> 0)")
        else:
            raw = fp16[ds]
            if ds == "consecutive_hysteresis":
                raw = ds_bool(raw, f"fp16.{ds}")
            out.set(f"precision.loss_scale.{native}", raw, f"fp16.{ds}")


def _zero(zero: Mapping[str, Any], itemsize: int, out: Mapped) -> None:
    canon: dict[str, tuple[str, Any]] = {}  # canonical name -> (key as written, value)
    known = set(ZERO_ALIASES) | set(ZERO_ELEMENTS) | set(ZERO_PLAIN) | set(ZERO_STRUCT) | set(
        IGNORED_ZERO) | {"sub_group_size"}
    if "aio" in zero:  # as transformers' DeepSpeed guide nests it
        raise ConfigError("zero_optimization.aio", "unknown DeepSpeed key; aio is a top-level "
                          "section (DeepSpeed refuses it here too): move it out of "
                          "zero_optimization")
    check_keys(zero, known, "zero_optimization")
    for key, value in zero.items():
        name = ZERO_ALIASES.get(key, key)
        if name in canon and canon[name][1] != value:
            raise ConfigError(f"zero_optimization.{key}",
                              f"{value!r} conflicts with zero_optimization.{canon[name][0]} = "
                              f"{canon[name][1]!r} (two spellings of one key); keep one")
        canon[name] = (key, value)
    for name, (key, value) in canon.items():
        ds_key = f"zero_optimization.{key}"
        if name in ZERO_ELEMENTS:
            out.set(ZERO_ELEMENTS[name], elements_to_bytes(value, itemsize, ds_key), ds_key)
        elif name == "sub_group_size":
            _sub_group_size(value, ds_key, out)
        elif name == "overlap_comm":
            if value is not None:  # null: DeepSpeed's default, below
                out.set("zero.overlap_comm", ds_bool(value, ds_key), ds_key)
        elif name in ZERO_PLAIN:
            out.set(ZERO_PLAIN[name], value, ds_key)
        elif name in IGNORED_ZERO:
            out.ignore(ds_key, IGNORED_ZERO[name])
    if "stage" not in canon:
        out.set("zero.stage", 0, "zero_optimization.stage")  # DeepSpeed's default
    stage = values.coerce(canon.get("stage", ("", 0))[1], int, {}, "zero_optimization.stage")
    if canon.get("overlap_comm", ("", None))[1] is None:  # DeepSpeed: on for stage 3 only
        out.set("zero.overlap_comm", stage == 3, "zero_optimization.overlap_comm")
    ds_offload.map_offload(canon, stage, itemsize, out)


def _sub_group_size(value: Any, ds_key: str, out: Mapped) -> None:
    """DeepSpeed's optimizer tile in elements -> offload.optimizer.chunk_numel. DeepSpeed
    closes a sub-group once it holds at least sub_group_size elements, so 0 makes every
    parameter its own sub-group (stage3.py, _create_fp16_sub_groups): the finest tiling it
    has. tierzero's pieces cut a flat shard at chunk_numel elements whatever the
    parameters, so 0 keeps the default piece size (one request per moment piece) and says
    so."""
    count: int = values.coerce(value, int, {"ge": 0}, ds_key)
    if count == 0:
        out.ignore(ds_key, "0 (DeepSpeed: one sub-group per parameter): tierzero streams "
                   "optimizer state in pieces of offload.optimizer.chunk_numel elements "
                   "(default: one nvme.block_size request per moment piece, 1-4M elements), "
                   "no larger than DeepSpeed's per-parameter groups of a large model's "
                   "matrices; set offload.optimizer.chunk_numel to change it")
    else:
        out.set("offload.optimizer.chunk_numel", count, ds_key)


def _activations(ac: Mapping[str, Any], out: Mapped) -> None:
    """cpu_checkpointing maps to activations.cpu_offload; what to recompute is the model's
    choice (torch.utils.checkpoint), so the other keys are reported, not acted on."""
    for key in ac:
        if key == "cpu_checkpointing":
            out.set("activations.cpu_offload", ds_bool(ac[key], "activation_checkpointing." + key),
                    "activation_checkpointing." + key)
        else:
            out.ignore(f"activation_checkpointing.{key}",
                       "use torch.utils.checkpoint in the model")


def _aio(aio: Mapping[str, Any], out: Mapped) -> None:
    check_keys(aio, {"block_size", "queue_depth", "thread_count", "intra_op_parallelism",
                     "single_submit", "overlap_events", "use_gds"}, "aio")
    if "thread_count" in aio and "intra_op_parallelism" in aio and (
            aio["thread_count"] != aio["intra_op_parallelism"]):
        raise ConfigError("aio.thread_count", f"{aio['thread_count']!r} conflicts with "
                          f"aio.intra_op_parallelism = {aio['intra_op_parallelism']!r} (the same "
                          "setting, old and new name); keep one")
    for ds, native in (("block_size", "nvme.block_size"), ("queue_depth", "nvme.queue_depth"),
                       ("thread_count", "nvme.threads"), ("intra_op_parallelism", "nvme.threads")):
        if ds in aio:
            out.set(native, aio[ds], f"aio.{ds}")
    for ds, reason in (("single_submit", "libaio switch; tierzero's NVMe I/O has no equivalent"),
                       ("overlap_events", "libaio switch; tierzero's NVMe I/O has no equivalent"),
                       ("use_gds", "GPUDirect Storage is not supported")):
        if ds in aio:
            out.ignore(f"aio.{ds}", reason)
