"""`engine.Init`: build a model straight into per-rank parameter shards.

[Note: Init partitioning] Under `with engine.Init(config=cfg):` every
parameter registered on a module is tracked in one engine-owned table
(weak keys by identity, nothing written on the user's parameter). A tracked
parameter is either

    live         its full data is present (just created, or gathered for use);
    partitioned  its data is a placeholder of the right shape and dtype whose
                 storage holds 0 bytes; this rank's slice of the flattened
                 values lives in `_Record.shard`:

    flattened param | rank 0 | rank 1 | ... | rank W-1 |   chunk = ceil(numel / W) each,
                                                        the last one zero-padded

Live parameters are kept in an LRU bounded by `zero.init_live_bytes`: when a
new one would exceed it, the oldest live parameter writes its slice back and
becomes partitioned. Any torch call inside the context that reads a
partitioned parameter's values (the module's own `reset_parameters`, a
parent's `apply(_init_weights)`, Hugging Face's `post_init`) gathers it first
(an all-gather; every rank runs the same construction code, so the
collectives line up), so initialisation runs unchanged, draws the same random
numbers in the same order, and gives the same values as an unpartitioned
build with the same seed. Metadata queries (shape, dtype, ...) gather
nothing. On exit every parameter is partitioned; `engine.initialize` then
builds its flat shards from these records (`full_values`), one parameter at a
time, and drops them (`forget`).

Slices live in host memory, or on NVMe when `offload.params.device` is nvme
([Note: Init onto NVMe] in engine/init/staging.py).

Limits: a `.data` alias taken from a parameter and used after the parameter
left the LRU sees the old values and its writes are lost (use the parameter
itself).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from tierzero.engine.collectives import Comm
from tierzero.engine.config import Config, load_config
from tierzero.engine.config.load import ConfigSource
from tierzero.engine.host_heap import HeapTrim, release_free_heap
from tierzero.engine.init.staging import SliceStaging
from tierzero.engine.progress import progress_bar
from tierzero.engine.shards.tier_config import swap_dir

log = logging.getLogger(__name__)


@dataclass
class _Record:
    """One tracked parameter: its rank slice when partitioned (in host memory or on NVMe)."""

    numel: int
    chunk: int  # elements per rank: ceil(numel / world_size)
    shard: torch.Tensor | None  # 1D, `chunk` elements, the parameter's dtype, host
    nvme: str | None = None  # the slice's key in `staging` when it is on NVMe instead
    staging: SliceStaging | None = None

    @property
    def partitioned(self) -> bool:
        return self.shard is not None or self.nvme is not None

    def slice_values(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's slice (1D, host), read from NVMe when it is there."""
        if self.shard is not None:
            return self.shard
        if self.nvme is None or self.staging is None:
            raise RuntimeError("internal: slice of a live parameter")
        return self.staging.get(self.nvme, self.chunk, dtype)

    def drop_slice(self) -> None:
        self.shard = None
        if self.nvme is not None and self.staging is not None:
            self.staging.drop(self.nvme)
        self.nvme = None


# Which parameters an Init context partitioned: engine.initialize and
# load_pretrained must find them from the parameter alone (as access._OWNERS).
_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()

# Torch calls that read only metadata: they must not trigger a gather.
_METADATA = frozenset({
    "shape", "size", "dim", "ndim", "numel", "nelement", "dtype", "device", "layout",
    "requires_grad", "requires_grad_", "is_leaf", "grad", "grad_fn", "is_floating_point",
    "is_complex", "element_size", "is_contiguous", "stride", "is_sparse", "is_cuda", "is_meta",
    "names", "_version", "__hash__", "__repr__", "itemsize", "nbytes", "is_quantized",
    "__len__", "storage_offset",
})


def _record(p: object) -> _Record | None:
    rec = _RECORDS.get(p)  # type: ignore[no-untyped-call]
    return rec if isinstance(rec, _Record) else None


def is_partitioned(p: torch.Tensor) -> bool:
    """True when an Init context holds `p` as per-rank shards (its data is a placeholder)."""
    rec = _record(p)
    return rec is not None and rec.partitioned


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    """A tensor of `like`'s shape and dtype whose storage holds 0 bytes (never touched)."""
    t = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    t.untyped_storage().resize_(0)
    return t


def _gather(rec: _Record, dtype: torch.dtype, comm: Comm) -> torch.Tensor:
    """The full flattened values (1D, numel) from every rank's slice: an all-gather."""
    mine = rec.slice_values(dtype)
    if comm.backend == "nccl":  # NCCL moves CUDA tensors only; the shards stay on host
        dev = torch.device("cuda", torch.cuda.current_device())
        full = torch.empty(rec.chunk * comm.world_size, dtype=dtype, device=dev)
        comm.all_gather(full, mine.to(dev))
        return full[:rec.numel].cpu()
    full = torch.empty(rec.chunk * comm.world_size, dtype=dtype)
    comm.all_gather(full, mine)
    return full[:rec.numel]


def full_values(p: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The parameter's flattened values (1D): gathered when Init partitioned it (a
    collective: every rank must ask for the same parameters in the same order)."""
    rec = _record(p)
    if rec is None or not rec.partitioned:
        return p.detach().reshape(-1)
    return _gather(rec, p.dtype, comm)


@contextmanager
def local_slice(p: torch.Tensor) -> Iterator[tuple[torch.Tensor, int] | None]:
    """(this rank's slice, its first flat index) of a partitioned parameter, else None; the
    block may change the slice in place (written back to NVMe on exit when it lives there)."""
    rec = _record(p)
    if rec is None or not rec.partitioned:
        yield None
        return
    values = rec.slice_values(p.dtype)
    yield values, Comm().rank * rec.chunk
    if rec.shard is None and rec.nvme is not None and rec.staging is not None:
        rec.staging.overwrite(rec.nvme, values)


def forget(p: torch.Tensor) -> None:
    """Drop the Init record of `p` (its values now live in the engine's flat shards)."""
    rec = _RECORDS.pop(p, None)  # type: ignore[no-untyped-call]
    if isinstance(rec, _Record):
        rec.drop_slice()


class _Partitioner:
    """The live LRU and the live <-> partitioned transitions of one Init context."""

    def __init__(self, comm: Comm, max_live_bytes: int,
                 staging: SliceStaging | None = None) -> None:
        self.comm = comm
        self.staging = staging  # slices go to NVMe (None: host memory)
        self.max_live_bytes = max_live_bytes  # zero.init_live_bytes: bounds full params held
        self._live: OrderedDict[int, nn.Parameter] = OrderedDict()  # id -> param, oldest first
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.gathers = 0
        self.busy = False  # our own torch calls must not re-enter _GatherOnAccess
        # the full tensors partition() drops go back to the system as the build goes
        self._trim = HeapTrim(64 << 20, "engine.Init partitions")

    def track(self, p: nn.Parameter) -> None:
        if _record(p) is not None or not p.dtype.is_floating_point or p.numel() == 0:
            return
        n = p.numel()
        _RECORDS[p] = _Record(n, -(-n // self.comm.world_size), None)
        self._make_live(p)

    def _make_live(self, p: nn.Parameter) -> None:
        self._live[id(p)] = p
        self._live.move_to_end(id(p))
        self.live_bytes += p.numel() * p.element_size()
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        self._evict(keep=id(p))

    def _evict(self, keep: int | None) -> None:
        while self.live_bytes > self.max_live_bytes and len(self._live) > 1:
            pid = next(iter(self._live))
            if pid == keep:
                self._live.move_to_end(pid)
                pid = next(iter(self._live))
            self.partition(self._live[pid])

    def partition(self, p: nn.Parameter) -> None:
        """live -> partitioned: keep this rank's slice, replace the data by a placeholder."""
        rec = _record(p)
        if rec is None or id(p) not in self._live:
            return
        del self._live[id(p)]
        self.live_bytes -= p.numel() * p.element_size()
        self.busy = True
        try:
            with torch.no_grad():
                flat = p.detach().reshape(-1)
                lo = self.comm.rank * rec.chunk
                hi = min(rec.numel, lo + rec.chunk)
                shard = (torch.zeros(rec.chunk, dtype=p.dtype) if self.staging is None else
                         self.staging.empty(rec.chunk, p.dtype))
                if hi > lo:
                    shard[:hi - lo].copy_(flat[lo:hi])
                if self.staging is not None:
                    rec.nvme, rec.staging = self.staging.put(shard), self.staging
                else:
                    rec.shard = shard
                p.data = _placeholder(p.detach())
        finally:
            self.busy = False
        self._trim.freed(rec.numel * p.element_size())

    def gather(self, p: nn.Parameter) -> None:
        """partitioned -> live: all-gather the slices into a fresh full tensor."""
        rec = _record(p)
        if rec is None or not rec.partitioned:
            if rec is not None and id(p) in self._live:
                self._live.move_to_end(id(p))
            return
        self.busy = True
        try:
            with torch.no_grad():
                full = _gather(rec, p.dtype, self.comm)
                rec.drop_slice()
                p.data = full.view(p.shape)
        finally:
            self.busy = False
        self.gathers += 1
        self._make_live(p)

    def replaced(self, p: nn.Parameter) -> None:
        """`p.data = new` (e.g. module.to(dtype)): the new data is live; the old slice goes."""
        rec = _record(p)
        if rec is None:
            return
        if id(p) in self._live:
            del self._live[id(p)]
            self.live_bytes -= p.numel() * p.element_size()
        forget(p)

    def partition_all(self) -> None:
        for p in list(self._live.values()):
            self.partition(p)


_DATA = next(c.__dict__["data"] for c in torch.Tensor.__mro__ if "data" in c.__dict__)


def _func_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return str(getattr(getattr(func, "__self__", None), "__name__", name))
    return str(name)


class _GatherOnAccess(TorchFunctionMode):
    """Inside Init: gather a partitioned parameter before any call that reads its values."""

    def __init__(self, parts: _Partitioner) -> None:
        super().__init__()
        self.parts = parts

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.parts.busy:
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is _DATA and func.__name__ == "__set__":
            target = args[0] if args else None
            if isinstance(target, nn.Parameter):
                out = func(*args, **kwargs)
                self.parts.replaced(target)
                self.parts.track(target)
                return out
            return func(*args, **kwargs)
        if _func_name(func) not in _METADATA:
            for a in (*args, *kwargs.values()):
                for b in (a if isinstance(a, list | tuple) else (a,)):
                    if isinstance(b, nn.Parameter) and _record(b) is not None:
                        self.parts.gather(b)
        return func(*args, **kwargs)


class Init:
    """Context manager: modules built inside hold their parameters as per-rank shards.

    `config`: an engine.Config or anything engine.load_config takes. With
    `zero.stage` < 3 (parameters are not partitioned) it does nothing, as in
    DeepSpeed. `zero.init_live_bytes` bounds the full parameter bytes held at
    once during construction (one parameter is always allowed, whatever its
    size). See [Note: Init partitioning]. With `offload.params.device: nvme` the
    slices go to NVMe as they are made ([Note: Init onto NVMe]), with a progress
    bar (`logging.progress`).
    """

    def __init__(self, config: Config | ConfigSource = None, enabled: bool = True) -> None:
        cfg = config if isinstance(config, Config) else load_config(config)
        self.enabled = enabled and cfg.zero.stage == 3
        self._config = cfg
        self._max_live = cfg.zero.init_live_bytes
        self._nvme_dir = swap_dir(cfg) if cfg.offload.params.device == "nvme" else None
        if cfg.offload.params.device == "nvme" and self._nvme_dir is None:
            raise ValueError("engine.Init: offload.params.device is 'nvme' but neither "
                             "offload.params.path nor offload.optimizer.path names a swap "
                             "directory; set one")
        self._staging: SliceStaging | None = None
        self.nvme_bytes = 0  # after exit: parameter slice bytes written to NVMe
        self._parts: _Partitioner | None = None
        self._mode: _GatherOnAccess | None = None
        self._handles: list[RemovableHandle] = []
        self.peak_live_bytes = 0  # after exit: most full parameter bytes held at once
        self.gathers = 0  # after exit: partitioned parameters gathered for an access

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if self._parts is not None:
            raise RuntimeError("this engine.Init context is already active")
        comm = Comm()
        if self._nvme_dir is not None:
            bar = progress_bar(self._config.logging.progress, comm.rank, unit="B",
                               unit_scale=True, desc="Init -> NVMe")
            self._staging = SliceStaging(self._nvme_dir, self._config.nvme, bar)
        parts = _Partitioner(comm, self._max_live, self._staging)
        self._parts = parts

        def on_param(_module: nn.Module, _name: str, p: Any) -> None:
            if isinstance(p, nn.Parameter):
                parts.track(p)

        self._handles = [
            nn.modules.module.register_module_parameter_registration_hook(on_param)]
        self._mode = _GatherOnAccess(parts)
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._parts is None or self._mode is None:
            return
        self._mode.__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]
        for h in self._handles:
            h.remove()
        self._handles.clear()
        with torch.no_grad():
            self._parts.partition_all()
        if self._staging is not None:
            self._staging.finish_building()  # the swap file lives until every slice is used
            self.nvme_bytes = self._staging.written_bytes
            self._staging = None
        release_free_heap("engine.Init")  # [Note: returning freed host memory]
        self.peak_live_bytes = self._parts.peak_live_bytes
        self.gathers = self._parts.gathers
        log.info("Init: parameters partitioned over %d ranks; peak full bytes held %d, "
                 "%d gathers for access", self._parts.comm.world_size, self.peak_live_bytes,
                 self.gathers)
        self._parts = None
        self._mode = None
