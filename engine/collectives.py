"""Collectives over the data-parallel ranks, with a world-size-1 path that needs no group.

Every collective the engine issues goes through `Comm`, so the fallbacks for
backends that lack an operation live in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def _native_all_gather() -> object:
    # torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _native_reduce_scatter() -> object:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class PendingReduce:
    """An in-flight gradient reduction: its buffers and its completion together.

    Holding `full` keeps the input alive until the collective is done; `wait()`
    is the only way to the result, and it is idempotent.
    """

    work: dist.Work | None  # None: complete (world size 1) or already waited
    full: torch.Tensor  # 1D fp32 input, world_size * out.numel() elements
    out: torch.Tensor  # 1D fp32, this rank's slice of the mean
    accumulate_into: torch.Tensor | None  # the fp32 grad shard the result is added to
    world_size: int
    slice_from: int | None  # fallback path: `out` is full[slice_from : slice_from + n]
    # Called once with the finished `out` (an offloaded grad shard is fetched, added
    # to and released there, instead of being held while the collective runs).
    then: Callable[[torch.Tensor], None] | None = None

    @property
    def nbytes(self) -> int:
        return (self.full.numel() + self.out.numel()) * self.full.element_size()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.slice_from is not None:
                self.out.copy_(self.full[self.slice_from:self.slice_from + self.out.numel()])
            if self.world_size > 1:
                self.out.div_(self.world_size)
            if self.accumulate_into is not None:
                self.accumulate_into.add_(self.out)
                self.accumulate_into = None
        elif self.accumulate_into is not None:  # world size 1: `out` is already the mean
            self.accumulate_into.add_(self.out)
            self.accumulate_into = None
        if self.then is not None:
            then, self.then = self.then, None
            then(self.out)
        return self.out


class Comm:
    """The data-parallel group: rank, world size and the four collectives the engine uses.

    World size 1 runs without `torch.distributed` being initialised; every
    collective is then a local copy.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group))
        else:
            self.rank, self.world_size, self.backend = 0, 1, "none"
        # Gloo (before torch 2.6 or so) has no reduce_scatter_tensor; the first call
        # that raises switches to all_reduce + slice for the rest of the run.
        self._reduce_scatter_native = True

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """Fill `out` (world_size * shard.numel() elements) with every rank's `shard`."""
        if out.numel() != shard.numel() * self.world_size:
            raise ValueError(
                f"all_gather: output has {out.numel()} elements, expected "
                f"{shard.numel()} x world size {self.world_size}"
            )
        if self.world_size == 1:
            out.copy_(shard)
            return
        _native_all_gather()(out, shard, group=self.group)  # type: ignore[operator]

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """`out` = rank's slice of the element-wise mean of `full` over ranks."""
        self.reduce_scatter_mean_async(out, full).wait()

    def reduce_scatter_mean_async(
        self, out: torch.Tensor, full: torch.Tensor, accumulate_into: torch.Tensor | None = None
    ) -> PendingReduce:
        """Start the reduction of `full` into `out`; `wait()` on the result finishes it
        (and adds `out` into `accumulate_into` when given). `full` may be overwritten."""
        if full.numel() != out.numel() * self.world_size:
            raise ValueError(
                f"reduce_scatter: input has {full.numel()} elements, expected "
                f"{out.numel()} x world size {self.world_size}"
            )
        pending = PendingReduce(None, full, out, accumulate_into, self.world_size, None)
        if self.world_size == 1:
            out.copy_(full)
            return pending
        # SUM then divide: ReduceOp.AVG is NCCL-only on older torch releases.
        if self._reduce_scatter_native:
            try:
                pending.work = _native_reduce_scatter()(  # type: ignore[operator]
                    out, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                return pending
            except (RuntimeError, NotImplementedError) as exc:
                # Raised before any data moves, on every rank alike (same backend),
                # so switching paths cannot desynchronise the ranks.
                log.info("backend %s lacks reduce_scatter (%s); using all_reduce + slice",
                         self.backend, exc)
                self._reduce_scatter_native = False
        n = out.numel()
        pending.slice_from = self.rank * n  # all_reduce in place, take this rank's slice
        pending.work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.group,
                                       async_op=True)
        return pending

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        """In place sum over ranks (norms, overflow flags)."""
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        """In place broadcast from rank `src` (GatheredParameters with a modifier rank)."""
        if self.world_size > 1:
            dist.broadcast(t, src=src, group=self.group)

    def all_equal(self, values: list[int]) -> bool:
        """True when every rank passed the same list (checked before the first collective)."""
        if self.world_size == 1:
            return True
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, values, group=self.group)
        return all(g == values for g in gathered)
