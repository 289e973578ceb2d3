"""The engine's shard store over offload's TierManager, and the config translation.

offload/ cannot import engine/, so this file turns `engine.Config` into
`offload.TierSettings` and gives the engine a `ShardStore` whose tensors live
wherever the tier manager puts them ([Note: shard residency] in shards/store.py).

Homes per tensor class:
    param                        offload.params.device  (none -> device, cpu -> host, ...)
    master, exp_avg, exp_avg_sq  offload.optimizer.device
    grad                         offload.optimizer.grad_device ([Note: gradient home])
Moments kept compressed (offload.optimizer.state_precision bf16 / int8, see
offload/state_codec.py) are uint8 manager keys of state_codec.moment_nbytes(numel) bytes:
the CPU Adam reads and writes them at that size; `use()` hands everyone else the decoded
fp32 values (and encodes them back when writable), `use(raw=True)` the stored bytes of
one piece, `use_stored()` every piece's (checkpoints).
Manager keys are "<group key>:<class>"; master and moments streamed from NVMe in several
pieces (offload.optimizer.chunk_numel, [Note: optimizer state in chunks] in
offload/adam_stream.py) are "<group key>:<class>@<first element>" per piece.

Access: `use(key, kind)` fetches the shard to the tier where the engine
consumes it (param -> device, where it is gathered; the others -> host when
homed off the device) and releases it on exit. When the optimizer state stays
on the device (device Adam), master, grad and the moments are pinned on the
device once and `tensor()` hands out those views, which stay valid.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch

from tierzero import swap
from tierzero.engine.config import Config
from tierzero.engine.host_defaults import cpu_device_budget, device_is_host
from tierzero.engine.shards.snapshot import Part, StoreSnapshot
from tierzero.engine.shards.store import ShardStore
from tierzero.offload import (
    Budgets,
    PoolSettings,
    PrefetchSettings,
    ShardSpec,
    TierManager,
    TierSettings,
)
from tierzero.offload.adam_stream import param_assembly_bytes, piece_bytes
from tierzero.offload.host_ring import page_up
from tierzero.offload.settings import TENSOR_CLASSES, OffloadDevice, TensorClass, Tier
from tierzero.offload.state_codec import StoredLayout, decode, encode, moment_nbytes

log = logging.getLogger(__name__)

_OPTIMIZER_KINDS: tuple[TensorClass, ...] = ("master", "grad", "exp_avg", "exp_avg_sq")
_STATE_KINDS: tuple[TensorClass, ...] = ("master", "exp_avg", "exp_avg_sq")  # stored in pieces


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


# [Note: dry-run pieces]
# tierzero plan runs the engine on meta tensors and counts bytes ([Note: plan from the
# engine] in engine/plan/dry_run.py). Every piece of master and moments is a record in the tier
# manager and an item of the CPU Adam's stream, and each costs Python work per step: at
# the default chunk_numel (1M elements) a 70B model has ~70,000 pieces per kind. A dry run
# therefore cuts each shard into at most DRY_PIECES pieces (never smaller than
# chunk_numel). The bytes it counts are the same (the same elements cross the same tiers:
# the state pieces are read into the stream's ring, never into the manager's pool, and the
# dry swap counts logical bytes), a shard is in several pieces exactly when it would be in
# a real run, and the host memory it reports for the stream's buffers (ring_bytes,
# param_ring_bytes, the tier budget's host_outside) is computed from the real pieces.
# Two things differ from a real run: the stream's own ring on meta is larger (it must hold
# a coarse piece; the dry run reports pipeline_bytes() instead of what that ring took), and
# its read-ahead during forward covers whole coarse pieces, so some state reads count in
# forward instead of backward (the step's totals are exact; the split between the two
# phases is not).
DRY_PIECES = 16


# [Note: gradient home]
# The fp32 gradient shard (4 B/param) is written by the reduction of every micro-step and
# read by the optimizer step (and by clipping's norm, fp16's overflow check). Where it is
# homed, offload.optimizer.grad_device:
#   cpu   host memory, for the whole run: 4 B/param of RSS (160 GB for a 40B model).
#   nvme  a swap-file region. The reduction fills a host cache of it in the NVMe staging
#         pool (no read: the first reduction after zero_grad overwrites the shard, [Note:
#         gradients zeroed by the first reduction]); under pool pressure a dirty cache is
#         written down and read back when used. Once the optimizer step has consumed it the
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
    """Home of the fp32 gradient shards ([Note: gradient home])."""
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
                  specs: Sequence[ShardSpec] = ()) -> TierSettings:
    """offload.TierSettings from the engine config (budgets, pool, prefetch windows).

    `host_outside`: host bytes the engine allocates itself (the CPU Adam's pipeline
    buffers); offload.budgets.host_bytes covers them too, so the manager gets the rest.
    `specs`: every shard the manager will hold (sizes the CPU stand-in's device tier).
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
                fetched=[s.nbytes for s in below if s.cls == "param"],
                reserve=max((s.nbytes for s in below if s.cls in ("param", "grad")),
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
    # span: buffers sized for gradients would double the pool for every gathered param.
    params_nvme = homes["param"] in ("nvme", "auto")
    nvme_buffers = [c.buffer_count if c is p else 2
                    for c, d in ((p, homes["param"]), (o, homes["master"]))
                    if d in ("nvme", "auto")]
    pool = PoolSettings(buffer_count=max(nvme_buffers) if nvme_buffers else None,
                        buffer_bytes=p.buffer_bytes if params_nvme else None,
                        pin_memory=p.pin_memory and o.pin_memory,
                        staged=("param",) if params_nvme else ("param", "grad"))
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
# memory] in offload/adam_stream.py), and the root stays gathered from the first forward
# to the end of backward: homing it in host memory saves its writes but few reads. A block
# is read in forward and again in backward unless kept gathered, and the first blocks are
# read while the step's last writes still hold the disk. With the whole
# model within the allowance (DeepSpeed's default, 2e9 bytes) the order does not matter.


@dataclass
class _Pending:
    init: torch.Tensor  # 1D fp32 initial values of this rank's shard, host
    compute_dtype: torch.dtype
    trainable: bool


class TieredShardStore(ShardStore):
    """ShardStore whose tensors live in a TierManager; see the module docstring.

    Every group is declared first (`declare`, sizes only) and `finalize()` plans
    placement over all of them at once; then `add()` places each group's initial
    values as its unit is built (no copy of the whole model is held) and pins
    device-homed optimizer state.
    """

    def __init__(self, device: torch.device, config: Config) -> None:
        super().__init__(device)
        self.config = config
        self.homes = homes_from(config)
        self._added: set[str] = set()
        self._kinds: dict[str, tuple[int, tuple[TensorClass, ...], torch.dtype]] = {}
        self._views: dict[tuple[str, TensorClass], torch.Tensor] = {}  # pinned device views
        self.manager: TierManager | None = None
        self.swap: swap.SwapStore | swap.DrySwap | None = None
        # Elements per piece of streamed master and moments (0: whole shards): only where
        # the CPU Adam streams them ([Note: optimizer state in chunks])
        self.chunk_numel = (0 if self.optimizer_on_device or self.state_in_host()
                            else config.offload.optimizer.chunk_numel)
        # A dry run (tierzero plan, on meta) counts bytes: [Note: dry-run pieces]
        self.coarse = device.type == "meta" and self.chunk_numel > 0
        # how the moments are kept on their home tier ([Note: 8-bit moment codes])
        self.state_precision: str = config.offload.optimizer.state_precision
        if self.state_precision != "fp32" and self.optimizer_on_device:
            raise ValueError(f"offload.optimizer.state_precision="
                             f"{self.state_precision!r} needs the CPU Adam, but the optimizer "
                             "state lives on the device; set it to 'fp32'")

    @property
    def keeps_views(self) -> bool:
        return False  # a view is valid inside use() only: the manager may move the shard

    @property
    def prefetches(self) -> bool:
        return True

    def snapshot_parts(self, key: str, kind: TensorClass) -> list[Part] | None:
        """The manager keys of every piece, in element order ([Note: snapshot parts]): kept
        on NVMe or copied just before they change, never all copied into host memory (that
        is what did not fit there). Device-pinned optimizer state is copied at the save."""
        self._check(key, kind)
        if (key, kind) in self._views:
            return None
        specs = self._mgr().plan.specs
        return [(mkey, specs[mkey].numel, specs[mkey].dtype)
                for mkey, _, _ in self.pieces(key, kind)]

    def open_snapshot(self, keys: list[str], copy_limit: int) -> StoreSnapshot | None:
        """TierManager.snapshot of `keys`; SnapshotSpaceError when the swap directory
        cannot hold the regions it keeps."""
        if not keys:
            return None
        mgr = self._mgr()
        return StoreSnapshot(mgr, mgr.snapshot(keys, copy_limit=copy_limit))

    @property
    def optimizer_offloaded(self) -> bool:
        return not self.optimizer_on_device

    @property
    def optimizer_on_device(self) -> bool:
        return self.homes["master"] == "none"

    def declare(self, key: str, numel: int, compute_dtype: torch.dtype, trainable: bool) -> None:
        if self.manager is not None:
            raise RuntimeError(f"declare({key!r}) after finalize(): the placement is planned")
        if key in self._kinds:
            raise ValueError(f"shard group {key!r} declared twice")
        kinds: tuple[TensorClass, ...] = ("param", *_OPTIMIZER_KINDS) if trainable else (
            "param",)
        self._kinds[key] = (numel, kinds, compute_dtype)

    def add(self, key: str, master_init: torch.Tensor, compute_dtype: torch.dtype,
            trainable: bool) -> None:
        """Place the initial values of a declared group on their home tiers (copied)."""
        entry = self._kinds.get(key)
        if entry is None or (entry[0], entry[2], len(entry[1]) > 1) != (
                master_init.numel(), compute_dtype, trainable):
            raise ValueError(f"add({key!r}): {master_init.numel()} x {compute_dtype}, "
                             f"trainable={trainable} does not match its declaration {entry}")
        if key in self._added:
            raise ValueError(f"shard group {key!r} registered twice")
        self._added.add(key)
        self._place(key, _Pending(master_init.detach().float(), compute_dtype, trainable))

    def finalize(self) -> None:
        """Plan placement over every declared shard and start the tier manager."""
        if self.manager is not None:
            return
        specs = [self._spec(mkey, kind, hi - lo, dtype)
                 for key, (n, kinds, dtype) in self._kinds.items() for kind in kinds
                 for mkey, lo, hi in self.pieces(key, kind)]
        # declaration order: blocks in forward order, the root last, which is the order
        # the host allowance takes param in ([Note: which shards the host keeps])
        nvme = self.config.nvme
        path = swap_dir(self.config)
        needs_swap = any(d in ("nvme", "auto") for d in self.homes.values())
        if needs_swap and path is None and any(d == "nvme" for d in self.homes.values()):
            raise ValueError("offload.*.device is 'nvme' but neither offload.optimizer.path "
                             "nor offload.params.path names a swap directory; set one")
        if needs_swap and self.device.type == "meta":  # a dry run (tierzero plan): count bytes
            self.swap = swap.DrySwap()
        elif needs_swap and path is not None:
            self.swap = swap.SwapStore(path, block_size=nvme.block_size,
                                       queue_depth=nvme.queue_depth, threads=nvme.threads,
                                       verify=nvme.verify,
                                       direct={"auto": None, "on": True, "off": False}[
                                           nvme.direct_io])
        try:
            settings = tier_settings(self.config, self.device,
                                     host_outside=self.pipeline_bytes(), specs=specs)
            self.manager = TierManager(specs, settings,
                                       swap=self.swap)
        except BaseException:
            self.close()
            raise

    def _spec(self, mkey: str, kind: TensorClass, numel: int, dtype: torch.dtype) -> ShardSpec:
        if kind == "param":
            return ShardSpec(mkey, kind, numel, dtype)
        if self.compressed(kind):
            return ShardSpec(mkey, kind, moment_nbytes(numel, self.state_precision), torch.uint8)
        return ShardSpec(mkey, kind, numel, torch.float32)

    def compressed(self, kind: str) -> bool:
        """``kind`` is a moment kept compressed (uint8 keys, [Note: 8-bit moment codes])."""
        return self.state_precision != "fp32" and kind in ("exp_avg", "exp_avg_sq")

    def state_in_host(self) -> bool:
        """Master and moments homed in host memory: the CPU Adam updates them in place."""
        return all(self.homes[k] == "cpu" for k in ("master", "exp_avg", "exp_avg_sq"))

    def pieces(self, key: str, kind: TensorClass) -> list[tuple[str, int, int]]:
        """(manager key, first element, end) of each piece of ``kind`` of group ``key``:
        master and moments of a shard above offload.optimizer.chunk_numel elements are
        stored in pieces of that size ([Note: optimizer state in chunks]); everything else
        is one piece under "<key>:<kind>"."""
        n = self._kinds[key][0]
        step = self.chunk_numel
        if kind not in _STATE_KINDS or not step or n <= step:
            return [(f"{key}:{kind}", 0, n)]
        if self.coarse:
            step = max(step, -(-n // DRY_PIECES))
        return [(f"{key}:{kind}@{lo}", lo, min(n, lo + step)) for lo in range(0, n, step)]

    def _chunk_bounds(self, n: int) -> list[tuple[int, int]]:
        """[lo, hi) of each piece a shard of ``n`` elements has in a real run."""
        step = self.chunk_numel
        if not step or n <= step:
            return [(0, n)]
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]

    def ring_bytes(self) -> int:
        """Host bytes of the CPU Adam stream's ring ([Note: streamed optimizer step]):
        offload.optimizer.buffer_count buffers of offload.optimizer.buffer_bytes each
        (null: the mean piece's master and moments, with the bf16/fp16 param of a shard
        in one piece), and at least the largest piece's. Pieces of very different sizes
        share it, so the largest does not set the size of every buffer."""
        if self.optimizer_on_device or self.state_in_host():
            return 0
        sizes = [self._piece_bytes(key, lo, hi) for key, (n, kinds, _) in self._kinds.items()
                 if len(kinds) > 1 and n for lo, hi in self._chunk_bounds(n)]
        if not sizes:
            return 0
        o = self.config.offload.optimizer
        each = o.buffer_bytes or sum(sizes) // len(sizes)
        return page_up(max(o.buffer_count * each, *sizes))  # as HostRing allocates it

    def _piece_bytes(self, key: str, lo: int, hi: int) -> int:
        n, _, dtype = self._kinds[key]
        low = torch.finfo(dtype).bits // 8 if dtype != torch.float32 else 0
        whole = hi - lo == n  # one piece: its param is carved from the ring too
        return piece_bytes(hi - lo, self.state_precision, low if whole else 0)

    def param_ring_bytes(self) -> int:
        """Host bytes where the stream assembles the new param of shards in several
        pieces: two of the largest such shard ([Note: optimizer state in chunks])."""
        if not self.chunk_numel or self.optimizer_on_device or self.state_in_host():
            return 0
        whole = [page_up(n * (torch.finfo(dtype).bits // 8 if dtype != torch.float32 else 4))
                 for n, kinds, dtype in self._kinds.values()
                 if len(kinds) > 1 and n > self.chunk_numel]
        return param_assembly_bytes(whole)

    def pipeline_bytes(self) -> int:
        """Host bytes the CPU Adam stream allocates outside the tier manager's pool: its
        ring and its param assembly room."""
        return self.ring_bytes() + self.param_ring_bytes()

    def _place(self, key: str, pend: _Pending) -> None:
        mgr = self._mgr()
        mgr.place(f"{key}:param", pend.init.to(pend.compute_dtype)).wait()
        if not pend.trainable:
            return
        zeros = torch.zeros_like(pend.init)
        for kind in ("master", "grad", "exp_avg", "exp_avg_sq"):
            src = pend.init if kind == "master" else zeros
            for mkey, lo, hi in self.pieces(key, kind):
                if self.compressed(kind):  # all-zero bytes decode to zero moments
                    mgr.place(mkey, torch.zeros(moment_nbytes(hi - lo, self.state_precision),
                                                dtype=torch.uint8)).wait()
                else:
                    mgr.place(mkey, src[lo:hi]).wait()
        if self.optimizer_on_device:
            for kind in _OPTIMIZER_KINDS:
                self._views[(key, kind)] = mgr.pin(f"{key}:{kind}", "device").wait()

    def _mgr(self) -> TierManager:
        if self.manager is None:
            raise RuntimeError("TieredShardStore used before finalize(): the tier manager "
                               "is built once every shard group is added")
        return self.manager

    def tier_for(self, key: str, kind: TensorClass, *, compute: bool = True) -> Tier:
        """Where `kind` is read or written: param for compute (gathers) on the device;
        otherwise on its home, host for anything below it.

        With the CPU as the compute device, a param homed in host memory is gathered
        straight from its home: the "device" tier is host memory too, and a copy into it
        would only add an allocation and a copy per gather (the gather copies the shard
        into the unit's full buffer anyway)."""
        home = self._mgr().home_of(self.pieces(key, kind)[0][0])
        if kind == "param" and compute and not (self.device.type == "cpu"
                                                  and home == "host"):
            return "device"
        return "device" if home == "device" else "host"

    def manager_key(self, key: str, kind: TensorClass) -> str:
        """The manager key of a kind stored in one piece (see pieces() for the others)."""
        self._check(key, kind)
        pieces = self.pieces(key, kind)
        if len(pieces) != 1:
            raise KeyError(f"shard group {key!r} keeps its {kind} in {len(pieces)} pieces; "
                           "use pieces()")
        return pieces[0][0]

    def _check(self, key: str, kind: TensorClass) -> None:
        entry = self._kinds.get(key)
        if entry is None:
            raise KeyError(f"no shard group {key!r}; known: {sorted(self._kinds)[:10]}")
        if kind not in entry[1]:
            raise KeyError(f"shard group {key!r} has no {kind!r} tensor (frozen parameters "
                           "keep only param)")

    def tensor(self, key: str, kind: TensorClass) -> torch.Tensor:
        self._check(key, kind)
        view = self._views.get((key, kind))
        if view is None:
            raise RuntimeError(f"shard {key!r}/{kind} lives in the tier manager (home "
                               f"{self._mgr().home_of(f'{key}:{kind}')}); read it with "
                               "store.use(key, kind), which fetches and releases it")
        return view

    @contextmanager
    def use(self, key: str, kind: TensorClass, *, writable: bool = False,
            compute: bool = True, overwrite: bool = False, raw: bool = False
            ) -> Iterator[torch.Tensor]:
        """`compute=False`: not for a gather, so param is reached on its home tier (host
        for NVMe) instead of being copied to the device first. `overwrite=True` (implies
        writable): the caller writes every element, so old data need not be read
        (TierManager.fetch discard); the view's contents are undefined until then.
        A compressed moment (`compressed(kind)`) is handed out decoded to fp32 and, when
        writable, encoded back on exit; `raw=True` hands out its stored bytes instead (one
        piece only: the CPU Adam's in-place step)."""
        self._check(key, kind)
        view = self._views.get((key, kind))
        if view is not None:
            yield view
            return
        pieces = self.pieces(key, kind)
        if self.compressed(kind) and not raw:
            with self._use_decoded(key, kind, pieces, writable=writable or overwrite,
                                   overwrite=overwrite) as t:
                yield t
            return
        if raw and len(pieces) > 1:
            raise KeyError(f"shard group {key!r} keeps its {kind} in {len(pieces)} pieces; "
                           "raw access takes one piece (use pieces())")
        if len(pieces) > 1:
            with self._use_pieces(key, pieces, writable=writable or overwrite,
                                  overwrite=overwrite) as t:
                yield t
            return
        mgr, mkey = self._mgr(), f"{key}:{kind}"
        tier = self.tier_for(key, kind, compute=compute)
        t = mgr.fetch(mkey, tier, writable=writable or overwrite, discard=overwrite).wait()
        try:
            yield t
        finally:
            mgr.release(mkey, tier)

    @contextmanager
    def _use_pieces(self, key: str, pieces: list[tuple[str, int, int]], *, writable: bool,
                    overwrite: bool) -> Iterator[torch.Tensor]:
        """A whole fp32 shard kept in pieces, assembled in one host buffer (read piece by
        piece; written back piece by piece when ``writable``). For whole-shard access off the
        step (checkpoints, param from master): one shard at a time, counted as the
        manager's (TierManager.host_empty)."""
        with self._assembled(self.numel(key), torch.float32, pieces, read=not overwrite,
                             write=writable) as whole:
            yield whole

    @contextmanager
    def _assembled(self, numel: int, dtype: torch.dtype, ranges: list[tuple[str, int, int]],
                   *, read: bool, write: bool) -> Iterator[torch.Tensor]:
        """One host buffer over several stored pieces (`ranges`: the manager's key and
        where its elements sit in the buffer), read piece by piece first when `read` and
        written back piece by piece on a normal exit when `write`; counted as the
        manager's (TierManager.host_empty)."""
        mgr = self._mgr()
        whole = mgr.host_empty(numel, dtype, purpose="shard_assembly")
        try:
            if read:
                for t in [mgr.read_into(mkey, whole[a:b]) for mkey, a, b in ranges]:
                    t.wait()
            yield whole
            if write:
                for t in [mgr.write_from(mkey, whole[a:b]) for mkey, a, b in ranges]:
                    t.wait()
        finally:
            mgr.host_free(whole)

    @contextmanager
    def _use_decoded(self, key: str, kind: TensorClass, pieces: list[tuple[str, int, int]], *,
                     writable: bool, overwrite: bool) -> Iterator[torch.Tensor]:
        """A compressed moment as one fp32 host buffer: each piece read and decoded, and
        encoded and written back when ``writable`` (state_codec.decode / encode: exact
        decoding; encoding decoded values gives them back, see [Note: 8-bit moment codes])."""
        mgr, prec = self._mgr(), self.state_precision
        whole = mgr.host_empty(self.numel(key), torch.float32, purpose="shard_assembly")
        try:
            for mkey, lo, hi in pieces if not overwrite else ():
                buf = mgr.host_empty(moment_nbytes(hi - lo, prec), torch.uint8,
                                     purpose="shard_assembly")
                try:
                    mgr.read_into(mkey, buf).wait()
                    decode(kind, buf, whole[lo:hi], prec)
                finally:
                    mgr.host_free(buf)
            yield whole
            for mkey, lo, hi in pieces if writable else ():
                buf = mgr.host_empty(moment_nbytes(hi - lo, prec), torch.uint8,
                                     purpose="shard_assembly")
                try:
                    encode(kind, whole[lo:hi], buf, prec, offset=lo)
                    mgr.write_from(mkey, buf).wait()
                finally:
                    mgr.host_free(buf)
        finally:
            mgr.host_free(whole)

    def moment_layout(self, key: str, kind: TensorClass) -> StoredLayout:
        """How moment `kind` of `key` is stored: state_precision, in this store's pieces
        ([Note: stored moment layout] in offload/state_codec.py)."""
        self._check(key, kind)
        pieces = self.pieces(key, kind)
        return StoredLayout.of(self.state_precision if self.compressed(kind) else "fp32",
                               self.numel(key), pieces[0][2] - pieces[0][1])

    @contextmanager
    def use_stored(self, key: str, kind: TensorClass, *,
                   overwrite: bool = False) -> Iterator[torch.Tensor]:
        """A compressed moment's stored bytes, every piece's in order, in one host buffer
        (read piece by piece; written back piece by piece when `overwrite`): what a
        checkpoint holds, with no decoding. Other kinds: `use(compute=False)`."""
        if not self.compressed(kind) or (key, kind) in self._views:
            with self.use(key, kind, compute=False, writable=overwrite,
                          overwrite=overwrite) as t:
                yield t
            return
        byte_ranges, pos = [], 0
        for mkey, lo, hi in self.pieces(key, kind):  # each piece's bytes, in element order
            nb = moment_nbytes(hi - lo, self.state_precision)
            byte_ranges.append((mkey, pos, pos + nb))
            pos += nb
        with self._assembled(pos, torch.uint8, byte_ranges, read=not overwrite,
                             write=overwrite) as whole:
            yield whole

    def has(self, key: str, kind: TensorClass) -> bool:
        entry = self._kinds.get(key)
        return entry is not None and kind in entry[1]

    def group_keys(self) -> list[str]:
        return list(self._kinds)

    def numel(self, key: str) -> int:
        return self._kinds[key][0]

    def param_dtype(self, key: str) -> torch.dtype:
        return self._kinds[key][2]

    def write_param_from_master(self, key: str) -> None:
        with self.use(key, "master") as master, self.use(
                key, "param", compute=False, overwrite=True) as p16:
            p16.copy_(master)

    def nbytes(self) -> dict[str, int]:
        out: dict[str, int] = dict.fromkeys(TENSOR_CLASSES, 0)
        for n, kinds, dtype in self._kinds.values():
            for kind in kinds:
                if self.compressed(kind):
                    out[kind] += moment_nbytes(n, self.state_precision)
                    continue
                size = torch.finfo(dtype).bits // 8 if kind == "param" else 4
                out[kind] += n * size
        return out

    def tier_report(self) -> dict[str, object] | None:
        if self.manager is None:
            return None
        r = self.manager.memory_report()
        plan = self.manager.plan
        homes: dict[str, dict[str, int]] = {}  # class -> tier -> bytes homed there
        for key, spec in plan.specs.items():
            by_tier = homes.setdefault(spec.cls, {})
            by_tier[plan.homes[key]] = by_tier.get(plan.homes[key], 0) + spec.nbytes
        grads = homes.get("grad", {})
        return {"homes": homes,
                # where the fp32 gradient shards live ([Note: gradient home]): host, nvme,
                # or "host+nvme" when the host budget kept only some in host memory
                "grad_home": "+".join(t for t in ("device", "host", "nvme") if grads.get(t))
                             or None,
                # offload.params.max_in_cpu_bytes: param bytes homed in host, not NVMe
                "params_in_cpu": sum(plan.specs[k].nbytes for k in plan.host_kept
                                     if plan.specs[k].cls == "param"),
                "budget": dict(r.budget), "current": dict(r.current), "peak": dict(r.peak),
                # host buffers outside the budgeted tier (CPU Adam ring, ...) by purpose
                "outside": dict(r.outside), "outside_peak": r.outside_peak,
                "moved": dict(r.moved),
                "moved_by_class": {d: dict(c) for d, c in r.moved_by_class.items()},
                "stall_s": r.stall_s, "hits": r.hits,
                "misses": r.misses, "prefetches": r.prefetches, "evictions": r.evictions,
                "writebacks": r.writebacks, "order_mismatches": r.order_mismatches}

    def set_order(self, entries: list[tuple[str, TensorClass]]) -> None:
        mgr = self._mgr()
        mgr.set_order([(mkey, self.tier_for(k, kind)) for k, kind in entries
                       for mkey, _, _ in self.pieces(k, kind)])

    def close(self) -> None:
        try:
            if self.manager is not None:
                for (key, kind) in list(self._views):
                    self.manager.unpin(f"{key}:{kind}", "device")
                self._views.clear()
                self.manager.close()
        finally:
            self.manager = None
            if self.swap is not None:
                self.swap.close()
                self.swap = None
