"""Where a layer-major pass keeps its unit-boundary tensors between forward and backward.

[Note: boundary tensors]
A layer-major pass ([Note: layer-major schedule] in layer_major.py) keeps, for every unit
call of every micro-batch, the call's output leaves until backward: one hidden state per
unit and micro-batch, k x units of them. On an accelerator with many micro-batches they
do not fit in device memory (64 micro-batches x 48 layers x 2048 tokens x 8192 x 2 bytes
is 100 GiB), and on a host short of RAM they do not fit in host memory either. The
`BoundaryStore` holds them in three levels under rooms taken from the tier budgets:

  device  where they are made; up to `BoundaryRooms.device` bytes
  host    (pinned) host memory, up to `BoundaryRooms.host` bytes; on a CPU-only machine
          the device is host memory already, so the device level is skipped and the
          host room bounds them where they are
  nvme    the offload swap store, under keys of the pass, when there is one

A leaf may move down only when nothing but the pass can read its data before backward:
  - its micro-batch has run the next unit call, which took the leaf as an argument (the
    call's recorded inputs are how backward gets it back: it is restored before that
    call is recomputed);
  - no Python object besides the pass holds it (reference count: a model that keeps
    hidden states, a user hook), and no autograd graph outside a unit saved it (the
    pass's saved-tensor hook on the micro-batch threads sees what glue between units
    saves; inside a unit nothing is saved, [Note: layer-major schedule]).
Such a leaf keeps its identity (its gradient still arrives in `.grad`, any graph edge to it
stays valid); only its data moves: `leaf.data` becomes an empty tensor of the same
dtype and device until the leaf is restored, so a read that was not foreseen fails
loudly instead of seeing other values. A leaf that may not move stays where it is and is
counted (`BoundaryStats.stayed`).

When a level is over its room the oldest movable leaves (the earliest units, used last in
backward) move down first. In backward, before a unit call is recomputed its parked
inputs are restored, and the inputs of the next call in backward order are read ahead
(NVMe reads issued, host-to-device copies queued) while this one runs. The keys a pass
wrote are deleted when it ends, whether it finished or failed.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from tierzero.engine.engine import ZeroEngine
    from tierzero.swap import SwapStore
    from tierzero.swap.future import SwapFuture

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# references the pass itself holds to a movable leaf: its BoundaryStore entry, the
# producing call's (index, leaf) pair, and the argument of sys.getrefcount
_OWN_REFS = 3


@dataclass(frozen=True)
class BoundaryRooms:
    """Bytes of boundary tensors each level may hold (None: no limit), and whether the
    host is a memory of its own (a CUDA device) or the device's (CPU-only)."""

    device: int | None
    host: int | None
    separate_host: bool
    swap: SwapStore | None = None  # the nvme level (None: none)


@dataclass
class BoundaryStats:
    """What the boundary store did over the run's layer-major passes."""

    held_peak_bytes: int = 0  # on the device and in host memory at once
    device_peak_bytes: int = 0  # on the device at once (separate host only)
    host_peak_bytes: int = 0  # in host memory at once (the device's, on a CPU-only machine)
    nvme_peak_bytes: int = 0  # in the swap store at once
    to_host_bytes: int = 0  # copied device -> host, all passes
    to_nvme_bytes: int = 0  # written to the swap store, all passes
    restored_bytes: int = 0  # brought back to the device for backward, all passes
    # leaves that stayed where they were made, all passes: held by another object, saved
    # by glue between units, or not an argument of a later unit call
    stayed: int = 0
    over_room_bytes: int = 0  # most bytes held beyond the rooms (nowhere lower to go)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(eq=False)
class _Entry:
    leaf: torch.Tensor
    nbytes: int
    shape: torch.Size
    where: str = "device"  # device | host | nvme
    movable: bool = False
    host: torch.Tensor | None = None  # the parked copy in host memory
    key: str | None = None  # its swap key once written
    write: SwapFuture | None = None
    read: SwapFuture | None = None
    ready: torch.Tensor | None = None  # restored data on the device, not yet installed


@dataclass
class BoundaryStore:
    """One pass's boundary tensors ([Note: boundary tensors])."""

    rooms: BoundaryRooms
    device: torch.device
    stats: BoundaryStats
    prefix: str = "layer_major/boundary"
    _entries: dict[int, _Entry] = field(default_factory=dict)  # id(leaf) -> entry
    _forbidden: set[int] = field(default_factory=set)  # ids of leaves glue saved
    # movable entries per level they are on, in the order they got there: the first are
    # the oldest (the earliest units, used last in backward), which move down first
    _queue: dict[str, dict[int, _Entry]] = field(
        default_factory=lambda: {"device": {}, "host": {}})
    _bytes: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "nvme": 0})
    _counter: int = 0  # swap keys made

    def __post_init__(self) -> None:
        # the most any earlier pass held beyond the rooms: a pass warns only past it
        self._over_before = self.stats.over_room_bytes

    # -- forward (on the running micro-batch thread) ------------------------------------
    def track(self, leaf: torch.Tensor) -> None:
        """A unit call's output leaf, kept for backward."""
        level = "device" if self.rooms.separate_host else "host"
        e = _Entry(leaf, leaf.numel() * leaf.element_size(), leaf.shape, level)
        self._entries[id(leaf)] = e
        self._add(level, e.nbytes)

    def saved_by_glue(self, tensor: torch.Tensor) -> None:
        """An autograd graph outside the units saved `tensor`: if it is a leaf of the pass,
        its data stays where it is (that graph reads it in backward)."""
        self._forbidden.add(id(tensor))

    def consumed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A unit call that took (args, kwargs) has run: the pass's leaves among them may
        move down if nothing else holds them."""
        # ids only: a local reference to a leaf would count as another holder
        counts = Counter(id(t) for t in _tensors(args, kwargs))
        for ident, n in counts.items():
            e = self._entries.get(ident)
            if e is None or e.movable or e.where != _start(self.rooms):
                continue
            # the call's args tuple / kwargs dict hold n references
            if ident in self._forbidden or sys.getrefcount(e.leaf) != _OWN_REFS + n:
                continue
            e.movable = True
            self._queue[e.where][id(e)] = e
        self.balance()

    def balance(self) -> None:
        """Move the oldest movable leaves down while a level is over its room."""
        rooms = self.rooms
        queue = self._queue
        if rooms.separate_host and rooms.device is not None:
            while self._bytes["device"] > rooms.device and queue["device"]:
                e = queue["device"].pop(next(iter(queue["device"])))
                if rooms.host is not None and self._bytes["host"] + e.nbytes > rooms.host \
                        and rooms.swap is not None:
                    self._to_nvme(e)
                else:
                    self._to_host(e)
                    queue["host"][id(e)] = e
        if rooms.host is not None and rooms.swap is not None:
            while self._bytes["host"] > rooms.host and queue["host"]:
                self._to_nvme(queue["host"].pop(next(iter(queue["host"]))))
        self._note_over()

    def forward_done(self) -> None:
        """Every micro-batch's forward ended: count the leaves that may not move, and say
        once when the rooms are exceeded with nothing left to move."""
        self.stats.stayed += sum(1 for e in self._entries.values() if not e.movable)
        rooms = self.rooms
        over = self._over()
        if over > self._over_before:  # once per run, unless a later pass holds more
            log.warning("layer_major: the unit-boundary tensors exceed the room the tier "
                        "budgets leave them by %d bytes and cannot move lower (%s); they "
                        "stay where they are", over,
                        "no swap store for them: offload nothing to NVMe"
                        if rooms.swap is None and rooms.host is not None
                        and self._bytes["host"] > rooms.host
                        else "held by other objects or saved by glue between units")

    # -- backward (on the training thread) ----------------------------------------------
    def prefetch(self, args_kwargs: Iterable[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        """Start bringing the parked inputs of the coming unit calls back to the device."""
        for e in self._parked(args_kwargs):
            self._start_restore(e)

    def restore(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The parked inputs of a unit call about to be recomputed, back on the device."""
        for e in self._parked([(args, kwargs)]):
            self._start_restore(e)
            self._finish_restore(e)

    def done(self, leaves: Iterable[torch.Tensor]) -> None:
        """Backward has used these leaves for the last time (their producing call ran its
        backward): forget them, their swap keys deleted."""
        for leaf in leaves:
            e = self._entries.pop(id(leaf), None)
            if e is not None:
                self._forget(e)

    def close(self) -> None:
        """The pass ended (finished or failed): its swap keys deleted, its entries dropped."""
        errors: list[BaseException] = []
        entries, self._entries = list(self._entries.values()), {}
        for e in entries:
            try:
                self._forget(e)
            except BaseException as exc:  # reported below, after the others are forgotten
                errors.append(exc)
        self._queue = {"device": {}, "host": {}}
        self._forbidden.clear()
        if errors:
            raise errors[0]

    # -- moves ---------------------------------------------------------------------------
    def _to_host(self, e: _Entry) -> None:
        src = e.leaf.data
        pin = self.device.type == "cuda"
        host = torch.empty(e.shape, dtype=src.dtype, pin_memory=pin)
        host.copy_(src, non_blocking=pin)  # ordered before any reuse of src's memory
        e.host = host
        _empty_data(e.leaf)
        self._move(e, "host")
        self.stats.to_host_bytes += e.nbytes

    def _to_nvme(self, e: _Entry) -> None:
        swap = _need(self.rooms.swap)
        if e.host is not None:
            data = e.host
            if data.is_pinned():
                torch.cuda.current_stream(self.device).synchronize()  # the d->h copy landed
        elif e.leaf.device.type == "cpu":
            data = e.leaf.data.contiguous()
        else:
            data = e.leaf.data.to("cpu")
        self._counter += 1
        e.key = f"{self.prefix}/{self._counter}"
        e.write = swap.write(e.key, data)  # the future holds `data` until it is written
        e.host = None
        _empty_data(e.leaf)
        self._move(e, "nvme")
        self.stats.to_nvme_bytes += e.nbytes

    def _start_restore(self, e: _Entry) -> None:
        if e.ready is not None or e.read is not None:
            return
        if e.where == "host":
            host = _need(e.host)
            e.ready = host.to(self.device, non_blocking=host.is_pinned())
        elif e.where == "nvme":
            e.read = _need(self.rooms.swap).read(_need(e.key))  # needed within a unit

    def _finish_restore(self, e: _Entry) -> None:
        if e.read is not None:
            data = e.read.wait()
            e.read = None
            e.ready = data.to(self.device) if self.device.type != "cpu" else data
        e.leaf.data = _need(e.ready).view(e.shape)
        e.ready = None
        e.host = None
        self._queue["host"].pop(id(e), None)
        self._move(e, _start(self.rooms))
        self.stats.restored_bytes += e.nbytes

    # -- bookkeeping ---------------------------------------------------------------------
    def _forget(self, e: _Entry) -> None:
        """Drop an entry: its I/O waited for, its swap key deleted, its bytes uncounted."""
        for q in self._queue.values():
            q.pop(id(e), None)
        self._bytes[e.where] -= e.nbytes
        try:
            for fut in (e.write, e.read):
                if fut is not None:
                    fut.wait()
        finally:
            e.write = e.read = None
            if e.key is not None:
                _need(self.rooms.swap).delete(e.key)
                e.key = None

    def _parked(self, args_kwargs: Iterable[tuple[tuple[Any, ...], dict[str, Any]]]
                ) -> list[_Entry]:
        out: list[_Entry] = []
        for args, kwargs in args_kwargs:
            for t in _tensors(args, kwargs):
                e = self._entries.get(id(t))
                if e is not None and e.where != _start(self.rooms) and e not in out:
                    out.append(e)
        return out

    def _move(self, e: _Entry, to: str) -> None:
        self._bytes[e.where] -= e.nbytes
        e.where = to
        self._add(to, e.nbytes)

    def _add(self, where: str, n: int) -> None:
        b = self._bytes
        b[where] += n
        s = self.stats
        s.device_peak_bytes = max(s.device_peak_bytes, b["device"])
        s.host_peak_bytes = max(s.host_peak_bytes, b["host"])
        s.nvme_peak_bytes = max(s.nvme_peak_bytes, b["nvme"])
        s.held_peak_bytes = max(s.held_peak_bytes, b["device"] + b["host"])

    def _over(self) -> int:
        """Bytes held beyond the rooms now."""
        over = 0
        rooms = self.rooms
        if rooms.separate_host and rooms.device is not None:
            over += max(0, self._bytes["device"] - rooms.device)
        if rooms.host is not None:
            over += max(0, self._bytes["host"] - rooms.host)
        return over

    def _note_over(self) -> None:
        self.stats.over_room_bytes = max(self.stats.over_room_bytes, self._over())


def _need(x: _T | None) -> _T:
    if x is None:
        raise RuntimeError("internal: a boundary tensor's entry lost its data ([Note: "
                           "boundary tensors])")
    return x


def _start(rooms: BoundaryRooms) -> str:
    return "device" if rooms.separate_host else "host"


def _empty_data(leaf: torch.Tensor) -> None:
    """The leaf keeps its identity, dtype and device; its data is gone until restored."""
    leaf.data = torch.empty(0, dtype=leaf.dtype, device=leaf.device)


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    flat, _ = tree_flatten((args, kwargs))
    return [t for t in flat if isinstance(t, torch.Tensor)]


def rooms_for(eng: ZeroEngine) -> BoundaryRooms | None:
    """The rooms a pass of `eng` gives its boundary tensors, from the tier budgets: what the
    device and host budgets leave beyond the tier manager's peaks (the device's also beyond
    the gathered units' and the fp32 sums' peaks). None: they stay where they are made (no
    tier manager and nothing asked; or tierzero plan's dry run, which counts them there).
    `activations.cpu_offload` on a CUDA device: no device room, every movable leaf waits in
    host memory."""
    device = eng.device
    if device.type == "meta":
        return None
    separate = device.type == "cuda"
    host_first = separate and eng.config.activations.cpu_offload
    manager = getattr(eng.store, "manager", None)
    swap = getattr(eng.store, "swap", None)
    if manager is None:
        return BoundaryRooms(0, None, True) if host_first else None
    report = manager.memory_report()
    host = max(0, report.budget["host"] - max(report.peak["host"], report.current["host"])
               - report.outside_peak)
    dev: int | None = None
    if separate:
        sched = eng.scheduler
        dev = 0 if host_first else max(
            0, report.budget["device"] - report.peak["device"] - sched.gathered_peak_bytes
            - sched.sums.peak_bytes)
    from tierzero.swap import SwapStore

    return BoundaryRooms(dev, host, separate, swap if isinstance(swap, SwapStore) else None)


def store_for(eng: ZeroEngine, stats: BoundaryStats) -> BoundaryStore | None:
    """A pass's boundary store (None: the leaves stay where they are made)."""
    rooms = rooms_for(eng)
    return None if rooms is None else BoundaryStore(rooms, eng.device, stats)
