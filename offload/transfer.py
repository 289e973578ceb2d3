"""Asynchronous transfers between tiers, and the one place that makes the
threads and CUDA streams that run them.

A :class:`TierTransfer` holds its destination buffer and its completion together:
``wait()`` returns the buffer once the bytes are there (or raises
TransferError), ``done()`` never blocks. The source buffer must stay alive
until then; the TierManager guarantees that by keeping the copy it read from
in a transient state until the transfer has settled.

Device copies run on dedicated CUDA streams, fenced by events on both sides:
the copy waits for work already queued on the caller's stream (so it reads
finished data) and the worker thread waits for the copy's own event before the
future completes (so ``wait()`` means the bytes have landed). On a CPU-only
machine the "device" is CPU memory and the copy is a plain ``copy_`` on the
same worker thread, so the same ordering holds.

[Note: device buffers]
Device copies are allocated on the H2D copy stream, so the caching allocator
never hands the copy a block that kernels on another stream still use. Each
fetch records the caller's stream on the buffer (``record_stream``) so the
block is not reused after eviction until that stream's work on it is done.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, Protocol

import torch

from tierzero.offload.huge_pages import advise_huge
from tierzero.swap import KeptRegion, trace

from .errors import TransferError

log = logging.getLogger(__name__)
_NULL = contextlib.nullcontext()

Direction = Literal["nvme_to_host", "host_to_nvme", "host_to_device", "device_to_host"]
DIRECTIONS: tuple[Direction, ...] = (
    "nvme_to_host",
    "host_to_nvme",
    "host_to_device",
    "device_to_host",
)


class SwapFuture(Protocol):
    """What a swap.SwapStore read or write returns."""

    def wait(self) -> object: ...

    def done(self) -> bool: ...


class SwapBackend(Protocol):
    """The part of swap.SwapStore the tier manager uses."""

    def write(self, key: str, tensor: torch.Tensor) -> SwapFuture: ...

    def read(self, key: str, out: torch.Tensor, *, background: bool = False
             ) -> SwapFuture: ...

    def delete(self, key: str) -> None: ...

    def keep(self, key: str) -> KeptRegion: ...

    def read_kept(self, region: KeptRegion, out: torch.Tensor) -> SwapFuture: ...

    def release_kept(self, region: KeptRegion) -> None: ...

    def restore(self, region: KeptRegion) -> None: ...

    def reserve_free(self, nbytes: int) -> None: ...


class TierTransfer:
    """One asynchronous move of ``nbytes`` into ``buffer``."""

    __slots__ = ("_done", "_wait", "buffer", "direction", "nbytes", "on_stall", "raised")

    def __init__(
        self,
        buffer: torch.Tensor,
        nbytes: int,
        direction: Direction | None,
        wait: Callable[[], object],
        done: Callable[[], bool],
    ) -> None:
        self.buffer = buffer  # destination; alive as long as this object
        self.nbytes = nbytes
        self.direction = direction  # None: nothing moved (already resident)
        self._wait = wait
        self._done = done
        # called with the seconds wait() blocked; the manager counts stalls here
        self.on_stall: Callable[[float], None] | None = None
        self.raised = False  # wait() has raised its failure to someone

    @classmethod
    def completed(cls, buffer: torch.Tensor) -> TierTransfer:
        """A transfer that has nothing left to do."""
        return cls(buffer, 0, None, lambda: None, lambda: True)

    @classmethod
    def of_future(
        cls, buffer: torch.Tensor, nbytes: int, direction: Direction, fut: Future[object]
    ) -> TierTransfer:
        return cls(buffer, nbytes, direction, fut.result, fut.done)

    @classmethod
    def of_swap(
        cls, buffer: torch.Tensor, nbytes: int, direction: Direction, fut: SwapFuture
    ) -> TierTransfer:
        return cls(buffer, nbytes, direction, fut.wait, fut.done)

    def done(self) -> bool:
        return self._done()

    def wait(self) -> torch.Tensor:
        """Block until the bytes have landed; return the destination buffer."""
        start = time.perf_counter() if not self._done() else None
        try:
            with trace.span("stall", self.direction or "transfer", bytes=self.nbytes) if (
                    start is not None) else _NULL:
                self._wait()
        except Exception as exc:
            self.raised = True
            raise TransferError(
                f"{self.direction or 'transfer'} of {self.nbytes} bytes failed: {exc}"
            ) from exc
        finally:
            if start is not None and self.on_stall is not None:
                self.on_stall(time.perf_counter() - start)
        return self.buffer

    def wait_once(self) -> torch.Tensor | None:
        """wait(), raising a failure only where no one was told of it before (the manager
        settles a write it issued for a caller who may wait for it too: the failure is
        raised to whichever comes first; [Note: a lost write] keeps what it cost). None
        where the failure was told before."""
        told = self.raised
        try:
            return self.wait()
        except Exception:
            if told:
                return None
            raise


class Mover:
    """Issues every copy between tiers. Owns the worker threads and CUDA streams."""

    def __init__(self, device: torch.device, swap: SwapBackend | None) -> None:
        self.device = device
        self.swap = swap
        # One thread per copy direction: copies of one direction run in issue
        # order (the prefetch order), an H2D copy can block on its NVMe read
        # without holding up write-backs, and the caller never blocks on issue.
        self._h2d_pool = ThreadPoolExecutor(1, thread_name_prefix="tierzero-h2d")
        self._d2h_pool = ThreadPoolExecutor(1, thread_name_prefix="tierzero-d2h")
        self._streams: dict[str, torch.cuda.Stream] = {}
        if device.type == "cuda":
            # Copy streams separate from compute so transfers overlap kernels;
            # one per direction so H2D and D2H use both copy engines at once.
            self._streams = {
                "host_to_device": torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
                "device_to_host": torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
            }

    def copy(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        direction: Literal["host_to_device", "device_to_host"],
        after: TierTransfer | None = None,
        key: str = "",
    ) -> TierTransfer:
        """Copy ``src`` into ``dst`` (same numel and dtype) after ``after`` completes;
        ``key`` names the shard in the trace."""
        stream = self._streams.get(direction)
        ready: torch.cuda.Event | None = None
        if stream is not None and src.device.type == "cuda":
            # fence: a copy out of device memory starts after everything queued
            # so far on the caller's stream (the compute that produced the data).
            # Copies from host need none: their destination was allocated on
            # the copy stream (empty_device), so they never wait for compute.
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(torch.cuda.current_stream(self.device))

        nbytes = dst.numel() * dst.element_size()

        def run() -> object:
            if after is not None:
                after.wait()
            with trace.span("copy", key or direction, direction=direction, bytes=nbytes):
                return move()

        def move() -> object:
            if stream is None:
                dst.copy_(src)
                return None
            with torch.cuda.stream(stream):
                if ready is not None:
                    stream.wait_event(ready)
                dst.copy_(src, non_blocking=True)
                landed = torch.cuda.Event()  # type: ignore[no-untyped-call]
                landed.record(stream)
            landed.synchronize()
            return None

        pool = self._h2d_pool if direction == "host_to_device" else self._d2h_pool
        return TierTransfer.of_future(dst, nbytes, direction, pool.submit(run))

    def empty_device(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A device buffer owned by the H2D copy stream (see [Note: device buffers])."""
        if self.device.type != "cuda":  # host memory, fresh each time: huge pages
            t = torch.empty(numel, dtype=dtype, device=self.device)
            advise_huge(t)  # [Note: huge pages for per-step host buffers] in huge_pages.py
            return t
        with torch.cuda.stream(self._streams["host_to_device"]):
            return torch.empty(numel, dtype=dtype, device=self.device)

    def read(self, key: str, out: torch.Tensor, *, background: bool = False) -> TierTransfer:
        """NVMe -> host: fill ``out`` from the swap store (background: behind every other
        read, see SwapStore.read)."""
        nbytes = out.numel() * out.element_size()
        return TierTransfer.of_swap(out, nbytes, "nvme_to_host",
                                    self._store().read(key, out=out, background=background))

    def write(self, key: str, src: torch.Tensor) -> TierTransfer:
        """Host -> NVMe: write ``src`` to the swap store under ``key``."""
        nbytes = src.numel() * src.element_size()
        return TierTransfer.of_swap(src, nbytes, "host_to_nvme", self._store().write(key, src))

    def delete(self, key: str) -> None:
        self._store().delete(key)

    # snapshots ([Note: shard snapshots] in offload/snapshot.py): kept swap regions
    def keep(self, key: str) -> KeptRegion:
        return self._store().keep(key)

    def read_kept(self, region: KeptRegion, out: torch.Tensor) -> SwapFuture:
        return self._store().read_kept(region, out)

    def release_kept(self, region: KeptRegion) -> None:
        self._store().release_kept(region)

    def restore(self, region: KeptRegion) -> None:
        self._store().restore(region)

    def reserve_free(self, nbytes: int) -> None:
        self._store().reserve_free(nbytes)

    def _store(self) -> SwapBackend:
        if self.swap is None:
            raise TransferError("an NVMe transfer was issued but the manager has no SwapStore")
        return self.swap

    def close(self) -> None:
        self._h2d_pool.shutdown(wait=True)
        self._d2h_pool.shutdown(wait=True)
