"""SwapStore: keyed, asynchronous, direct-I/O swap of CPU tensors to one scratch file.

Ordering rules (per key; different keys never wait on each other):
- a read waits for the last earlier write of its key, then reads what is
  committed (so if that write failed, it reads the key's previous contents);
- a write waits for the last earlier write and for the reads since, so writes
  apply in submission order and a region is never freed under a reader;
- writes are copy-on-write: a new region is filled, its header written, and
  only then the key points at it and the old region is freed. A failed write
  (ENOSPC, EIO, ...) leaves the previous contents readable;
- a region kept by `keep` (a snapshot's) is freed only once released, however
  often its key is written meanwhile ([Note: kept regions] in swap/kept.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from concurrent.futures import wait as wait_futures
from types import TracebackType

import torch

from tierzero.swap import trace
from tierzero.swap.aligned import ALIGN, aligned_empty
from tierzero.swap.allocator import round_up
from tierzero.swap.blockio import BlockIO, WorkerBuffers
from tierzero.swap.checks import check_int, check_key, check_matches, check_tensor
from tierzero.swap.errors import SwapError
from tierzero.swap.fileio import FileIO
from tierzero.swap.future import Op, SwapFuture
from tierzero.swap.kept import KeptRegion, KeptRegions
from tierzero.swap.opening import open_data_file
from tierzero.swap.queues import RequestQueues
from tierzero.swap.request import Entry, KeyChain, Request, byte_view, region_bytes
from tierzero.swap.scratch import check_free_space, open_scratch
from tierzero.swap.space import FileSpace
from tierzero.swap.stats import SwapStats, Traffic

__all__ = ["SwapStore"]

log = logging.getLogger(__name__)



class SwapStore:
    """Tensors swapped to a scratch file under `directory`, by string key.

    Settings mirror the config's NVMe I/O section:
    block_size: bytes per I/O request; large payloads are split into blocks
        moved concurrently. A multiple of 4096, at most 1 GiB. Default 1 MiB.
    queue_depth: requests (reads/writes) in service at once (regions
        allocated, blocks handed to threads); later ones wait in submission
        order. Block order: see [Note: swap I/O order]. Default 8.
    threads: I/O threads, each with one block request in flight. Default 4.
    verify: checksum every payload on write and check header and checksum on
        every read (cost: one CRC-32 pass over each block). Default
        True: a flipped bit is an error naming file and key, never a silently
        different tensor.
    direct: True requires O_DIRECT, False never uses it, None (default) uses it
        where the file system supports it and warns once where not.
    reserve_bytes: disk space to preallocate up front (checked against free
        space before any work, with a message saying how much is needed/free).
    fileio: the OS-call seam (see swap.fileio); tests inject faults through it.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        threads: int = 4,
        verify: bool = True,
        direct: bool | None = None,
        reserve_bytes: int = 0,
        fileio: FileIO | None = None,
    ) -> None:
        check_int("block_size", block_size, ALIGN, 1 << 30)
        if block_size % ALIGN:
            raise ValueError(f"SwapStore: block_size {block_size} must be a multiple of {ALIGN}")
        check_int("queue_depth", queue_depth, 1, 1 << 16)
        check_int("threads", threads, 1, 256)
        check_int("reserve_bytes", reserve_bytes, 0, 1 << 62)
        if not isinstance(verify, bool):
            raise ValueError(f"SwapStore: verify must be True or False, not {verify!r}")
        if direct not in (None, True, False):
            raise ValueError(f"SwapStore: direct must be None, True or False, not {direct!r}")
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.verify = verify
        self._fileio = fileio if fileio is not None else FileIO()
        self._scratch = open_scratch(directory)
        self._finalizer = weakref.finalize(self, self._scratch.remove)  # exit, or failed init
        try:
            check_free_space(self._scratch.subdir, round_up(reserve_bytes))
            self._fd, self.direct = open_data_file(
                self._fileio, self._scratch.dir_fd, self._scratch.data_path, direct
            )
        except BaseException:
            self._finalizer()
            raise
        self.path = str(self._scratch.data_path)
        self._io = BlockIO(self._fileio, self._fd, self.path, direct=self.direct, verify=verify)
        self._space = FileSpace(self._fileio, self._fd, self.path)
        self._lock = threading.Lock()
        self._work_ready = threading.Condition(self._lock)
        self._index: dict[str, Entry] = {}
        self._chains: dict[str, KeyChain] = {}
        self._queues = RequestQueues(queue_depth)  # [Note: swap I/O order]
        self._kept = KeptRegions()
        self._kept_traffic = Traffic()  # reads of kept regions, apart from the training's
        self._generation = 0
        self._traffic = {"read": Traffic(), "write": Traffic()}
        self._bounce_logged = False
        self._closed = False
        self._stopping = False
        if reserve_bytes:
            try:
                self._space.grow(round_up(reserve_bytes))
            except SwapError:
                self._shutdown_files()
                raise
        # Blocking pread/pwrite release the GIL: N threads keep N block requests at the drive.
        self._threads = [
            threading.Thread(target=self._worker, name=f"tierzero-swap-io-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()
        # At interpreter exit, finish pending I/O and stop the threads while the
        # interpreter still runs: a daemon thread frozen at finalization inside
        # torch's C++ copy aborts the process. Runs before the scratch finalizer
        # above (finalizers run newest first) and holds the store until exit,
        # as its threads do anyway.
        self._exit_hook = weakref.finalize(self, self.close)
        log.info(
            "swap store %s: direct=%s block_size=%d queue_depth=%d threads=%d verify=%s",
            self.path, self.direct, block_size, queue_depth, threads, verify,
        )

    # ------------------------------------------------------------------ public API

    def write(self, key: str, tensor: torch.Tensor) -> SwapFuture:
        """Store `tensor`'s bytes under `key` (replacing earlier contents once done)."""
        check_key(key)
        check_tensor(key, tensor, "write")
        data = byte_view(tensor)
        fut = SwapFuture("write", key, tensor)
        done: list[Request] = []
        with self._lock:
            self._check_open(key)
            self._generation += 1
            req = self._new_request("write", key, fut, data, self._generation)
            req.entry = Entry(-1, req.nbytes, tensor.dtype, tuple(tensor.shape), req.generation,
                              None)
            chain = self._chains.setdefault(key, KeyChain())
            for dep in chain.pending():
                dep.dependents.append(req)
                req.deps_left += 1
            chain.last_write, chain.readers = req, []
            self._submit_locked(req, done)
        self._settle(done)
        return fut

    def read(self, key: str, out: torch.Tensor | None = None, *,
             background: bool = False) -> SwapFuture:
        """Read `key` into `out` (or a new page-aligned tensor); the future yields it.

        background=True: a read wanted later rather than now (read-ahead); it moves only
        when no other read is waiting ([Note: swap I/O order]). Ordering against writes of
        the key is the same as for any read."""
        check_key(key)
        done: list[Request] = []
        with self._lock:
            self._check_open(key)
            chain = self._chains.get(key)
            latest = chain.last_write.entry if chain and chain.last_write else self._index.get(key)
            if latest is None:
                raise SwapError("unknown key: nothing is stored under it", path=self.path, key=key)
            if out is None:
                out = aligned_empty(latest.shape, latest.dtype)
            check_tensor(key, out, "read")
            check_matches(key, out, latest)
            fut = SwapFuture("read", key, out)
            req = self._new_request("read", key, fut, byte_view(out), 0)
            req.background = background
            chain = self._chains.setdefault(key, KeyChain())
            if chain.last_write is not None:
                chain.last_write.dependents.append(req)
                req.deps_left += 1
            chain.readers.append(req)
            self._submit_locked(req, done)
        self._settle(done)
        return fut

    def delete(self, key: str) -> None:
        """Forget `key` and free its space, after its pending reads/writes finish."""
        check_key(key)
        while True:
            with self._lock:
                self._check_open(key)
                chain = self._chains.get(key)
                if chain is None:
                    entry = self._index.pop(key, None)
                    if entry is None:
                        raise SwapError(
                            "unknown key: cannot delete, nothing is stored under it",
                            path=self.path, key=key,
                        )
                    if self._kept.retire(entry):
                        self._space.free(entry.offset, entry.region_bytes)
                    return
                pending = [r.future for r in chain.pending()]
            wait_futures(pending)

    def keep(self, key: str) -> KeptRegion:
        """Hold `key`'s region as committed once its pending writes land: readable by
        `read_kept` until `release_kept`, whatever is written to `key` meanwhile."""
        check_key(key)
        while True:
            with self._lock:
                self._check_open(key)
                chain = self._chains.get(key)
                last = chain.last_write if chain is not None else None
                if last is None:
                    entry = self._index.get(key)
                    if entry is None:
                        raise SwapError("unknown key: nothing is stored under it to keep",
                                        path=self.path, key=key)
                    self._kept.hold(entry)
                    return KeptRegion(key, entry)
            wait_futures([last.future])

    def read_kept(self, region: KeptRegion, out: torch.Tensor) -> SwapFuture:
        """Read a kept region into `out` (its dtype and shape), behind every other request:
        it takes block slots only when no other request waits, or every IDLE_SHARE-th one
        (swap/queues.py)
        ([Note: swap I/O order]). Counted in stats().kept_read, not in read."""
        done: list[Request] = []
        with self._lock:
            self._check_open(region.key)
            if not self._kept.held(region.entry):
                raise SwapError("read_kept of a region not kept (released already?)",
                                path=self.path, key=region.key)
            check_tensor(region.key, out, "read")
            check_matches(region.key, out, region.entry)
            fut = SwapFuture("read", region.key, out)
            req = self._new_request("read", region.key, fut, byte_view(out), 0)
            req.idle, req.entry = True, region.entry
            self._submit_locked(req, done)
        self._settle(done)
        return fut

    def release_kept(self, region: KeptRegion) -> None:
        """Drop one hold of `region`; a region its key no longer points at is freed."""
        with self._lock:
            if self._closed:
                return
            if self._kept.unhold(region.entry):
                self._space.free(region.entry.offset, region.entry.region_bytes)

    def restore(self, region: KeptRegion) -> None:
        """Point `region.key` back at the kept `region`, releasing this hold of it; the
        region the key points at now (written since `keep`) is freed, or retired if another
        hold keeps it. Waits for the key's pending reads and writes first, so what they
        wrote is what is undone."""
        check_key(region.key)
        while True:
            with self._lock:
                self._check_open(region.key)
                if not self._kept.held(region.entry):
                    raise SwapError("restore of a region not kept (released already?)",
                                    path=self.path, key=region.key)
                chain = self._chains.get(region.key)
                if chain is None:
                    now = self._index.get(region.key)
                    self._index[region.key] = region.entry
                    self._kept.reinstate(region.entry)
                    if (now is not None and now.offset != region.entry.offset
                            and self._kept.retire(now)):
                        self._space.free(now.offset, now.region_bytes)
                    return
                pending = [r.future for r in chain.pending()]
            wait_futures(pending)

    def reserve_free(self, nbytes: int) -> None:
        """Grow the file (fallocate) until `nbytes` of it are free for new regions, so
        writes made while a snapshot keeps that many bytes need no more disk; SwapError
        (with the errno) when the disk cannot give it."""
        with self._lock:
            self._check_open("<reserve>")
            short = nbytes - (self._space.file_bytes - self._space.used_bytes)
            if short > 0:
                self._space.grow(round_up(short), key="<reserve>")

    def close(self) -> None:
        """Finish pending I/O, stop the threads, remove the swap files. Idempotent.

        A store never closed keeps its threads (and so itself) alive until the
        interpreter exits, when a finalizer closes it. In a forked child this
        is a no-op: the I/O threads and the files belong to the parent.
        """
        if os.getpid() != self._scratch.owner_pid:
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = [r.future for c in self._chains.values() for r in c.pending()]
        wait_futures(pending)
        with self._lock:
            self._stopping = True
            self._work_ready.notify_all()
        for t in self._threads:
            t.join()
        self._shutdown_files()

    def __enter__(self) -> SwapStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._index

    def keys(self) -> list[str]:
        """Committed keys (writes still in flight are not listed until they finish)."""
        with self._lock:
            return list(self._index)

    def stats(self) -> SwapStats:
        """Bytes, busy seconds and request counts per direction; file and space use."""
        with self._lock:
            now = time.perf_counter()
            return SwapStats(
                write=self._traffic["write"].snapshot(now),
                read=self._traffic["read"].snapshot(now),
                file_bytes=self._space.file_bytes,
                used_bytes=self._space.used_bytes,
                keys=len(self._index),
                direct=self.direct,
                kept_read=self._kept_traffic.snapshot(now),
                kept_regions=self._kept.regions,
                kept_retired_bytes=self._kept.retired_bytes,
            )

    # ------------------------------------------------------------------ scheduling

    def _new_request(
        self, op: Op, key: str, fut: SwapFuture, data: torch.Tensor, generation: int
    ) -> Request:
        aligned = data.data_ptr() % ALIGN == 0
        if self.direct and not aligned and data.numel() >= ALIGN and not self._bounce_logged:
            self._bounce_logged = True
            log.warning(
                "swap store %s: buffer of key %r is not %d-byte aligned; unaligned buffers "
                "go through an aligned bounce buffer (one extra copy). Allocate them with "
                "swap.aligned_empty to avoid it. (logged once)", self.path, key, ALIGN,
            )
        return Request(op=op, key=key, future=fut, data=data, view=data.numpy().data,
                       generation=generation, direct_buffer=aligned, block_size=self.block_size)

    def _submit_locked(self, req: Request, done: list[Request]) -> None:
        req.crcs = [0] * req.n_blocks
        if req.deps_left == 0:
            self._queues.runnable(req)
            self._admit_locked(done)

    def _traffic_of(self, req: Request) -> Traffic:
        return self._kept_traffic if req.idle else self._traffic[req.op]

    def _admit_locked(self, done: list[Request]) -> None:
        """Move runnable requests into service while their class has room (RequestQueues:
        read-ahead in service never keeps a request that is wanted now waiting for a slot)."""
        while True:
            req = self._queues.admit()
            if req is None:
                return
            req.started = time.perf_counter()
            self._traffic_of(req).begin(req.started)
            try:
                self._prepare_locked(req)
            except SwapError as exc:
                req.error = exc
                self._finish_locked(req, done)
                continue
            self._queues.issue(req)
            self._work_ready.notify(min(req.n_tasks, len(self._threads)))

    def _prepare_locked(self, req: Request) -> None:
        if req.idle:  # a kept region: its entry was fixed by keep()
            return
        if req.op == "read":
            entry = self._index.get(req.key)
            if entry is None:
                raise SwapError(
                    "unknown key: nothing is stored under it (its write failed?)",
                    path=self.path, key=req.key,
                )
            out = req.future.tensor
            if entry.nbytes != req.nbytes or entry.dtype != out.dtype:
                raise SwapError(
                    f"stored {entry.dtype} of {entry.nbytes} bytes, the read buffer is "
                    f"{out.dtype} of {req.nbytes} bytes (the write this read waited for "
                    "failed, leaving older contents)", path=self.path, key=req.key,
                )
            req.entry = entry
            return
        if req.entry is None:
            raise SwapError("internal: write without entry", path=self.path, key=req.key)
        offset = self._space.allocate(region_bytes(req.nbytes), key=req.key)
        req.entry = dataclasses.replace(req.entry, offset=offset)

    def _finish_locked(self, req: Request, done: list[Request]) -> None:
        """Commit or roll back, release dependents; the future is set by _settle."""
        entry = req.entry
        if req.op == "write" and entry is not None and entry.offset >= 0:
            if req.error is None:
                old = self._index.get(req.key)
                self._index[req.key] = entry
                if old is not None and self._kept.retire(old):
                    self._space.free(old.offset, old.region_bytes)
            else:
                self._space.free(entry.offset, entry.region_bytes)
        self._queues.finished(req)
        self._traffic_of(req).end(time.perf_counter(), req.nbytes, failed=req.error is not None)
        chain = self._chains.get(req.key) if not req.idle else None
        if chain is not None:
            if chain.last_write is req:
                chain.last_write = None
            elif req in chain.readers:
                chain.readers.remove(req)
            if chain.last_write is None and not chain.readers:
                del self._chains[req.key]
        for dep in req.dependents:
            dep.deps_left -= 1
            if dep.deps_left == 0:
                self._queues.runnable(dep)
        done.append(req)
        self._admit_locked(done)

    @staticmethod
    def _settle(done: list[Request]) -> None:
        """Set futures outside the lock (their callbacks may call back into the store)."""
        for req in done:
            if req.error is not None:
                req.future.set_exception(req.error)
            else:
                req.future.set_result(req.future.tensor)

    # ------------------------------------------------------------------ I/O threads

    def _worker(self) -> None:
        wb = WorkerBuffers(self.block_size)
        while True:
            with self._lock:
                picked = self._queues.pick()
                while picked is None and not self._stopping:
                    self._work_ready.wait()
                    picked = self._queues.pick()
                if picked is None:
                    return
                req, index = picked
            with trace.span(f"nvme_{req.op}", req.key, bytes=req.block(index)[1]):
                error, bounced = self._io.run_block(req, index, wb)
            done: list[Request] = []
            with self._lock:
                self._traffic_of(req).bounced += bounced
                req.completed += 1
                if error is not None and req.error is None:
                    req.error = error
                    self._queues.stop_issuing(req)
                last = req.all_issued() and req.completed == min(req.next_block, req.n_tasks)
                if last and not req.finishing:
                    req.finishing = True
                else:
                    continue
            self._io.finalize(req, wb)
            with self._lock:
                self._finish_locked(req, done)
            self._settle(done)

    # ------------------------------------------------------------------ lifecycle

    def _check_open(self, key: str) -> None:
        if self._closed:
            raise SwapError("swap store is closed", path=self.path, key=key)

    def _shutdown_files(self) -> None:
        try:
            self._fileio.close(self._fd)
        except OSError as exc:
            log.warning("closing swap file %s failed: %s", self.path, exc)
        self._finalizer()

