"""The engine config turned into offload's tier settings: homes per tensor class, budgets,
pool, prefetch windows, the swap directory. Pure: no shard is touched here.

offload/ cannot import engine/, so this module is where `engine.Config` becomes
`offload.TierSettings` (engine/shards/tiered.py builds the tier manager from it).

Homes per tensor class:
    param                        offload.params.device  (none -> device, cpu -> host, ...)
    master, exp_avg, exp_avg_sq  offload.optimizer.device
    grad                         offload.optimizer.grad_device ([Note: gradient home])
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TypedDict

import psutil
import torch

from tierzero.engine.config import Config, NvmeConfig
from tierzero.engine.host_defaults import cpu_device_budget, device_is_host
from tierzero.offload import Budgets, PoolSettings, PrefetchSettings, ShardSpec, TierSettings
from tierzero.offload.settings import STATE_CLASSES, STEP_CLASSES, OffloadDevice, TensorClass
from tierzero.offload.state_codec import BLOCK, moment_nbytes

log = logging.getLogger(__name__)


def offload_wanted(config: Config) -> bool:
    """Whether any tensor class is homed off the device (else the plain store is used)."""
    return (config.offload.params.device, config.offload.optimizer.device) != ("none", "none")


def homes_from(config: Config) -> dict[TensorClass, OffloadDevice]:
    params = config.offload.params.device
    opt = config.offload.optimizer.device
    if config.zero.stage < 3 and params != "none":
        log.warning("offload.params.device=%r applies to stage 3 only (stage %d keeps "
                    "parameters gathered on the device); parameter shards stay on the device",
                    params, config.zero.stage)
        params = "none"
    return {"param": params, "master": opt, "grad": grad_home(config), "exp_avg": opt,
            "exp_avg_sq": opt}


# [Note: gradient home]
# The gradient shard (4 B/param in fp32; 2 in the compute dtype with one rank and no
# accumulation, [Note: gradient precision] in shards/grad_precision.py) is written by the
# reduction of every micro-step and read by the optimizer step (and by clipping's norm,
# fp16's overflow check). Where it is homed, offload.optimizer.grad_device:
#   cpu   host memory, for the whole run: 4 (or 2) B/param of RSS (160 GB for a 40B model
#         in fp32).
#   nvme  a swap-file region. The reduction fills a host cache of it in the NVMe staging
#         pool (no read: the first reduction after zero_grad overwrites the shard, [Note:
#         gradients zeroed on first use] in shards/store.py); under pool pressure a dirty
#         cache is written down and read back when used. Once the optimizer step has consumed it the
#         cache is dropped without being written (TierManager.discard: zero_grad follows
#         every step, so the old values are never read). With offload.optimizer.overlap_step
#         the step consumes each unit's gradient during backward, right after its reduction,
#         so the gradient never reaches the disk and host memory holds a few of them at a
#         time; when it must outlive backward (clipping's global norm, fp16's overflow
#         check, accumulation over micro-steps) it is written down and read back, as
#         ZeRO-Infinity swaps gradients with the optimizer state.
#   auto  with optimizer state on NVMe: host memory while an explicit
#         offload.budgets.host_bytes has room for it after the fixed homes, the staging pool
#         and the CPU Adam's ring (the planner's host allowance, [Note: host allowance] in
#         offload/placement.py), the rest on NVMe; without an explicit host budget all on
#         NVMe, so host memory does not grow with the model. With the optimizer in host
#         memory (cpu) the gradient stays there; with optimizer device auto the planner
#         places it (host first, then NVMe).
# memory_report()["tiers"]["grad_home"] and the step log show where the gradients went.
def grad_home(config: Config) -> OffloadDevice:
    """Home of the gradient shards ([Note: gradient home])."""
    opt = config.offload.optimizer
    if opt.grad_device != "auto":
        return opt.grad_device
    return "nvme" if opt.device == "nvme" else opt.device


def grad_host_allowance(config: Config) -> int:
    """Gradient bytes the planner may home in host memory instead of NVMe: auto with an
    explicit host budget ([Note: gradient home])."""
    opt, host = config.offload.optimizer, config.offload.budgets.host_bytes
    if opt.grad_device == "auto" and opt.device == "nvme" and host is not None:
        return host
    return 0


def swap_dir(config: Config) -> str | None:
    """The NVMe directory: optimizer's path, else params' path (both must exist; checked
    by the config)."""
    return config.offload.optimizer.path or config.offload.params.path


def tier_settings(config: Config, device: torch.device, *, host_outside: int = 0,
                  specs: Sequence[ShardSpec] = (), params_to_device: bool = False,
                  lent_buffers: int = 0) -> TierSettings:
    """offload.TierSettings from the engine config (budgets, pool, prefetch windows).

    `host_outside`: host bytes the engine allocates itself (the CPU Adam's pipeline
    buffers); offload.budgets.host_bytes covers them too, so the manager gets the rest.
    `specs`: every shard the manager will hold (sizes the CPU stand-in's device tier).
    `params_to_device`: param shards are fetched to the device tier to be gathered (not
    when the device is host memory: [Note: params gathered from host memory] in
    shards/tiered.py; a dry run on meta planning CUDA).
    `lent_buffers`: pool buffers beyond offload.params.buffer_count, for units whose
    gathers view the pool ([Note: a gather viewing the pool's buffer] in shards/lent.py).
    """
    b = config.offload.budgets
    dev_budget = b.device_bytes
    homes = homes_from(config)
    if dev_budget is None and device_is_host(device):
        # The CPU stand-in device tier is host memory ([Note: CPU compute defaults] in
        # engine/host_defaults.py): what it must hold, or, when the planner may home shards
        # there (an auto home), what is free.
        if "auto" in homes.values() or not specs:
            dev_budget = int(psutil.virtual_memory().available)
        else:
            below = [s for s in specs if homes[s.cls] != "none"]
            dev_budget = cpu_device_budget(
                homed=sum(s.nbytes for s in specs if homes[s.cls] == "none"),
                fetched=[s.nbytes for s in below if s.cls == "param" and params_to_device],
                reserve=max((s.nbytes for s in below if s.cls in STEP_CLASSES),
                            default=0))
    reserve = {} if b.host_reserve_bytes is None else {"host_reserve": b.host_reserve_bytes}
    host = b.host_bytes
    if host is not None:
        if host <= host_outside:
            raise ValueError(
                f"offload.budgets.host_bytes = {host} does not cover the CPU Adam's pipeline "
                f"buffers ({host_outside} bytes: offload.optimizer.buffer_count x "
                "buffer_bytes); raise it "
                "well above that, or use smaller units (zero.units / zero.unit_min_bytes)")
        host -= host_outside
    budgets = Budgets(device=dev_budget, host=host, nvme=b.nvme_bytes,
                      nvme_reserve_fraction=b.nvme_reserve_fraction,
                      nvme_in_flight=host_outside, **reserve)
    p, o = config.offload.params, config.offload.optimizer
    # The pool stages NVMe traffic that goes through the manager's caches: parameter
    # gathers (offload.params.buffer_count x buffer_bytes). The optimizer step reads and
    # writes its state straight into its own ring (offload.optimizer.buffer_count x
    # buffer_bytes, outside the pool, see pipeline_bytes); what else touches NVMe-homed
    # state (initial placement, checkpoints, one shard at a time) needs one buffer, plus
    # one for a write-back. So only param and grad are staged every step: the buffers
    # are sized for them, and a larger optimizer shard on those rare paths takes a span
    # of adjacent buffers ([Note: pool spans] in offload/pool.py). With param on NVMe the
    # buffers are sized for it and an fp32 gradient on NVMe (twice a bf16 param) takes a
    # span: buffers sized for gradients would double the pool for every gathered param (a
    # gradient kept in the compute dtype, [Note: gradient precision], fits one buffer).
    params_nvme = homes["param"] in ("nvme", "auto")
    nvme_buffers = [c.buffer_count if c is p else 2
                    for c, d in ((p, homes["param"]), (o, homes["master"]))
                    if d in ("nvme", "auto")]
    pool = PoolSettings(buffer_count=max(nvme_buffers) + lent_buffers if nvme_buffers else None,
                        buffer_bytes=p.buffer_bytes if params_nvme else None,
                        pin_memory=p.pin_memory and o.pin_memory,
                        staged=("param",) if params_nvme else STEP_CLASSES)
    # Device window: the gather look-ahead (zero.prefetch_bytes); NVMe reads, slower than
    # host->device copies, run 4x as far ahead (independent of max_in_cpu_bytes).
    ahead = config.zero.prefetch_bytes
    prefetch = PrefetchSettings(nvme_bytes=4 * ahead, device_bytes=ahead)
    # offload.params.max_in_cpu_bytes: param shards homed in host memory instead of NVMe
    # ([Note: host allowance] in offload/placement.py).
    allowance: dict[TensorClass, int] = ({"param": p.max_in_cpu_bytes}
                 if homes["param"] == "nvme" and p.max_in_cpu_bytes else {})
    if grad_host_allowance(config):  # [Note: gradient home]
        allowance["grad"] = grad_host_allowance(config)
    return TierSettings(
        homes=homes, budgets=budgets, pool=pool, prefetch=prefetch,
        device="cuda" if device.type == "cuda" else "meta" if device.type == "meta" else "cpu",
        device_index=device.index or 0, swap_path=swap_dir(config),
        host_allowance=allowance)


# [Note: which shards the host keeps]
# offload.params.max_in_cpu_bytes ([Note: host allowance] in offload/placement.py) takes
# param shards in declaration order: the blocks in forward order, then the root's
# pieces. DeepSpeed keeps its first fp16 sub-groups (parameter order: the embedding first,
# then the blocks) while their element count stays within max_in_cpu, as a prefix; here a
# shard that does not fit is skipped and later smaller ones may still fit. Blocks come
# before the root: with a partial allowance that order removes every param read, the
# root first does not (benchmarks/RESULTS.md, "Measurements behind design choices"). The
# root's pieces are the last shards the CPU Adam updates, so their new param is already
# kept in pool buffers as host caches for the next forward ([Note: param kept in host
# memory] in offload/stream_parts.py), and the root stays gathered from the first forward
# to the end of backward: homing it in host memory saves its writes but few reads. A block
# is read in forward and again in backward unless kept gathered, and the first blocks are
# read while the step's last writes still hold the disk. With the whole
# model within the allowance (DeepSpeed's default, 2e9 bytes) the order does not matter.


def optimizer_on_device(homes: Mapping[TensorClass, OffloadDevice]) -> bool:
    """Master and moments stay on the device: a torch optimizer steps them there."""
    return homes["master"] == "none"


def state_in_host(homes: Mapping[TensorClass, OffloadDevice]) -> bool:
    """Master and moments homed in host memory: the CPU Adam updates them in place."""
    return all(homes[k] == "cpu" for k in STATE_CLASSES)


def chunk_numel(config: Config, homes: Mapping[TensorClass, OffloadDevice]) -> int:
    """Elements per piece of master and moments (0: whole shards): only where the CPU Adam
    streams them ([Note: optimizer state in chunks] in offload/adam_stream.py); unset, a
    moment piece of one request ([Note: a moment piece is one request])."""
    if optimizer_on_device(homes) or state_in_host(homes):
        return 0
    chosen = config.offload.optimizer.chunk_numel
    if chosen is not None:
        return chosen
    return request_chunk_numel(config.nvme.block_size, state_precision(config, homes))


# [Note: a moment piece is one request]
# The CPU Adam streams master and moments in pieces, each read and written as its own
# requests. With offload.optimizer.chunk_numel unset, a piece has as many elements as make
# one moment exactly one nvme.block_size request, or just under: block_size / 4 elements
# of fp32 moments (1M at the default 4 MiB), twice that in bf16, and about four times
# (codes and scales) in int8. A fixed element count would cut compressed moments into
# requests of a quarter block, and the drive moves fewer bytes a second in small requests
# (benchmarks/RESULTS.md). The count is a multiple of the int8 codec's block, so the
# blocks, and every value, are those of any other such cut. The ring's default buffer is
# the mean piece's state as if fp32, the shards cut as fp32 moments would be
# (ring_piece_numel, StateLayout.ring_bytes): the same ring bytes at every state
# precision, which larger compressed pieces fill fewer to a buffer, instead of a ring
# four times the bytes with int8 moments (host memory a tight budget would take from the
# state's placement); the default ring also holds at least a unit's state, up to a fixed
# size ([Note: the ring's floor] in state_layout.py).
def ring_piece_numel(config: Config) -> int:
    """The piece the CPU Adam ring's default buffers are sized by: chunk_numel if set,
    else fp32 moments' piece of one request ([Note: a moment piece is one request])."""
    chosen = config.offload.optimizer.chunk_numel
    return chosen if chosen is not None else request_chunk_numel(config.nvme.block_size,
                                                                 "fp32")


def request_chunk_numel(block_size: int, precision: str) -> int:
    """The most elements, a multiple of state_codec.BLOCK, whose one moment in `precision`
    fits in `block_size` bytes (one BLOCK at least): every format stores whole codec
    blocks in the same bytes each (int8: the codes and one scale)."""
    return BLOCK * max(1, block_size // moment_nbytes(BLOCK, precision))


def state_precision(config: Config, homes: Mapping[TensorClass, OffloadDevice]) -> str:
    """How the moments are kept on their home tier ([Note: 8-bit moment codes] in
    offload/state_codec.py); anything but fp32 needs the CPU Adam."""
    prec = config.offload.optimizer.state_precision
    if prec != "fp32" and optimizer_on_device(homes):
        raise ValueError(f"offload.optimizer.state_precision={prec!r} needs the CPU Adam, but "
                         "the optimizer state lives on the device; set it to 'fp32'")
    return prec


def master_precision(config: Config, homes: Mapping[TensorClass, OffloadDevice]) -> str:
    """fp32, or bf16: the compute copy is the master ([Note: bf16 master weights] in
    offload/bf16_master.py); bf16 needs the CPU Adam and bf16 compute (the config checks
    both; the homes may still put the optimizer on the device: an error naming the key)."""
    prec = config.offload.optimizer.master_precision
    if prec != "fp32" and optimizer_on_device(homes):
        raise ValueError(f"offload.optimizer.master_precision={prec!r} needs the CPU Adam, "
                         "but the optimizer state lives on the device; set it to 'fp32'")
    return prec


def needs_swap(config: Config, homes: Mapping[TensorClass, OffloadDevice]) -> bool:
    """Whether a swap store is needed (a class homed on nvme, or placed by the planner);
    an nvme home without a swap directory is an error naming the fix."""
    need = any(d in ("nvme", "auto") for d in homes.values())
    if need and swap_dir(config) is None and any(d == "nvme" for d in homes.values()):
        raise ValueError("offload.*.device is 'nvme' but neither offload.optimizer.path "
                         "nor offload.params.path names a swap directory; set one")
    return need


class SwapOptions(TypedDict):
    """swap.SwapStore's I/O keyword arguments."""

    block_size: int
    queue_depth: int
    threads: int
    verify: bool
    direct: bool | None  # None: decided per file system


def swap_options(nvme: NvmeConfig) -> SwapOptions:
    """The `nvme` section as swap.SwapStore's keyword arguments: every swap store the
    engine opens (the shard store's, engine.Init's slices) uses the same I/O settings."""
    return SwapOptions(block_size=nvme.block_size, queue_depth=nvme.queue_depth,
                       threads=nvme.threads, verify=nvme.verify,
                       direct={"auto": None, "on": True, "off": False}[nvme.direct_io])
