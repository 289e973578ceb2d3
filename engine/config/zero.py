"""The `zero` section: partitioning and the gather/release schedule.

Part of the config tree (schema.py's module doc says how a field is written).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierzero.engine.config.fields import MiB, meta


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
