"""Typed settings for the tier manager: budgets, homes, pool, prefetch windows.

offload/ cannot import engine/, so the engine fills these small frozen objects
from its config. Every field is validated once, in ``__post_init__``; a bad
value raises :class:`SettingsError` naming the field, the value and what is
allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

TensorClass = Literal["param", "grad", "master", "exp_avg", "exp_avg_sq"]
Tier = Literal["device", "host", "nvme"]
OffloadDevice = Literal["none", "cpu", "nvme", "auto"]
DeviceKind = Literal["auto", "cuda", "cpu", "meta"]  # meta: a dry run (plan)

TENSOR_CLASSES: tuple[TensorClass, ...] = get_args(TensorClass)
# The subsets of the tensor classes that code picks out, named once:
# what a trainable group has besides param (a frozen one keeps only param)
OPTIMIZER_CLASSES: tuple[TensorClass, ...] = ("master", "grad", "exp_avg", "exp_avg_sq")
# the optimizer state the CPU Adam reads and writes (stored in pieces when large)
STATE_CLASSES: tuple[TensorClass, ...] = ("master", "exp_avg", "exp_avg_sq")
# Adam's moments (what offload.optimizer.state_precision may keep compressed)
MOMENT_CLASSES: tuple[TensorClass, ...] = ("exp_avg", "exp_avg_sq")
# moved every step between the tiers and the device: gathers and gradient reductions
STEP_CLASSES: tuple[TensorClass, ...] = ("param", "grad")
TIERS: tuple[Tier, ...] = get_args(Tier)  # fastest first
OFFLOAD_DEVICES: tuple[OffloadDevice, ...] = get_args(OffloadDevice)
# offload device -> the home tier it names ("auto" is decided by the planner)
FIXED_HOME: dict[OffloadDevice, Tier] = {"none": "device", "cpu": "host", "nvme": "nvme"}

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


class SettingsError(ValueError):
    """A tier-manager setting is out of range; the message names field, value and range."""


def _check_bytes(name: str, value: int | None, *, allow_none: bool, minimum: int = 0) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        allowed = f"an int >= {minimum}" + (" or None (detect)" if allow_none else "")
        raise SettingsError(f"{name} = {value!r} is not allowed; expected {allowed} (bytes)")


@dataclass(frozen=True)
class Budgets:
    """Bytes each tier may hold; ``None`` means detect at start (see offload.budget)."""

    device: int | None = None  # CUDA memory, or the CPU stand-in's budget
    host: int | None = None  # RAM for host-homed shards plus the buffer pool
    nvme: int | None = None  # swap-file bytes
    # Detected host budget = available RAM minus this: the OS, the data loader and
    # the rest of the process live there (pinned memory cannot be swapped out).
    host_reserve: int = 4 * GiB
    # Detected device budget = free device memory minus this: activations and
    # the CUDA context allocate after we plan.
    device_reserve: int = 2 * GiB
    # Detected nvme budget = free disk minus this, so the file system never fills; None:
    # nvme_reserve_fraction of the file system's size (a flat 1 GiB made a small file
    # system with several times the space needed "too small", and is nothing on 4 TB).
    nvme_reserve: int | None = None
    nvme_reserve_fraction: float = 0.02
    # Swap bytes the engine's own host buffers (the CPU Adam's ring) can have in flight as
    # copy-on-write second copies: the swap file grows by them ([Note: swap file growth]).
    nvme_in_flight: int = 0

    def __post_init__(self) -> None:
        for name in ("device", "host", "nvme", "nvme_reserve"):
            _check_bytes(f"budgets.{name}", getattr(self, name), allow_none=True)
        for name in ("host_reserve", "device_reserve", "nvme_in_flight"):
            _check_bytes(f"budgets.{name}", getattr(self, name), allow_none=False)
        f = self.nvme_reserve_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 <= f < 1:
            raise SettingsError(f"budgets.nvme_reserve_fraction = {f!r} is not allowed; "
                                "expected a number in [0, 1)")


@dataclass(frozen=True)
class PoolSettings:
    """The host staging pool between NVMe and the faster tiers.

    Fixed-size buffers allocated once; every NVMe-homed shard is read into (and
    written back from) one of them, so ``buffer_count`` bounds host<->NVMe
    transfers in flight plus host caches of NVMe shards.
    """

    buffer_count: int | None = None  # None: cover both prefetch windows + 2
    # None: the largest NVMe-homed shard of a ``staged`` class, aligned (and at least
    # 1/buffer_count of the largest NVMe shard of any class, [Note: pool spans])
    buffer_bytes: int | None = None
    # Classes whose NVMe shards pass through the pool every step (fetched as caches).
    # The others reach the pool only on rare paths (initial placement, checkpoints)
    # and then take a span of adjacent buffers; e.g. the engine streams optimizer
    # state into its own buffers (TierManager.read_into / write_from), so it lists
    # only param and grad and the pool is not sized by fp32 master shards.
    staged: tuple[TensorClass, ...] = TENSOR_CLASSES
    pin_memory: bool = True  # page-lock the pool and host homes when CUDA exists
    numa_local: bool = True  # allocate on the GPU's NUMA node when there are several

    def __post_init__(self) -> None:
        _check_bytes("pool.buffer_count", self.buffer_count, allow_none=True, minimum=1)
        _check_bytes("pool.buffer_bytes", self.buffer_bytes, allow_none=True, minimum=1)
        bad = [c for c in self.staged if c not in TENSOR_CLASSES]
        if bad or not isinstance(self.staged, tuple):
            raise SettingsError(f"pool.staged = {self.staged!r} is not allowed; expected a "
                                f"tuple of tensor classes from {list(TENSOR_CLASSES)}")


@dataclass(frozen=True)
class PrefetchSettings:
    """Look-ahead windows, in bytes of upcoming shards, per source tier.

    In-flight work is bounded in bytes so prefetch can never push a tier past its
    budget: NVMe reads are slow, so they start further ahead than host->device
    copies, which only need to beat the compute of one or two units.
    """

    nvme_bytes: int = 1 * GiB  # NVMe -> host reads start this far ahead
    device_bytes: int = 256 * MiB  # host -> device copies start this far ahead

    def __post_init__(self) -> None:
        _check_bytes("prefetch.nvme_bytes", self.nvme_bytes, allow_none=False)
        _check_bytes("prefetch.device_bytes", self.device_bytes, allow_none=False)


def _default_homes() -> dict[TensorClass, OffloadDevice]:
    return dict.fromkeys(TENSOR_CLASSES, "auto")


@dataclass(frozen=True)
class TierSettings:
    """Everything the tier manager needs from the config, validated once."""

    homes: Mapping[TensorClass, OffloadDevice] = field(default_factory=_default_homes)
    budgets: Budgets = field(default_factory=Budgets)
    pool: PoolSettings = field(default_factory=PoolSettings)
    prefetch: PrefetchSettings = field(default_factory=PrefetchSettings)
    # "auto": CUDA when available, else a CPU stand-in with its own budget.
    device: DeviceKind = "auto"
    device_index: int = 0  # CUDA device ordinal when device is CUDA
    # auto placement keeps shards at most this large on the fastest tier that
    # fits, whatever their class (they cost a transfer each but few bytes).
    persist_bytes: int = 1 * MiB
    # A demand fetch that finds its tier full of shards in use by others waits
    # this long for a release, then raises BudgetError naming the holders.
    wait_timeout_s: float = 60.0
    swap_path: str | None = None  # where NVMe free space is detected
    # Bytes of a class homed on nvme whose shards are homed in host memory instead
    # (DeepSpeed's offload_param.max_in_cpu): shards taken in the order given to
    # plan_placement while they fit, counted against the host budget. [Note: host
    # allowance] in offload/placement.py.
    host_allowance: Mapping[TensorClass, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        allowance = dict(self.host_allowance)
        for cls, n in allowance.items():
            if cls not in TENSOR_CLASSES:
                raise SettingsError(f"host_allowance has unknown tensor class {cls!r}; "
                                    f"allowed: {list(TENSOR_CLASSES)}")
            _check_bytes(f"host_allowance[{cls!r}]", n, allow_none=False)
        object.__setattr__(self, "host_allowance", allowance)
        homes = dict(self.homes)
        unknown = sorted(set(homes) - set(TENSOR_CLASSES))
        if unknown:
            raise SettingsError(
                f"homes has unknown tensor class(es) {unknown}; allowed: {list(TENSOR_CLASSES)}"
            )
        for cls, dev in homes.items():
            if dev not in OFFLOAD_DEVICES:
                raise SettingsError(
                    f"homes[{cls!r}] = {dev!r} is not allowed; expected one of "
                    f"{list(OFFLOAD_DEVICES)}"
                )
        full: dict[TensorClass, OffloadDevice] = _default_homes()
        full.update(homes)
        object.__setattr__(self, "homes", full)
        wrong = {c: full[c] for c, n in allowance.items() if n and full[c] != "nvme"}
        if wrong:
            raise SettingsError(f"host_allowance applies to classes homed on nvme; "
                                f"{wrong} are not (set the allowance to 0 for them)")
        if self.device not in get_args(DeviceKind):
            raise SettingsError(
                f"device = {self.device!r} is not allowed; expected one of "
                f"{list(get_args(DeviceKind))}"
            )
        _check_bytes("device_index", self.device_index, allow_none=False)
        _check_bytes("persist_bytes", self.persist_bytes, allow_none=False)
        if not self.wait_timeout_s > 0:
            raise SettingsError(
                f"wait_timeout_s = {self.wait_timeout_s!r} is not allowed; expected seconds > 0"
            )
