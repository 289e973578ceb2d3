"""The small typed pieces of the streamed CPU Adam (offload/adam_stream.py): its inputs
checked, one shard's buffers, a read in flight, a step in progress, its statistics, the
shards whose param it keeps in host memory. See [Note: streamed optimizer step]."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .adam_math import AdamHyper
from .bf16_master import check_master
from .errors import OffloadError
from .placement import Plan
from .settings import MOMENT_CLASSES, STATE_CLASSES
from .state_codec import moment_nbytes
from .transfer import TierTransfer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineStats:
    """Where the time of one optimizer step went (seconds, wall clock)."""

    shards: int
    total_s: float
    compute_s: float  # inside the Adam kernel
    fetch_wait_s: float  # compute thread blocked on a read
    store_wait_s: float  # blocked on a write to free ring room, or draining at the end
    buffer_bytes: int  # host bytes held by the step's buffers



ChunkSpec = Sequence[Sequence[tuple[int, int, Mapping[str, str]]]]


def checked_inputs(keys: Sequence[Mapping[str, str]], numels: Sequence[int],
                   chunks: ChunkSpec | None, *, buffer_bytes: int, shadow: torch.dtype | None,
                   master: str, salts: Sequence[int] | None) -> list[list[Chunk]]:
    """AdamStream's arguments checked (ValueError naming what is wrong), and every shard's
    pieces. With a bf16 master ([Note: bf16 master weights] in offload/bf16_master.py) a
    shard in one piece reads and writes its master under the param's key."""
    n = len(numels)
    if len(keys) != n:
        raise ValueError(f"AdamStream: {len(keys)} key maps for {n} shards")
    if not isinstance(buffer_bytes, int) or buffer_bytes < 0:
        raise ValueError(f"AdamStream buffer_bytes={buffer_bytes!r}; need an int >= 0")
    if shadow not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"AdamStream shadow={shadow}; allowed None, bf16, fp16")
    check_master(master)
    bf16 = master == "bf16"
    if bf16 and (shadow is not None or salts is None or len(salts) != n):
        raise ValueError(f"AdamStream with a bf16 master takes no shadow (got {shadow}; the "
                         f"param is the master) and one salt per shard ({n})")
    state = MOMENT_CLASSES if bf16 else STATE_CLASSES
    for i, (k, numel) in enumerate(zip(keys, numels, strict=True)):
        missing = [c for c in (*(state if chunks is None else ()), "grad",
                               *(("param",) if bf16 else ())) if c not in k]
        if numel and missing:
            raise ValueError(f"AdamStream: shard {i} has no key for {missing}")
    out = _checked_chunks(keys, numels, chunks, state)
    if bf16:
        out = [[Chunk(c.shard, c.lo, c.hi, {**c.keys, "master": keys[c.shard]["param"]})
                for c in cs] if len(cs) == 1 and cs[0].numel else cs for cs in out]
    return out


def _checked_chunks(keys: Sequence[Mapping[str, str]], numels: Sequence[int],
                    chunks: ChunkSpec | None, state: tuple[str, ...]) -> list[list[Chunk]]:
    """Every shard's pieces, tiling [0, numel) in order; one piece per shard (its own state
    keys) when ``chunks`` is None."""
    if chunks is None:
        return [[Chunk(i, 0, n, {c: k[c] for c in state if c in k})]
                for i, (k, n) in enumerate(zip(keys, numels, strict=True))]
    if len(chunks) != len(numels):
        raise ValueError(f"AdamStream: {len(chunks)} chunk lists for {len(numels)} shards")
    out: list[list[Chunk]] = []
    for i, (pieces, n) in enumerate(zip(chunks, numels, strict=True)):
        got = [Chunk(i, lo, hi, dict(k)) for lo, hi, k in pieces]
        bounds = [0, *(c.hi for c in got)]
        if (not got or bounds[-1] != n
                or any(c.lo != b for c, b in zip(got, bounds, strict=False))
                or (n and any(c.hi <= c.lo for c in got))):
            raise ValueError(f"AdamStream: the chunks of shard {i} must tile [0, {n}) in order; "
                             f"got {[(c.lo, c.hi) for c in got][:6]}")
        missing = [c for c in state for ch in got if n and c not in ch.keys]
        if missing:
            raise ValueError(f"AdamStream: a chunk of shard {i} has no key for {missing[:3]}")
        out.append(got)
    return out


def checked_order(order: Sequence[int], n: int) -> list[int]:
    out = list(order)
    if sorted(out) != list(range(n)):
        raise ValueError(f"AdamStream order must list every shard 0..{n - 1} once; got "
                         f"{out[:10]}")
    return out


@dataclass(frozen=True)
class Chunk:
    """A piece of one shard's fp32 optimizer state: elements [lo, hi) of shard ``shard``,
    stored under its own manager keys ([Note: optimizer state in chunks] in
    offload/adam_stream.py)."""

    shard: int
    lo: int
    hi: int
    # "master", "exp_avg", "exp_avg_sq" -> manager key of this piece (a bf16 master of a
    # shard in one piece: the param's key; of a shard in several: none, it is read whole)
    keys: dict[str, str]

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True, eq=False)
class StreamSet:
    """One shard's working buffers: 1D host views into the ring, `numel` elements each."""

    start: int  # the ring region holding them (-1: an empty shard, no region)
    master: torch.Tensor  # fp32, or bf16 (the param: [Note: bf16 master weights]), or empty
    exp_avg: torch.Tensor  # fp32
    exp_avg_sq: torch.Tensor  # fp32
    param: torch.Tensor | None  # the compute dtype when it is bf16/fp16, else None
    # how the moments are stored (offload/state_codec.py): fp32 tensors, or else uint8
    # tensors of state_codec.moment_nbytes(numel) bytes
    state: str = "fp32"

    def part(self, name: str, numel: int) -> torch.Tensor:
        t = getattr(self, name)
        if not isinstance(t, torch.Tensor):
            raise OffloadError(f"internal: buffer set has no {name!r} buffer")
        if self.state != "fp32" and name in MOMENT_CLASSES:
            return t[:moment_nbytes(numel, self.state)]
        return t[:numel]


class StreamRead:
    """A shard's state on its way into a buffer set: the set and the completion together.

    ``job`` resolves, on the read-ahead thread, to (key, version read, transfer) per
    state tensor once the reads are issued."""

    def __init__(self, index: int, bufs: StreamSet, after: list[TierTransfer],
                 job: Future[list[tuple[str, int, TierTransfer]]], *, shard: int) -> None:
        self.index = index  # the piece's position in the step's sequence of pieces
        self.shard = shard
        self.bufs = bufs
        self.after = after  # the writes of the set's previous shard, which the job awaits
        self.job = job

    def wait(self) -> list[tuple[str, int]]:
        """Block until the state is in the buffers; (key, version) of each part."""
        parts = self.job.result()
        error: BaseException | None = None
        for _, _, t in parts:  # every part settles before raising: they fill our buffers
            try:
                t.wait()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: never rewrap
                raise error
            raise OffloadError(f"reading the optimizer state of shard {self.shard} failed: "
                               f"{error}") from error
        return [(k, v) for k, v, _ in parts]

    def settle(self) -> None:
        """Wait without raising (used while unwinding another failure)."""
        try:
            self.wait()
        except Exception as exc:  # an interrupt goes on up: it is not a failure to log
            log.warning("while unwinding a failed optimizer step: %s", exc)


@dataclass
class OpenStep:
    """A step in progress: its hyper-parameters, how far it got, where the time went."""

    hyper: AdamHyper
    step: float
    grad_scale: float
    t0: float
    pos: int = 0  # shards of `order` updated so far (each with all its chunks)
    final: set[int] = field(default_factory=set)  # shards whose gradient is final
    grads_final: bool = False  # every gradient is (the inputs are read one shard ahead)
    compute: float = 0.0
    wait: float = 0.0


def wait_all(parts: Sequence[TierTransfer]) -> None:
    """Wait for every transfer, then raise the first failure not told before (all of them
    use our buffers; TierTransfer.wait_once)."""
    error: BaseException | None = None
    for t in parts:
        try:
            t.wait_once()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


# [Note: param kept in host memory]
# The last shards of a step are the first the next forward gathers, and their param
# writes are the ones still in flight when it starts: a gather would wait for the
# write to land and then read the same bytes back from NVMe. Their new param is
# instead copied into pool buffers as host caches, written down from there (the home
# stays authoritative, the cache is clean once the write lands, evictable as any).
def kept_shards(plan: Plan, keys: Sequence[Mapping[str, str]], numels: Sequence[int],
                order: Sequence[int], buffers: int | None) -> frozenset[int]:
    """The shards whose new param the stream offers the manager as host caches: the last
    of ``order`` whose NVMe-homed param fits in ``buffers`` pool buffers (None: all but
    one)."""
    room = max(0, plan.pool_count - 1) if buffers is None else buffers
    kept: set[int] = set()
    for index in reversed(order):
        key = keys[index].get("param")
        if key is None or not numels[index] or plan.homes.get(key) != "nvme":
            continue
        need = -(-plan.specs[key].nbytes // max(1, plan.pool_buffer_bytes))
        if need > room:
            break
        room -= need
        kept.add(index)
    return frozenset(kept)
