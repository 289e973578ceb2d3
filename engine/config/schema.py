"""The config tree: typed, frozen dataclasses, one field and one doc per knob.

This file is the single source of truth for every key's name, type, default and
allowed range. The native parser (native.py), the DeepSpeed mapping
(deepspeed.py), `tierzero config check` and docs/config.md all read it.

Each knob is a `field(default=..., metadata=meta(doc, ...))`; the metadata
carries the doc line, numeric bounds (`ge`, `gt`, `le`), `unit="bytes"` for byte sizes
(which accept "512MiB", "5e8", 1e9) and `path=True` for file system paths
(`~` and `$VARS` are expanded). Building a `Config` validates the whole tree
once (checks.py), naming the dotted key path of anything wrong; after that it
is immutable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from tierzero.engine.config import checks
from tierzero.engine.config.errors import ConfigError
from tierzero.engine.config.fields import meta
from tierzero.engine.config.train import TrainConfig
from tierzero.offload.bf16_master import MasterPrecision
from tierzero.offload.settings import OffloadDevice

Dtype = Literal["fp32", "bf16", "fp16"]
GradDevice = Literal["auto", "cpu", "nvme"]
OptimizerType = Literal["adamw", "adam"]
SchedulerType = Literal["constant", "warmup_linear", "warmup_cosine"]
WarmupShape = Literal["linear", "log"]
DirectIO = Literal["auto", "on", "off"]
StatePrecision = Literal["fp32", "bf16", "int8"]
LogLevel = Literal["debug", "info", "warning", "error"]
Source = Literal["native", "deepspeed"]
Schedule = Literal["auto", "layer_major", "micro_step"]
GradDtype = Literal["auto", "fp32"]

MiB = 1 << 20


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16 loss scaling (read only when precision.dtype is fp16)."""

    value: float = field(default=0.0, metadata=meta("static loss scale; 0 = dynamic scaling", ge=0))
    initial_scale_power: int = field(
        default=16, metadata=meta("dynamic scaling starts at 2**initial_scale_power", ge=0)
    )
    growth_interval: int = field(
        default=1000, metadata=meta("steps without overflow before the scale doubles", gt=0)
    )
    hysteresis: int = field(
        default=2, metadata=meta("overflows tolerated before the scale is halved", gt=0)
    )
    consecutive_hysteresis: bool = field(
        default=False,
        metadata=meta("refill the hysteresis budget only after an overflow-free step"),
    )
    min_scale: float = field(
        default=1.0, metadata=meta("the dynamic scale never drops below this", gt=0)
    )


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute precision. A bare string (`precision: bf16`) sets `dtype`."""

    dtype: Dtype = field(
        default="bf16",
        metadata=meta("dtype of gathered params and activations; master weights are fp32"),
    )
    loss_scale: LossScaleConfig = field(
        default_factory=LossScaleConfig, metadata=meta("fp16 loss scaling")
    )
    # [Note: gradient precision] in engine/shards/grad_precision.py
    grad_dtype: GradDtype = field(
        default="auto",
        metadata=meta(
            "dtype the gradient shards are kept and moved in: auto = the compute dtype "
            "where that is exact (world size 1, gradient_accumulation_steps 1, bf16 or "
            "fp16, batch.schedule not layer_major: 2 B/param instead of 4, the same "
            "results), fp32 otherwise; fp32 = "
            "always fp32 (a gradient summed from several backward contributions in one "
            "step, such as a late gradient, is then summed in fp32)"
        ),
    )


@dataclass(frozen=True)
class ZeroConfig:
    """Partitioning and the gather/release schedule."""

    stage: int = field(
        default=3,
        metadata=meta(
            "0 = plain data parallel, 1 = optimizer state, 2 = + gradients, 3 = + parameters",
            ge=0,
            le=3,
        ),
    )
    units: tuple[str, ...] = field(
        default=(),
        metadata=meta(
            "module class names gathered as one unit; empty = the model's _no_split_modules, "
            "else the size rule (unit_min_bytes)"
        ),
    )
    unit_min_bytes: int = field(
        default=16 * MiB,
        metadata=meta(
            "size rule: smallest submodules holding at least this many parameter bytes",
            gt=0,
            unit="bytes",
        ),
    )
    # [Note: units and rank divergence] in engine/units.py: why these exist.
    leaf_modules: tuple[str, ...] = field(
        default=(),
        metadata=meta(
            "module class names never split across units: each is one whole unit (or lies "
            "inside one), whatever the unit rule; adds to auto_leaf_moe's"
        ),
    )
    auto_leaf_moe: bool = field(
        default=True,
        metadata=meta(
            "keep every module with an `experts` child (the mixture-of-experts blocks of "
            "transformers models: Mixtral, Qwen2-MoE, ...) whole in one unit"
        ),
    )
    check_unit_order: bool = field(
        default=True,
        metadata=meta(
            "check with the other ranks before each collective that all are at the same "
            "unit; a difference is an error naming the units on every rank"
        ),
    )
    collective_timeout_s: float = field(
        default=600.0,
        metadata=meta(
            "seconds a rank waits for a unit's gather or reduction (and the order check) "
            "before raising an error naming the unit; NCCL collectives keep the process "
            "group's own timeout",
            gt=0,
        ),
    )
    # The byte defaults below are DeepSpeed's element-count defaults x 2 bytes
    # (bf16), so a native config and a converted DeepSpeed one start equal.
    # Why a look-ahead bound: every unit fetched early holds device memory and
    # a staging buffer until it runs; unbounded, prefetch would evict units
    # that are needed sooner than the ones it brings in.
    prefetch_bytes: int = field(
        default=100_000_000,
        metadata=meta("look-ahead bound: parameter bytes fetched ahead of use", ge=0, unit="bytes"),
    )
    # null: sized to the compute device ([Note: CPU compute defaults] in
    # engine/host_defaults.py): 2 GB with CUDA; on a CPU, where gathered units are host
    # memory, the root and persistent units plus the largest other unit.
    max_live_bytes: int | None = field(
        default=None,
        metadata=meta(
            "gathered parameter bytes resident per device before release; null: 2 GB with "
            "CUDA, on a CPU the always-gathered units + the largest unit", ge=0, unit="bytes"
        ),
    )
    # engine.Init's own bound (tierzero train builds every stage-3 model under it): HF
    # post_init touches each parameter once more after construction, so a larger LRU
    # saves little I/O, while every byte of it is host memory held during the build.
    # 32 MiB keeps a ~100M-parameter build within 0.12 of its state with no settings
    # (256 MiB was 0.2 of it; benchmarks/RESULTS.md, issue 32), at the cost of reading
    # back from NVMe the parameters an initialiser touches after they left the LRU.
    init_live_bytes: int = field(
        default=32 << 20,
        metadata=meta(
            "full parameter bytes engine.Init keeps while a model is built (the newest "
            "parameter is always kept, whatever its size)", ge=0, unit="bytes"
        ),
    )
    persistence_threshold_bytes: int = field(
        default=200_000,
        metadata=meta(
            "parameters smaller than this stay gathered (not partitioned)", ge=0, unit="bytes"
        ),
    )
    max_reuse_distance_bytes: int | None = field(
        default=None,
        metadata=meta(
            "a gathered unit is kept if it is reused within this many parameter bytes; "
            "null: 2 GB with CUDA, on a CPU the largest unit's bytes",
            ge=0,
            unit="bytes",
        ),
    )
    overlap_comm: bool = field(
        default=True, metadata=meta("overlap gradient reduction with backward")
    )
    reduce_bucket_bytes: int = field(
        default=1_000_000_000,
        # 0 is DeepSpeed's "no bucketing" (reduce_bucket_size: 0 reduces every gradient on
        # its own): one reduction in flight at a time (engine/schedule.py).
        metadata=meta("bound on gradient bytes in flight in reductions behind backward; 0 = one "
                      "reduction at a time", ge=0, unit="bytes"),
    )


@dataclass(frozen=True)
class _TierHomeConfig:
    """Fields shared by both offloaded tensor classes."""

    device: OffloadDevice = field(
        default="none",
        metadata=meta("none = accelerator memory, cpu, nvme, auto = planner decides"),
    )
    path: str | None = field(
        default=None, metadata=meta("swap directory for nvme (and auto); must exist", path=True)
    )
    pin_memory: bool = field(
        default=True, metadata=meta("page-lock host buffers when CUDA is present")
    )
    # buffer_count x buffer_bytes bounds the NVMe reads and writes in flight
    # (and the pinned memory they pin): the I/O queue cannot outrun the host.
    buffer_count: int = field(
        default=4, metadata=meta("host staging buffers for NVMe transfers", gt=0)
    )
    buffer_bytes: int | None = field(
        default=None,
        metadata=meta(
            "bytes per staging buffer; null = the largest unit shard", gt=0, unit="bytes"
        ),
    )


@dataclass(frozen=True)
class ParamOffloadConfig(_TierHomeConfig):
    """Home tier of the compute-dtype parameter shards (stage 3 only)."""

    buffer_count: int = field(  # DeepSpeed's offload_param default
        default=5, metadata=meta("host staging buffers for NVMe transfers", gt=0)
    )
    # Not DeepSpeed's default (1e9 elements): params on nvme means on nvme, and the
    # host memory a cache costs is asked for by name.
    max_in_cpu_bytes: int = field(
        default=0,
        metadata=meta("with nvme: this rank's parameter shard bytes homed in host memory "
                      "instead of NVMe (the first units in forward order; DeepSpeed's "
                      "max_in_cpu, whose default is 1e9 elements); counted against "
                      "offload.budgets.host_bytes", ge=0, unit="bytes"),
    )


@dataclass(frozen=True)
class OptimizerOffloadConfig(_TierHomeConfig):
    """Home tier of fp32 master weights, gradients and Adam moments."""

    # The CPU Adam streams NVMe-homed state through one host ring of buffer_count x
    # buffer_bytes ([Note: streamed optimizer step] in offload/adam_stream.py): how far
    # reads run ahead and writes behind, and the host memory of the step.
    buffer_count: int = field(
        default=4, metadata=meta("CPU Adam host buffers for state streamed from NVMe", gt=0)
    )
    buffer_bytes: int | None = field(
        default=None,
        metadata=meta(
            "bytes per CPU Adam buffer; null = the mean unit shard's master, moments and "
            "param (the buffers together hold at least the largest shard)",
            gt=0,
            unit="bytes",
        ),
    )
    # [Note: optimizer state in chunks] in offload/adam_stream.py
    chunk_numel: int = field(
        default=1 << 20,
        metadata=meta(
            "elements per piece of a shard's master and moments when they stream from NVMe "
            "(DeepSpeed's sub_group_size): each piece has its own swap region and the CPU "
            "Adam's ring holds pieces, so host memory does not grow with the largest unit",
            gt=0,
        ),
    )
    # [Note: 8-bit moment codes] in offload/state_codec.py
    state_precision: StatePrecision = field(
        default="fp32",
        metadata=meta(
            "how the CPU Adam keeps exp_avg and exp_avg_sq on their home tier (host or "
            "NVMe) between steps: fp32 = 8 B/param, exact (today's results, bit for bit); "
            "bf16 = 4 B/param, each moment rounded to bf16; int8 = 2.03 B/param, blockwise "
            "8-bit codes (256 elements per fp32 scale, a floating-point code for exp_avg "
            "and for sqrt(exp_avg_sq)). Decoded and re-encoded inside the one-pass kernel; "
            "the master stays fp32. Needs an offloaded optimizer (device cpu, nvme or auto)"
        ),
    )
    # [Note: bf16 master weights] in offload/bf16_master.py
    master_precision: MasterPrecision = field(
        default="fp32",
        metadata=meta(
            "the master weights the CPU Adam updates: fp32 = a separate fp32 master per "
            "shard (4 B/param on the optimizer's tier, read and written every step; the "
            "param is written from it rounded to nearest); bf16 = no separate master: the "
            "bf16 compute copy is the master, updated in fp32 and rounded stochastically "
            "(seeded per step and shard, so a resume is bit-exact). Needs precision bf16 "
            "and an offloaded optimizer (device cpu, nvme or auto)"
        ),
    )
    # [Note: gradient home] in engine/shards/tier_config.py
    grad_device: GradDevice = field(
        default="auto",
        metadata=meta(
            "home of the gradient shards: cpu = host memory; nvme = swap files (a "
            "gradient is accumulated in a staging-pool buffer and dropped unwritten once the "
            "optimizer step has consumed it); auto = host memory while an explicit "
            "offload.budgets.host_bytes has room for it, else nvme (with optimizer device "
            "nvme; otherwise it follows optimizer.device)"
        ),
    )
    overlap_step: bool = field(
        default=True,
        metadata=meta(
            "update each unit's optimizer state as soon as its gradient is final, while "
            "backward runs (state on NVMe: streamed on the compute thread; state in host "
            "memory: in place on one worker thread). With gradient clipping or fp16 loss "
            "scaling, gradients are measured during backward (same results); state in host "
            "memory is then updated on the worker during the next forward, state on NVMe "
            "after backward"
        ),
    )


@dataclass(frozen=True)
class BudgetsConfig:
    """Per-tier byte budgets; null = detected at run time by offload."""

    device_bytes: int | None = field(
        default=None, metadata=meta(
            "accelerator memory budget; null: free device memory with CUDA, on a CPU the "
            "device-homed shards + two of the largest parameter shard", gt=0, unit="bytes")
    )
    host_bytes: int | None = field(
        default=None, metadata=meta("host memory budget (pinned and pageable)", gt=0, unit="bytes")
    )
    nvme_bytes: int | None = field(
        default=None, metadata=meta("swap file space budget", gt=0, unit="bytes")
    )
    host_reserve_bytes: int | None = field(
        default=None,
        metadata=meta("host memory left free for the OS and data loading", ge=0, unit="bytes"),
    )
    nvme_reserve_fraction: float = field(
        default=0.02,
        metadata=meta("with nvme_bytes null: this fraction of the swap file system's size is "
                      "kept free, the rest of its free space is the nvme budget", ge=0, le=0.5),
    )


@dataclass(frozen=True)
class OffloadConfig:
    """Where each tensor class lives. `{device, path, ...}` at this level sets both classes."""

    params: ParamOffloadConfig = field(
        default_factory=ParamOffloadConfig, metadata=meta("compute-dtype parameter shards")
    )
    optimizer: OptimizerOffloadConfig = field(
        default_factory=OptimizerOffloadConfig,
        metadata=meta("master weights, gradients, Adam moments"),
    )
    budgets: BudgetsConfig = field(
        default_factory=BudgetsConfig, metadata=meta("per-tier byte budgets")
    )


@dataclass(frozen=True)
class NvmeConfig:
    """I/O settings of the NVMe tier (swap.SwapStore)."""

    block_size: int = field(
        default=1 * MiB,
        metadata=meta("bytes per I/O request; a multiple of 4096", gt=0, le=1 << 30,
                      unit="bytes"),
    )
    # Upper bounds: what swap.SwapStore accepts.
    queue_depth: int = field(
        default=8, metadata=meta("I/O requests in flight per thread", gt=0, le=1 << 16)
    )
    threads: int = field(default=4, metadata=meta("I/O worker threads", gt=0, le=256))
    direct_io: DirectIO = field(
        default="auto",
        metadata=meta(
            "O_DIRECT: auto = use it where the file system supports it, on = require, off"
        ),
    )
    verify: bool = field(
        default=True,
        metadata=meta("checksum every block written and check it on read (a flipped bit in "
                      "a swap file is an error naming file and key, not a different model; "
                      "one CRC-32 pass per block, fast with isal)"),
    )


@dataclass(frozen=True)
class OptimizerConfig:
    """Adam on the CPU (offload.CPUAdam)."""

    type: OptimizerType = field(
        default="adamw", metadata=meta("adamw = decoupled weight decay, adam = L2 in the gradient")
    )
    lr: float = field(default=1e-3, metadata=meta("peak learning rate", gt=0))
    betas: tuple[float, float] = field(
        default=(0.9, 0.999), metadata=meta("moment decay rates, each in [0, 1)")
    )
    eps: float = field(default=1e-8, metadata=meta("added to the denominator", gt=0))
    weight_decay: float = field(default=0.0, metadata=meta("weight decay coefficient", ge=0))


@dataclass(frozen=True)
class SchedulerConfig:
    """Learning-rate schedule, stepped once per optimizer step."""

    type: SchedulerType = field(
        default="constant",
        metadata=meta(
            "constant = warm up then hold lr; warmup_linear / warmup_cosine = warm up then decay "
            "to min_lr at total_steps"
        ),
    )
    warmup_steps: int = field(
        default=0, metadata=meta("steps from warmup_start_lr to optimizer.lr", ge=0)
    )
    warmup_shape: WarmupShape = field(
        default="linear", metadata=meta("warm-up curve: linear or log (DeepSpeed's)")
    )
    warmup_start_lr: float = field(default=0.0, metadata=meta("learning rate at step 0", ge=0))
    total_steps: int | None = field(
        default=None, metadata=meta("last step of the decay; required by the decaying types", gt=0)
    )
    min_lr: float = field(default=0.0, metadata=meta("learning rate reached at total_steps", ge=0))


@dataclass(frozen=True)
class BatchConfig:
    """Batch sizes; global = micro x accumulation x world size (checked at initialize)."""

    micro_batch_size: int | None = field(
        default=None, metadata=meta("samples per rank per forward; null = derived, else 1", gt=0)
    )
    gradient_accumulation_steps: int | None = field(
        default=None,
        metadata=meta("micro-batches per optimizer step; null = derived, else 1", gt=0),
    )
    global_batch_size: int | None = field(
        default=None,
        metadata=meta("samples per optimizer step over all ranks; null = not checked", gt=0),
    )
    schedule: Schedule = field(
        default="auto",
        metadata=meta("how train_batch runs an accumulated step: layer_major (every "
                      "micro-batch through each unit while it is gathered: one gather per "
                      "unit per pass, the gradient summed in fp32 while resident), "
                      "micro_step (forward and backward per micro-batch), auto = "
                      "layer_major when gradient_accumulation_steps > 1 and parameters or "
                      "gradients live below the device"),
    )


@dataclass(frozen=True)
class ActivationsConfig:
    """Activations saved for backward (the model chooses what to recompute)."""

    cpu_offload: bool = field(
        default=False,
        metadata=meta("keep tensors saved for backward (checkpointed blocks' inputs included) "
                      "in pinned host memory until backward, and a layer-major pass's "
                      "unit-boundary tensors too; CUDA only, a no-op on CPU"),
    )


@dataclass(frozen=True)
class LoggingConfig:
    """What the engine logs."""

    level: LogLevel = field(default="info", metadata=meta("log level of tierzero's loggers"))
    progress: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata=meta("progress bars for Init onto NVMe and checkpoint save/load (rank 0); auto "
                      "= when stderr is a terminal; env TIERZERO_PROGRESS=0/1 overrides"),
    )
    steps_per_print: int = field(
        default=10, metadata=meta("log loss, lr and throughput every this many steps", gt=0)
    )
    wall_clock_breakdown: bool = field(
        default=False, metadata=meta(
            "the engine logs (rank 0, every steps_per_print optimizer steps) the step's wall "
            "ms: forward, backward, step(), unit gathers, deferred-update waits, optimizer "
            "time hidden under compute, I/O stalls (engine/wall_clock.py)")
    )


@dataclass(frozen=True)
class OutputsConfig:
    """Files tierzero writes: checkpoints, metrics, bench results, plots, traces."""

    permissions: Literal["private", "group", "world"] = field(
        default="private",
        metadata=meta("who may read them: private = files 0600 and directories 0700 (like the "
                      "swap files of the same data); group = 0640/0750; world = 0644/0755"),
    )
    background_save_share: float = field(
        default=0.5,
        metadata=meta("a background checkpoint's writer is busy at most this share of the wall "
                      "time (it pauses between parts), so the training's CPU and disk come "
                      "first; 1 = never pause", gt=0, le=1),
    )
    background_save_copy_bytes: int = field(
        default=256 << 20,
        metadata=meta("host bytes a background checkpoint may hold in copies of host- or "
                      "device-resident state the training changes before the save has written "
                      "it; past this the step waits for the save to write that state", ge=0,
                      unit="bytes"),
    )


@dataclass(frozen=True)
class Config:
    """The whole config. Build it with engine.load_config(path | dict | None)."""

    seed: int = field(
        default=0,
        # numpy's seed is a uint32: the bound every one of the three takes
        metadata=meta("seed for torch, numpy and Python's random on every rank", ge=0,
                      le=2**32 - 1),
    )
    precision: PrecisionConfig = field(
        default_factory=PrecisionConfig, metadata=meta("compute precision")
    )
    zero: ZeroConfig = field(
        default_factory=ZeroConfig, metadata=meta("partitioning and gather/release schedule")
    )
    offload: OffloadConfig = field(
        default_factory=OffloadConfig, metadata=meta("tier of each tensor class, budgets")
    )
    nvme: NvmeConfig = field(default_factory=NvmeConfig, metadata=meta("NVMe I/O settings"))
    optimizer: OptimizerConfig = field(
        default_factory=OptimizerConfig, metadata=meta("Adam hyper-parameters")
    )
    scheduler: SchedulerConfig = field(
        default_factory=SchedulerConfig, metadata=meta("learning-rate schedule")
    )
    batch: BatchConfig = field(default_factory=BatchConfig, metadata=meta("batch sizes"))
    gradient_clipping: float = field(
        default=0.0, metadata=meta("clip the global gradient norm to this; 0 = off", ge=0)
    )
    activations: ActivationsConfig = field(
        default_factory=ActivationsConfig,
        metadata=meta("where saved activations wait for backward"),
    )
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata=meta("logging"))
    outputs: OutputsConfig = field(
        default_factory=OutputsConfig, metadata=meta("permissions of output files")
    )
    train: TrainConfig = field(
        default_factory=TrainConfig, metadata=meta("what `tierzero train` runs: model, data, steps")
    )
    source: Source = field(
        default="native",
        metadata=meta("which schema the file used: native or deepspeed", internal=True),
    )
    ignored_keys: tuple[str, ...] = field(
        default=(), metadata=meta("DeepSpeed keys accepted but not acted on (dotted paths)",
                                  internal=True)
    )
    ignored_reasons: tuple[str, ...] = field(
        default=(), metadata=meta("why each of ignored_keys is not acted on", internal=True)
    )
    run_length_auto: tuple[tuple[str, float], ...] = field(
        default=(),
        metadata=meta("DeepSpeed keys whose 'auto' waits for the run length, with the factor "
                      "of it they take ([Note: auto run length] in hf_auto.py)", internal=True),
    )

    def __post_init__(self) -> None:
        checks.validate(self)

    def check_world_size(self, world_size: int) -> Config:
        """Resolve the batch sizes for `world_size` ranks; ConfigError if they do not fit.

        Returns a config whose batch fields are all set (micro x accumulation x
        world_size == global), following DeepSpeed's rules for the unset ones.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError("world_size", f"{world_size!r} is not allowed; allowed: an int >= 1")
        batch = checks.resolve_batch(self.batch, world_size)
        return dataclasses.replace(self, batch=batch)

    def with_run_length(self, steps: int) -> Config:
        """The config with every "auto" that waits for the run length filled for a run of
        `steps` optimizer steps ([Note: auto run length] in hf_auto.py); itself when none
        waits."""
        if not self.run_length_auto:
            return self
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(self.run_length_auto[0][0], f"'auto' resolved with run length "
                              f"{steps!r}; allowed: an int >= 1 (optimizer steps)")
        native = {"scheduler.params.total_num_steps": "total_steps",
                  "scheduler.params.warmup_num_steps": "warmup_steps"}  # (checks.py refuses others)
        filled: dict[str, Any] = {native[key]: checks.of_run_length(factor, steps)
                                  for key, factor in self.run_length_auto}
        if "warmup_steps" in filled:  # DeepSpeed warms up over at least 2 steps (ds_optim.py)
            total = filled.get("total_steps", self.scheduler.total_steps)
            filled["warmup_steps"] = min(max(2, filled["warmup_steps"]),
                                         max(filled["warmup_steps"], total or 2))
        return dataclasses.replace(self, scheduler=dataclasses.replace(self.scheduler, **filled),
                                   run_length_auto=())

    def require_run_length(self) -> None:
        """ConfigError naming the first DeepSpeed key whose "auto" still waits for the run
        length (called before any work by `initialize`)."""
        if self.run_length_auto:
            keys = ", ".join(k for k, _ in self.run_length_auto)
            raise ConfigError(self.run_length_auto[0][0],
                              f"'auto' needs the run length, which is still unknown (waiting: "
                              f"{keys}); pass auto_values={{'max_steps': N}} to load_config, "
                              "call config.with_run_length(N), run it with `tierzero train` "
                              "(train.steps fills it) or write the number")
