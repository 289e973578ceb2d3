"""The CPU Adam step over tier-managed shards, streamed across steps.

[Note: streamed optimizer step]
A step that fetched, updated and stored every shard inside one call would run
its NVMe traffic only while the caller waits in ``step()``. ``AdamStream``
keeps one host ring of ``buffer_bytes`` (offload/host_ring.py) for the whole run
and lets the traffic spill into the time around the step:

    step N        ... adam i | write i, queued | adam i+1 | ...  returns with the
                  last writes still in flight
    fwd/bwd N+1   those writes drain; the ring room each one frees is filled at
                  once with the state of the next step's first shards (read-ahead)
    step N+1      starts on shards whose state is already in host memory

Each shard's state (master, exp_avg, exp_avg_sq) is read once and written once
per step, straight between its buffer set and its home (TierManager.read_into /
write_from: for NVMe no pool buffer and no staging copy); the gradient is used
where it lives (a view of its host home, no copy). The new param (the
kernel's low-precision shadow, or the fp32 master itself with fp32 compute) is
written in the same pass.

The step can also start while backward runs (the engine's
offload.optimizer.overlap_step): begin(), then mark_final(shards) as gradients
turn final (shards are updated in ``order`` as far as the final ones reach),
then finish() for the rest. The engine orders the shards as backward finalises
them, so the read-ahead taken during forward is what backward needs first.

Ordering, so no one ever sees stale data:
- a read-ahead into ring room starts only after the writes that held the room
  have landed (one background thread waits for it, so ``step()`` does not);
- reads and writes of one key are ordered by the manager (the home copy is in
  flight until the write lands: a gather of param waits for it) and by the
  swap store (a read waits for earlier writes of its key);
- a read-ahead whose key changed after it was issued (``TierManager.version``,
  e.g. a checkpoint load wrote the state) is read again before use.

[Note: optimizer state in chunks]
A shard's master and moments may be stored as several pieces (``chunks``: elements
[lo, hi) under their own manager keys, as DeepSpeed's ``sub_group_size`` splits its
optimizer into sub-groups with their own swap files). The stream reads, updates and
writes one piece at a time through the ring, so the ring is sized by the piece, not by
the largest shard: a 700M-parameter layer needs no 10 GB of buffers. Each piece is one
pass of the same kernel over its elements (Adam is elementwise, so the result is
bitwise the same as one pass over the shard). The gradient is held once per shard (a
view of its home or host cache, sliced per piece); the new param of a shard in
several pieces is assembled whole in offload/param_assembly.py; a shard of one piece keeps
its param in the ring with its state.

Failures: an exception inside ``step()`` waits for every transfer still using the
buffers, drops the read-ahead and re-raises; every shard is then either fully updated
(its writes were issued) or untouched, the manager holds nothing for the stream, and the
next ``step()`` starts over from the first shard. A failed write is raised by the next
``step()`` or ``flush()`` (and by the manager call that settles it), naming the key.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch

from tierzero.swap import trace

from .adam_kernel import Backend, adam_update
from .adam_math import AdamHyper
from .adam_threads import AdamThreads
from .bf16_master import master_key
from .errors import OffloadError
from .host_ring import HostRing, page_up
from .manager import TierManager
from .param_assembly import ParamAssembly
from .settings import STATE_CLASSES
from .shard_inputs import ParamSource, ShardAhead
from .state_codec import check_precision
from .stream_parts import (
    Chunk,
    OpenStep,
    PipelineStats,
    StreamRead,
    StreamSet,
    checked_inputs,
    checked_order,
    kept_shards,
    wait_all,
)
from .stream_sizes import carve, piece_bytes, ring_capacity
from .transfer import TierTransfer

log = logging.getLogger(__name__)

# what becomes of a gradient once its shard is updated (AdamStream.grads_used)
GradsUsed = Literal["discard", "keep", "write"]


class AdamStream:
    """Adam over every shard of ``keys`` (class -> manager key per shard), streamed.

    keys[i] names "master", "exp_avg", "exp_avg_sq", "grad" and "param" of shard i
    (param optional: without it only the fp32 state is updated).
    order: the shard order of every step; ``set_order`` changes it between steps. The
        engine starts from backward's unit order (blocks last to first, the root last),
        then follows the order gradients turned final in its backward.
    buffer_bytes: the host ring the shards' master + moments (+ param) are carved
        from (at least the largest shard's): the host memory of the step, and how far
        reads run ahead and writes behind. A shard's region is taken when its read is
        issued and returned when its write has landed, in order (offload/host_ring.py).
    keep_host_buffers: pool buffers the new param of the last shards in the
        construction ``order`` may take as host caches (TierManager.write_from keep_host;
        None: all but one). That order's reverse is forward's gather order (the root,
        then the blocks): those shards find their param in host memory instead of
        waiting for its write to land and reading it back (see [Note: param kept in
        host memory]). Chosen once; ``set_order`` does not change it.
    chunks: per shard, its pieces (lo, hi, {"master"|"exp_avg"|"exp_avg_sq": key}) tiling
        [0, numel) ([Note: optimizer state in chunks]); keys[i] then needs only "grad" and
        "param". None: every shard is one piece under its own keys.
    consume_grads: a gradient is dead once its shard is updated (the caller overwrites it
        before reading it again): its caches are dropped unwritten (TierManager.discard), so
        an NVMe-homed gradient cached in the pool is not written down after the step.
        Sets ``grads_used``, which the caller may change between steps: "discard" (so),
        "keep" (left where it is), "write" (written down and its caches dropped once
        clean, TierManager.evict: a gradient still needed after the step that should not
        hold pool room meanwhile).
    state: how the moments are stored (offload/state_codec.py, offload.optimizer.
        state_precision): "fp32", or "bf16" / "int8", whose manager keys then hold uint8
        tensors of state_codec.moment_nbytes(piece numel) bytes; they are read, updated
        and written at that size (the kernel decodes and encodes in its pass).
    master: "fp32", or "bf16": the param is the master (no "master" keys, no shadow;
        salts: per shard, bf16_master.shard_salt), see [Note: bf16 master weights].
    """

    def __init__(self, manager: TierManager, keys: Sequence[Mapping[str, str]],
                 numels: Sequence[int], *, order: Sequence[int] | None = None,
                 buffer_bytes: int,
                 shadow: torch.dtype | None, threads: AdamThreads | None = None,
                 backend: Backend = "auto", keep_host_buffers: int | None = None,
                 consume_grads: bool = False,
                 chunks: Sequence[Sequence[tuple[int, int, Mapping[str, str]]]] | None = None,
                 state: str = "fp32", master: str = "fp32",
                 salts: Sequence[int] | None = None) -> None:
        check_precision(state)
        self._state = state
        n = len(numels)
        self._order = list(range(n)) if order is None else checked_order(order, n)
        self._chunks = checked_inputs(keys, numels, chunks, buffer_bytes=buffer_bytes,
                                      shadow=shadow, master=master, salts=salts)
        self._mgr = manager
        self._keys = [dict(k) for k in keys]
        self._numels = list(numels)
        self._shadow = shadow
        # the kernel's threads; whoever drives the stream may change them between calls
        self.threads = threads
        self._master = master
        self._salts = list(salts or ())
        # the param's dtype: the bf16 master, the low-precision shadow, else fp32 (the master)
        self._param_dtype = (torch.bfloat16 if master == "bf16" else shadow or torch.float32)
        self._backend = backend
        self.grads_used: GradsUsed = "discard" if consume_grads else "keep"
        # called with a shard's index once its update has read its gradient, before the
        # gradient is let go (released, dropped or written down): whoever drives the
        # stream waits there for its own readers of that gradient (a measurement taken
        # beside the update); the kernel only reads it
        self.grad_readers: Callable[[int], None] | None = None
        items = [self._item_bytes(c) for cs in self._chunks for c in cs]
        self._ring = HostRing(ring_capacity(buffer_bytes, items), lambda nbytes: manager.host_empty(
            nbytes, torch.uint8, purpose="adam_ring"))
        # param of shards in several pieces, assembled whole ([Note: optimizer state in
        # chunks])
        low = self._param_dtype
        whole = [page_up(low.itemsize * self._numels[i]) for i, cs in enumerate(self._chunks)
                 if len(cs) > 1 and "param" in self._keys[i]]
        # a bf16 master's room holds one more param: the next shard's, read ahead
        self._p16 = (ParamAssembly(manager, whole, low, regions=3 if master == "bf16" else 2)
                     if whole else None)
        self._inputs = ShardAhead(manager, self._keys, self._numels,
                                  [len(cs) for cs in self._chunks], self._p16,
                                  read_param=master == "bf16")
        self._seq: list[Chunk] = []  # every piece, in step order
        self._first: list[int] = []  # position in _seq of each order position's first piece
        self._sequence()
        self._keep = kept_shards(self._mgr.plan, self._keys, self._numels, self._order,
                                 keep_host_buffers)  # [Note: param kept in host memory]
        self.buffer_bytes = self._ring.capacity + (0 if self._p16 is None else self._p16.capacity)
        self._ahead: deque[StreamRead] = deque()  # reads issued, in step order
        self._writes: deque[tuple[StreamSet, list[TierTransfer]]] = deque()  # oldest first
        self._issued = 0  # reads issued for positions of the current cycle (may run past n)
        self._carry: list[TierTransfer] = []  # writes of returned ring room, not yet awaited
        self._open: OpenStep | None = None  # the step begun and not finished
        # One thread issues the read-ahead once the write that holds its buffer set lands,
        # so step() never blocks on those writes.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tierzero-adam-ahead")
        self._closed = False

    # ----------------------------------------------------------------- step
    def step(self, hyper: AdamHyper, step: float, grad_scale: float = 1.0) -> PipelineStats:
        """One Adam update of every shard; returns with the last writes in flight."""
        self.begin(hyper, step, grad_scale, grads_final=True)
        return self.finish()

    # A step in parts, for starting it while backward still runs: begin(), then
    # mark_final() as each shard's gradient is final (the shards are updated in `order`, as
    # far as the final ones reach), then finish() updates the rest.
    def begin(self, hyper: AdamHyper, step: float, grad_scale: float = 1.0, *,
              grads_final: bool = False) -> None:
        """grads_final: every gradient is final already (mark_final only paces the update),
        so each shard's inputs are read one shard ahead ([Note: shard inputs read ahead])."""
        if self._closed:
            raise OffloadError("AdamStream.begin() after close()")
        if self._open is not None:
            raise OffloadError("AdamStream.begin() while a step is open; finish() or abort() "
                               "it first")
        self._open = OpenStep(hyper, step, grad_scale, time.perf_counter(),
                              grads_final=grads_final)

    @property
    def order(self) -> list[int]:
        return list(self._order)

    def set_order(self, order: Sequence[int]) -> bool:
        """Update the shards in ``order`` from the next step on; returns whether it changed.
        Not while a step is open. A change waits for the writes in flight and drops the
        read-ahead (taken for the old order's first shards), once."""
        order = checked_order(order, len(self._numels))
        if order == self._order:
            return False
        if self._open is not None:
            raise OffloadError("AdamStream.set_order() while a step is open; finish() or "
                               "abort() it first")
        self.flush()
        self._order = order
        self._sequence()
        return True

    def _sequence(self) -> None:
        self._seq = [c for i in self._order for c in self._chunks[i]]
        self._first = []
        at = 0
        for i in self._order:
            self._first.append(at)
            at += len(self._chunks[i])

    def mark_final(self, indices: Sequence[int]) -> None:
        """These shards' gradients will not change this step: update every shard, in order,
        up to the first whose gradient is not final yet."""
        op = self._need_open("mark_final")
        op.final.update(indices)
        self._advance(op, everything=False)

    def finish(self) -> PipelineStats:
        """Update the shards not updated yet; the step is closed."""
        op = self._need_open("finish")
        op.grads_final = True  # the rest is updated now: its gradients are final
        self._advance(op, everything=True)
        self._open = None
        try:
            self._issued -= len(self._seq)
            self._top_up(0, now=False)  # the next step's first shards, behind the writes
        except BaseException:
            self._unwind()
            raise
        return PipelineStats(len(self._order), time.perf_counter() - op.t0, op.compute,
                             op.wait, 0.0, self.buffer_bytes)

    def abort(self) -> int:
        """Close an open step without updating the rest; returns how many shards it had
        updated (each of them whole). The next step starts from the first shard."""
        op, self._open = self._open, None
        if op is None:
            return 0
        self._unwind()
        return op.pos

    def _need_open(self, what: str) -> OpenStep:
        if self._open is None:
            raise OffloadError(f"AdamStream.{what}() without begin()")
        return self._open

    def _advance(self, op: OpenStep, *, everything: bool) -> None:
        try:
            while op.pos < len(self._order) and (everything or self._order[op.pos] in op.final):
                self._one(op, op.pos)
                op.pos += 1
        except BaseException:
            self._open = None
            self._unwind()
            raise

    def _one(self, op: OpenStep, pos: int) -> None:
        """Update shard ``order[pos]``, piece by piece."""
        index = self._order[pos]
        pieces = self._chunks[index]
        if self._numels[index] == 0:
            self._next_read(op, self._first[pos])
            return
        keys = self._keys[index]
        inputs = self._inputs.take(pos, index)  # [Note: shard inputs read ahead]
        try:
            if op.grads_final:
                self._inputs.ahead(pos, self._order)
            t = time.perf_counter()
            grad, taken = self._inputs.ready(inputs, index)
            op.wait += time.perf_counter() - t
            whole = None if taken is None else taken[1]
            for j, piece in enumerate(pieces):
                rd = self._next_read(op, self._first[pos] + j)
                op.compute += self._update(rd.bufs, piece, grad, whole, op)
                self._write(rd.bufs, piece, param=whole is None)
            if taken is not None and self._p16 is not None:
                self._p16.write(keys["param"], *taken, keep_host=index in self._keep)
        finally:
            try:
                if self.grad_readers is not None:  # theirs end before the gradient goes
                    self.grad_readers(index)
            finally:
                self._mgr.release(inputs.gkey, inputs.tier)
                if self.grads_used == "discard":
                    self._mgr.discard(inputs.gkey)
                elif self.grads_used == "write":  # kept, off the pool: [Note: speculated step]
                    self._mgr.evict(inputs.gkey)

    def _next_read(self, op: OpenStep, at: int) -> StreamRead:
        """The read of piece ``_seq[at]``, waited for and current."""
        self._top_up(at)
        rd = self._ahead.popleft()
        if rd.index != at:
            raise OffloadError(f"internal: read-ahead holds piece {rd.index}, the step is at "
                               f"piece {at}")
        t = time.perf_counter()
        piece = self._seq[at]
        try:
            seen = rd.wait()
        except Exception as exc:  # read ahead, maybe long before: read it again, now
            seen = self._read_again(rd, piece, exc)
        op.wait += time.perf_counter() - t
        for key, version in seen:  # written by someone else since: read again
            if self._mgr.version(key) != version:
                name = next(c for c in STATE_CLASSES if piece.keys.get(c) == key)
                self._mgr.read_into(key, rd.bufs.part(name, piece.numel),
                                    replacing=self._inputs.is_param(piece.shard, key)).wait()
        return rd

    def _read_again(self, rd: StreamRead, piece: Chunk, first: Exception
                    ) -> list[tuple[str, int]]:
        """A read-ahead failed: read the piece's state again on this thread, raising what
        fails now. Its first failure was raised to the read-ahead (told: a write it was
        chained behind, which the manager still holds as dirty or refuses as lost, [Note:
        a lost write]; or a read), and is logged; a shard written whole since (a checkpoint
        loaded) reads as it is now."""
        log.warning("reading the optimizer state of shard %d ahead failed (%s); reading it "
                    "again", piece.shard, first)
        error: Exception | None = None
        try:
            parts = self._read_parts(piece, rd.bufs, background=False)
        except Exception as exc:
            parts, error = [], exc
        for _, _, t in parts:  # every part settles before raising: they fill our buffers
            try:
                t.wait()
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise OffloadError(f"reading the optimizer state of shard {piece.shard} failed: "
                               f"{error}") from error
        return [(key, version) for key, version, _ in parts]

    def _update(self, bufs: StreamSet, piece: Chunk, grad: torch.Tensor,
                whole: torch.Tensor | None, op: OpenStep) -> float:
        """One kernel pass over the piece; its new param goes to the ring (a shard in one
        piece) or into the shard's assembled param ``whole``."""
        n = piece.numel
        bf16 = self._master == "bf16"
        master = (whole[piece.lo:piece.hi] if bf16 and whole is not None
                  else bufs.part("master", n))
        if bf16:  # the master is the param: no shadow
            shadow = None
        elif whole is not None:
            shadow = None if self._shadow is None else whole[piece.lo:piece.hi]
        else:
            shadow = None if bufs.param is None else bufs.param[:n]
        key = master_key(op.step, self._salts[piece.shard]) if bf16 else None
        t = time.perf_counter()
        with trace.span("adam", piece.keys["exp_avg"], numel=n):
            adam_update(master, bufs.part("exp_avg", n), bufs.part("exp_avg_sq", n),
                        grad[piece.lo:piece.hi], hyper=op.hyper, step=op.step,
                        grad_scale=op.grad_scale, shadow=shadow, threads=self.threads,
                        backend=self._backend, state=self._state, offset=piece.lo,
                        master_key=key)
        if whole is not None and self._shadow is None and not bf16:  # param is the master
            whole[piece.lo:piece.hi].copy_(master)
        return time.perf_counter() - t

    def _write(self, bufs: StreamSet, piece: Chunk, *, param: bool) -> None:
        n = piece.numel
        p16 = self._keys[piece.shard].get("param")
        keep = piece.shard in self._keep
        # a bf16 master of a shard in one piece is written under the param's key
        writes = [self._mgr.write_from(piece.keys[c], bufs.part(c, n),
                                       keep_host=keep and piece.keys[c] == p16)
                  for c in STATE_CLASSES if c in piece.keys]
        if param and p16 is not None and self._master == "fp32":
            src = bufs.part("master", n) if bufs.param is None else bufs.param[:n]
            writes.append(self._mgr.write_from(p16, src, keep_host=keep))
        self._writes.append((bufs, writes))
        while self._writes and all(t.done() for t in self._writes[0][1]):
            done, parts = self._writes.popleft()
            wait_all(parts)
            self._ring.give_back(done.start)

    @property
    def kept(self) -> frozenset[int]:
        """Shards whose new param is offered to the manager as a host cache."""
        return self._keep

    def keep_params(self, shards: frozenset[int]) -> None:
        """Offer these shards' new param as host caches from now on (`kept`): every
        shard when the update of each runs right before its gather."""
        self._keep = shards

    @property
    def param_source(self) -> ParamSource | None:
        """Where a bf16 master read whole may be copied from instead of read ([Note: a
        param held in host memory] in offload/shard_inputs.py); None: always read. Set
        by whoever drives the stream, for the calls it drives on its own thread."""
        return self._inputs.source

    @param_source.setter
    def param_source(self, source: ParamSource | None) -> None:
        self._inputs.source = source

    def _item_bytes(self, piece: Chunk) -> int:
        """Ring bytes of a piece: its state, and its param when the shard is one piece."""
        low = 2 if len(self._chunks[piece.shard]) == 1 and self._shadow is not None else 0
        master = self._carved_master(piece)
        return piece_bytes(piece.numel, self._state, low,
                           0 if master is None else master.itemsize) if piece.numel else 0

    def _carved_master(self, piece: Chunk) -> torch.dtype | None:
        """A ring item's master part: fp32, a bf16 master (the param of a shard in one
        piece), or none (a piece of a shard whose bf16 master is assembled whole)."""
        if self._master == "fp32":
            return torch.float32
        return torch.bfloat16 if "master" in piece.keys else None

    def _top_up(self, pos: int, *, now: bool = True) -> None:
        """Issue reads for the positions from ``pos`` on (at most one step ahead, wrapping
        into the next step) while the ring has room, taking room from the oldest writes
        (the read is then chained behind them). Every read but that of ``pos`` when the
        step is ``now`` at it is read-ahead: a background read, which the swap store
        moves behind parameter fetches (SwapStore.read)."""
        n_seq = len(self._seq)
        while self._issued < pos + n_seq:
            background = not now or self._issued > pos
            piece = self._seq[self._issued % n_seq]
            size = self._item_bytes(piece)
            start = self._ring.take(size) if piece.numel else -1
            while start is None and self._writes:
                # Room still being written: the next read issued waits for these writes
                # (and every later one too: the read-ahead thread runs in order).
                done, parts = self._writes.popleft()
                self._carry += parts
                self._ring.give_back(done.start)
                start = self._ring.take(size)
            if start is None:  # the ring is full of read-ahead: enough
                return
            after, self._carry = self._carry, []
            bufs = carve(self._ring, start, piece.numel, self._state, self._shadow,
                         param=len(self._chunks[piece.shard]) == 1,
                         master=self._carved_master(piece))
            job = self._reader.submit(self._issue_read, piece, bufs, after, background)
            self._ahead.append(StreamRead(self._issued % n_seq, bufs, after, job,
                                          shard=piece.shard))
            self._issued += 1

    def _issue_read(self, piece: Chunk, bufs: StreamSet, after: list[TierTransfer],
                    background: bool) -> list[tuple[str, int, TierTransfer]]:
        wait_all(after)  # the set's previous contents are written: it may be refilled
        return self._read_parts(piece, bufs, background=background)

    def _read_parts(self, piece: Chunk, bufs: StreamSet, *, background: bool
                    ) -> list[tuple[str, int, TierTransfer]]:
        """Issue the reads of the piece's state into `bufs`: (key, version read, transfer)
        each. Where one cannot be issued, those issued are waited for before it raises."""
        n = piece.numel
        out: list[tuple[str, int, TierTransfer]] = []
        try:
            for c in [c for c in STATE_CLASSES if c in piece.keys] if n else ():
                key = piece.keys[c]
                mine = self._inputs.is_param(piece.shard, key)  # a bf16 master: we write it
                version = self._mgr.version(key)  # before the read: a later change is caught
                out.append((key, version, self._mgr.read_into(
                    key, bufs.part(c, n), background=background, replacing=mine)))
        except BaseException:
            for _, _, t in out:  # no read issued goes on filling the set unwatched
                with contextlib.suppress(Exception):
                    t.wait()
            raise
        return out

    @property
    def writes_in_flight(self) -> int:
        """Shards whose writes were issued and have not all landed yet."""
        groups = [parts for _, parts in self._writes] + [rd.after for rd in self._ahead]
        groups += [[t] for t in [*self._carry, *self._p16_writes()]]
        return sum(not all(t.done() for t in parts) for parts in groups)

    def wait_idle(self) -> None:
        """Block until every issued write and read-ahead has landed, keeping the
        read-ahead (for exact traffic counts per step); raises a failure."""
        for rd in list(self._ahead):
            rd.wait()
        for parts in [self._carry, *(p for _, p in self._writes), self._p16_writes()]:
            wait_all(parts)

    def _write_groups(self) -> list[list[TierTransfer]]:
        """Every write issued and not yet waited for: those the read-aheads are chained
        behind, those given up for room, those queued, and the assembled params'."""
        return [*(rd.after for rd in self._ahead), self._carry,
                *(p for _, p in self._writes), self._p16_writes()]

    # ------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Wait for every write in flight (raising the first failure) and drop the
        read-ahead; afterwards the stream holds no transfer. Not while a step is open."""
        if self._open is not None:
            raise OffloadError("AdamStream.flush() while a step is open; finish() or abort() "
                               "it first")
        try:
            for parts in self._write_groups():
                wait_all(parts)
            if self._p16 is not None:
                self._p16.flush()
        except BaseException:
            self._unwind()
            raise
        self._unwind()

    def _unwind(self) -> None:
        self._inputs.drop()
        for rd in self._ahead:
            rd.settle()
        for parts in [self._carry, *(p for _, p in self._writes), self._p16_writes()]:
            for t in parts:
                try:
                    t.wait_once()
                except BaseException as exc:
                    log.warning("while unwinding the optimizer stream: %s", exc)
        self._ahead.clear()
        self._writes.clear()
        self._carry = []
        self._ring.reset()
        if self._p16 is not None:
            self._p16.reset()
        self._issued = 0

    def _p16_writes(self) -> list[TierTransfer]:
        return [] if self._p16 is None else self._p16.in_flight()

    def close(self) -> None:
        """Finish every write (raising a failure) and stop the read-ahead thread."""
        if self._closed:
            return
        self._closed = True
        self._open = None
        try:
            self.flush()
        finally:
            self._reader.shutdown(wait=True)
