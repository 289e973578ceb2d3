"""The small typed pieces of the streamed CPU Adam (offload/adam_stream.py): one shard's
buffers, a read in flight, a step in progress. See [Note: streamed optimizer step]."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .adam_math import AdamHyper
from .errors import OffloadError
from .state_codec import moment_nbytes
from .transfer import TierTransfer

log = logging.getLogger(__name__)

STATE = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Chunk:
    """A piece of one shard's fp32 optimizer state: elements [lo, hi) of shard ``shard``,
    stored under its own manager keys ([Note: optimizer state in chunks] in
    offload/adam_stream.py)."""

    shard: int
    lo: int
    hi: int
    keys: dict[str, str]  # "master", "exp_avg", "exp_avg_sq" -> manager key of this piece

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True, eq=False)
class StreamSet:
    """One shard's working buffers: 1D host views into the ring, `numel` elements each."""

    start: int  # the ring region holding them (-1: an empty shard, no region)
    master: torch.Tensor  # fp32
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
        if self.state != "fp32" and name in ("exp_avg", "exp_avg_sq"):
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
    compute: float = 0.0
    wait: float = 0.0


def wait_all(parts: Sequence[TierTransfer]) -> None:
    """Wait for every transfer, then raise the first failure (all of them use our buffers)."""
    error: BaseException | None = None
    for t in parts:
        try:
            t.wait()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error
