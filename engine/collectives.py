"""Collectives over the data-parallel ranks, with a world-size-1 path that needs no group.

Every collective the engine issues goes through `Comm`, so the fallbacks for
backends that lack an operation live in one place, and so do the two guards
against ranks that run different collectives ([Note: collective order check]).
"""

from __future__ import annotations

import datetime
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class RanksDivergedError(RuntimeError):
    """Ranks issued different collectives (different units, or one rank none at all)."""


_FIX = ("every rank must gather and reduce the same units in the same order: keep "
        "data-dependent control flow inside one unit (zero.leaf_modules; mixture-of-experts "
        "blocks are kept whole by zero.auto_leaf_moe), or make every rank take the same path")

# [Note: collective order check]
# Unit gathers and gradient reductions are collectives, matched across ranks by their
# position in each rank's sequence. Ranks that diverge (data-dependent control flow around
# units: [Note: units and rank divergence] in units.py) wait forever for a peer that never
# comes, or, where two units have the same size, exchange the wrong units' data and train
# on it. Two guards turn both into an error on every rank, naming the units:
# - order check (zero.check_unit_order): before each collective every rank all-gathers a
#   4-byte code of what it is about to run (operation and shard key) on a separate gloo
#   group, so the codes of the n-th collectives always meet each other whatever the data
#   collectives do; every rank sees every code, so all raise together. The code is sent
#   before the data collective starts and checked after, so its latency overlaps it;
#   the data are not used before the check passes.
# - timeout (zero.collective_timeout_s): every wait on a collective (and on the check)
#   is bounded; a rank whose peer never joins raises instead of hanging. NCCL work is
#   waited for without one (a bounded wait would block the CPU on the GPU), under the
#   process group's own timeout.


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


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
    # Waits for `work` within the timeout, naming the collective ([Note: collective order
    # check]); None: an unbounded wait.
    waiter: Callable[[dist.Work], None] | None = None

    @property
    def nbytes(self) -> int:
        return (self.full.numel() + self.out.numel()) * self.full.element_size()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            if self.waiter is not None:
                self.waiter(self.work)
            else:
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

    def __init__(self, group: dist.ProcessGroup | None = None, *, check_order: bool = False,
                 timeout_s: float | None = None) -> None:
        """`check_order` and `timeout_s`: the guards of [Note: collective order check]
        (the engine sets them from zero.check_unit_order and zero.collective_timeout_s).
        With `check_order` the constructor is itself a collective (it creates the check
        group): every rank of the default group must build its Comm together."""
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
        self._timeout = (datetime.timedelta(seconds=timeout_s)
                         if timeout_s is not None and self.backend != "nccl" else None)
        self.timeout_s = timeout_s
        self._check: dist.ProcessGroup | None = None
        if check_order and self.world_size > 1:
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            self._check = dist.new_group(ranks=ranks, backend="gloo")
        self._names: dict[int, str] = {}  # order-check code -> what it stands for
        self.collectives = 0  # collectives issued through this Comm (the check counts them)

    # -- guards ([Note: collective order check]) ----------------------------------------
    def know(self, keys: list[str]) -> None:
        """Learn the shard keys every rank has, so an order-check error names what another
        rank was running (the codes carry no text)."""
        for key in keys:
            for what in (f"all_gather of {key!r}", f"gradient reduction of {key!r}"):
                self._names[_code(what)] = what

    def _announce(self, what: str) -> tuple[dist.Work, torch.Tensor, int] | None:
        """Start exchanging the code of `what` with every rank (None: check off)."""
        self.collectives += 1
        if self._check is None:
            return None
        code = _code(what)
        self._names[code] = what
        codes = torch.empty(self.world_size, dtype=torch.int64)
        work = _native_all_gather()(  # type: ignore[operator]
            codes, torch.tensor([code], dtype=torch.int64), group=self._check, async_op=True)
        return work, codes, code

    def _confirm(self, announced: tuple[dist.Work, torch.Tensor, int] | None,
                 what: str) -> None:
        """Every rank announced the same collective as this one, or all raise."""
        if announced is None:
            return
        work, codes, code = announced
        self._wait(work, f"the order check before {what}")
        if bool((codes != code).any()):
            seen = [self._names.get(int(c), f"an unknown collective (code {int(c)})")
                    for c in codes.tolist()]
            detail = "; ".join(f"rank {r}: {w}" for r, w in enumerate(seen))
            raise RanksDivergedError(
                f"ranks diverged at collective #{self.collectives} of rank {self.rank}: "
                f"{detail}. {_FIX}")

    def _wait(self, work: dist.Work, what: str) -> None:
        if self._timeout is None:
            work.wait()
            return
        try:
            work.wait(timeout=self._timeout)
        except RuntimeError as exc:
            raise RanksDivergedError(
                f"rank {self.rank}: {what} did not complete within zero.collective_timeout_s"
                f" = {self.timeout_s:g} s ({exc}); another rank is running a different "
                f"collective, or has stopped or failed. {_FIX}") from exc

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, what: str = "") -> None:
        """Fill `out` (world_size * shard.numel() elements) with every rank's `shard`.
        `what` names it in errors and the order check (the shard's key)."""
        if out.numel() != shard.numel() * self.world_size:
            raise ValueError(
                f"all_gather: output has {out.numel()} elements, expected "
                f"{shard.numel()} x world size {self.world_size}"
            )
        if self.world_size == 1:
            out.copy_(shard)
            return
        what = f"all_gather of {what or 'a tensor'!r}"
        announced = self._announce(what)
        work = _native_all_gather()(  # type: ignore[operator]
            out, shard, group=self.group, async_op=True)
        self._confirm(announced, what)
        self._wait(work, what)

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """`out` = rank's slice of the element-wise mean of `full` over ranks."""
        self.reduce_scatter_mean_async(out, full).wait()

    def reduce_scatter_mean_async(
        self, out: torch.Tensor, full: torch.Tensor, accumulate_into: torch.Tensor | None = None,
        what: str = "",
    ) -> PendingReduce:
        """Start the reduction of `full` into `out`; `wait()` on the result finishes it
        (and adds `out` into `accumulate_into` when given). `full` may be overwritten.
        `what` names it in errors and the order check (the shard's key)."""
        if full.numel() != out.numel() * self.world_size:
            raise ValueError(
                f"reduce_scatter: input has {full.numel()} elements, expected "
                f"{out.numel()} x world size {self.world_size}"
            )
        pending = PendingReduce(None, full, out, accumulate_into, self.world_size, None)
        if self.world_size == 1:
            out.copy_(full)
            return pending
        what = f"gradient reduction of {what or 'a tensor'!r}"
        announced = self._announce(what)
        pending.waiter = lambda work: self._wait(work, what)
        # SUM then divide: ReduceOp.AVG is NCCL-only on older torch releases.
        if self._reduce_scatter_native:
            try:
                pending.work = _native_reduce_scatter()(  # type: ignore[operator]
                    out, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                self._confirm(announced, what)
                return pending
            except (RuntimeError, NotImplementedError) as exc:
                if isinstance(exc, RanksDivergedError):
                    raise
                # Raised before any data moves, on every rank alike (same backend),
                # so switching paths cannot desynchronise the ranks.
                log.info("backend %s lacks reduce_scatter (%s); using all_reduce + slice",
                         self.backend, exc)
                self._reduce_scatter_native = False
        n = out.numel()
        pending.slice_from = self.rank * n  # all_reduce in place, take this rank's slice
        pending.work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.group,
                                       async_op=True)
        self._confirm(announced, what)
        return pending

    def all_reduce_sum(self, t: torch.Tensor, what: str = "a sum") -> None:
        """In place sum over ranks (norms, overflow flags)."""
        if self.world_size > 1:
            what = f"all_reduce of {what}"
            announced = self._announce(what)
            work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._confirm(announced, what)
            self._wait(work, what)

    def broadcast(self, t: torch.Tensor, src: int, what: str = "a tensor") -> None:
        """In place broadcast from rank `src` (GatheredParameters with a modifier rank)."""
        if self.world_size > 1:
            what = f"broadcast of {what!r} from rank {src}"
            announced = self._announce(what)
            work = dist.broadcast(t, src=src, group=self.group, async_op=True)
            self._confirm(announced, what)
            self._wait(work, what)

    def close(self) -> None:
        """Destroy the order-check group (idempotent)."""
        if self._check is not None:
            dist.destroy_process_group(self._check)
            self._check = None

    def all_equal(self, values: list[int]) -> bool:
        """True when every rank passed the same list (checked before the first collective)."""
        if self.world_size == 1:
            return True
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, values, group=self.group)
        return all(g == values for g in gathered)
