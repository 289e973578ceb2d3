"""The config tree: typed, frozen dataclasses, one field and one doc per knob.

This module and the section modules it re-exports (zero.py, optim.py, batch.py,
outputs.py, train.py) are the single source of truth for every key's name, type,
default and allowed range. The native parser (native.py), the DeepSpeed mapping
(deepspeed.py), `tierzero config check` and docs/config.md all read them; import
the sections from here (or from the package), not from their modules.

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
from tierzero.engine.config.batch import ActivationsConfig, BatchConfig, Schedule
from tierzero.engine.config.errors import ConfigError
from tierzero.engine.config.fields import MiB, meta
from tierzero.engine.config.optim import (
    OptimizerConfig,
    OptimizerType,
    SchedulerConfig,
    SchedulerType,
    WarmupShape,
)
from tierzero.engine.config.outputs import LoggingConfig, LogLevel, OutputsConfig
from tierzero.engine.config.train import TrainConfig
from tierzero.engine.config.zero import ZeroConfig
from tierzero.offload.bf16_master import MasterPrecision
from tierzero.offload.settings import OffloadDevice

Dtype = Literal["fp32", "bf16", "fp16"]
GradDevice = Literal["auto", "cpu", "nvme"]
DirectIO = Literal["auto", "on", "off"]
StatePrecision = Literal["fp32", "bf16", "int8"]
Source = Literal["native", "deepspeed"]
GradDtype = Literal["auto", "fp32"]
CpuMatmul = Literal["auto", "native", "fp32"]

# The sections defined in their own modules are re-exported: import any section from here.
__all__ = [
    "ActivationsConfig", "BatchConfig", "BudgetsConfig", "Config", "CpuMatmul", "DirectIO", "Dtype",
    "GradDevice", "GradDtype", "LogLevel", "LoggingConfig", "LossScaleConfig", "MiB",
    "NvmeConfig", "OffloadConfig", "OptimizerConfig", "OptimizerOffloadConfig",
    "OptimizerType", "OutputsConfig", "ParamOffloadConfig", "PrecisionConfig", "Schedule",
    "SchedulerConfig", "SchedulerType", "Source", "StatePrecision", "TrainConfig",
    "WarmupShape", "ZeroConfig",
]


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
        metadata=meta("dtype of gathered params and activations; master weights are fp32 "
                      "(or the bf16 params themselves: offload.optimizer.master_precision)"),
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
    # [Note: low-precision matmul on CPU] in engine/cpu_matmul.py
    cpu_matmul: CpuMatmul = field(
        default="auto",
        metadata=meta(
            "how matrix products of bf16/fp16 tensors are computed where the model runs on "
            "a CPU: auto = in fp32, rounded to the compute dtype once, where torch has no "
            "fast native kernel for the dtype on this CPU (no oneDNN support: CPUs without "
            "AVX-512, whose native kernel is 10-100x slower than fp32), natively elsewhere; "
            "native = always torch's own kernel; fp32 = always in fp32. The same rounding as "
            "the native kernel up to the order of fp32 sums; ignored on an accelerator"
        ),
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
            "bytes per CPU Adam buffer; null = the mean piece's master, moments and param "
            "as fp32 state, cut as fp32 moments are (compressed moments or a bf16 master "
            "fit several pieces to a buffer); the buffers together hold at least the "
            "largest unit's streamed state up to 256 MiB, and at least the largest piece",
            gt=0,
            unit="bytes",
        ),
    )
    # [Note: optimizer state in chunks] in offload/adam_stream.py
    chunk_numel: int | None = field(
        default=None,
        metadata=meta(
            "elements per piece of a shard's master and moments when they stream from NVMe "
            "(DeepSpeed's sub_group_size): each piece has its own swap region and the CPU "
            "Adam's ring holds pieces, so host memory does not grow with the largest unit; "
            "null = one moment piece per nvme.block_size request (at 4 MiB: 1M elements "
            "with fp32 moments, 2M with bf16, about 4M with int8)",
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
            "scaling, gradients are measured during backward (same results) and the update "
            "runs on a worker during the next forward, each unit's before it is gathered"
        ),
    )
    # [Note: speculated step] in engine/step/speculation.py
    speculate_step: bool = field(
        default=True,
        metadata=meta(
            "with overlap_step, gradient clipping or fp16 loss scaling, and optimizer state "
            "on NVMe: run the update during backward as if nothing is clipped or overflows, "
            "keeping the state it replaces on the drive (copy-on-write: no extra bytes "
            "moved, up to the state's size of extra swap file), and undo it in step() when "
            "clipping fires or the step is skipped (then the exact update runs during the "
            "next forward). Results are identical either way; tried after a step that "
            "clipping left alone, and more rarely after each undo"
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

    # Each I/O thread has one request in flight: 4 MiB requests on 8 threads keep 32 MiB
    # queued, which the drive needs to approach its sequential rate under the step's mixed
    # reads and writes (benchmarks/RESULTS.md, "Deeper NVMe queue"). A thread's bounce block
    # (max_task_bytes) is touched only by unaligned buffers, which the engine's are not (an
    # aligned buffer's ragged end bounces one page: swap/blockio.py).
    block_size: int = field(
        default=4 * MiB,
        metadata=meta("bytes per I/O request; a multiple of 4096", gt=0, le=1 << 30,
                      unit="bytes"),
    )
    # Upper bounds: what swap.SwapStore accepts.
    queue_depth: int = field(
        default=8, metadata=meta("I/O requests in flight per thread", gt=0, le=1 << 16)
    )
    threads: int = field(default=8, metadata=meta("I/O worker threads", gt=0, le=256))
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
