"""Where a shard's optimizer state lives: the interface the pipelined Adam step reads and writes.

[Note: shard store contract]
A ``ShardStore`` knows, for shards 0..n-1, where ``master``, ``exp_avg``,
``exp_avg_sq`` (fp32), ``grad`` (fp32/bf16/fp16) and ``param16`` (bf16/fp16,
optional) live, and moves them between that tier and host buffers:

- ``fetch(i, bufs)`` fills ``bufs.master/exp_avg/exp_avg_sq/grad`` with shard i;
- ``store(i, bufs)`` writes ``bufs.master/exp_avg/exp_avg_sq/param16`` back as shard i;
- both return a ``Transfer`` (the buffers plus every future moving them); the
  caller must not touch the buffers before ``wait()`` returns;
- ``empty(numel, dtype)`` allocates a host buffer the store can move directly
  (page-aligned for O_DIRECT, pinned when the tier manager wants it).

Two implementations live here: ``HostShardStore`` (state in host tensors,
moved by one copy thread) and ``SwapShardStore`` (state in a ``swap.SwapStore``).
The tier manager supplies a third.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from tierzero import swap

logger = logging.getLogger(__name__)

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class ShardLayout:
    """Element count of every shard and the dtypes of the non-fp32 tensors."""

    numels: tuple[int, ...]
    grad_dtype: torch.dtype = torch.float32
    param16_dtype: torch.dtype | None = None  # None: no low-precision copy is written

    def __post_init__(self) -> None:
        bad = [(i, n) for i, n in enumerate(self.numels) if not isinstance(n, int) or n < 0]
        if bad:
            raise ValueError(f"ShardLayout numels must be ints >= 0; bad (index, value): {bad[:5]}")
        if self.grad_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"ShardLayout grad_dtype={self.grad_dtype}; allowed fp32, bf16, fp16")
        if self.param16_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"ShardLayout param16_dtype={self.param16_dtype}; allowed bf16, fp16")


@dataclass(frozen=True)
class ShardBuffers:
    """Host working buffers of one shard's step; views of ``numel`` elements."""

    master: torch.Tensor  # 1D fp32
    exp_avg: torch.Tensor  # 1D fp32
    exp_avg_sq: torch.Tensor  # 1D fp32
    grad: torch.Tensor  # 1D layout.grad_dtype
    param16: torch.Tensor | None  # 1D layout.param16_dtype, or None

    @property
    def numel(self) -> int:
        return self.master.numel()

    def view(self, numel: int) -> ShardBuffers:
        """The first `numel` elements of every buffer (starts stay aligned)."""
        return ShardBuffers(
            self.master[:numel], self.exp_avg[:numel], self.exp_avg_sq[:numel],
            self.grad[:numel], None if self.param16 is None else self.param16[:numel],
        )

    @classmethod
    def allocate(cls, store: ShardStore, numel: int) -> ShardBuffers:
        layout = store.layout
        return cls(
            store.empty(numel, torch.float32), store.empty(numel, torch.float32),
            store.empty(numel, torch.float32), store.empty(numel, layout.grad_dtype),
            None if layout.param16_dtype is None else store.empty(numel, layout.param16_dtype),
        )


class Transfer:
    """A pending fetch or store of one shard: its buffers and completion together."""

    def __init__(self, op: str, index: int, buffers: ShardBuffers,
                 futures: Sequence[Future[Any]]) -> None:
        self.op = op  # "fetch" or "store"
        self.index = index
        self.buffers = buffers
        self._futures = list(futures)

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> ShardBuffers:
        """Block until every part finished; raise the first failure, naming the shard."""
        error: BaseException | None = None
        for f in self._futures:  # wait for all parts before raising: they use our buffers
            exc = f.exception()
            if exc is not None and error is None:
                error = exc
        if error is not None:
            raise RuntimeError(f"{self.op} of shard {self.index} failed: {error}") from error
        return self.buffers


@runtime_checkable
class ShardStore(Protocol):
    """See [Note: shard store contract]."""

    @property
    def layout(self) -> ShardLayout: ...

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def fetch(self, index: int, into: ShardBuffers) -> Transfer: ...

    def store(self, index: int, source: ShardBuffers) -> Transfer: ...


def _check_index(layout: ShardLayout, index: int) -> None:
    if not 0 <= index < len(layout.numels):
        raise IndexError(f"shard {index} does not exist; the layout has {len(layout.numels)}")


class HostShardStore:
    """Shard state in plain host tensors; fetch/store copy on one background thread."""

    def __init__(self, layout: ShardLayout) -> None:
        self._layout = layout
        self.tensors: list[dict[str, torch.Tensor]] = []  # per shard: name -> 1D tensor
        for n in layout.numels:
            shard = {name: torch.zeros(n) for name in STATE_NAMES}
            shard["grad"] = torch.zeros(n, dtype=layout.grad_dtype)
            if layout.param16_dtype is not None:
                shard["param16"] = torch.zeros(n, dtype=layout.param16_dtype)
            self.tensors.append(shard)
        # One copy thread: host copies overlap the Adam compute; torch's copy_ releases the GIL.
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tz-host-shard")

    @property
    def layout(self) -> ShardLayout:
        return self._layout

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in pairs:
            dst.copy_(src)

    def fetch(self, index: int, into: ShardBuffers) -> Transfer:
        _check_index(self._layout, index)
        t = self.tensors[index]
        pairs = [(getattr(into, k), t[k]) for k in (*STATE_NAMES, "grad")]
        return Transfer("fetch", index, into, [self._copier.submit(self._copy, pairs)])

    def store(self, index: int, source: ShardBuffers) -> Transfer:
        _check_index(self._layout, index)
        t = self.tensors[index]
        pairs = [(t[k], getattr(source, k)) for k in STATE_NAMES]
        if source.param16 is not None and "param16" in t:
            pairs.append((t["param16"], source.param16))
        return Transfer("store", index, source, [self._copier.submit(self._copy, pairs)])

    def close(self) -> None:
        self._copier.shutdown(wait=True)

    def __enter__(self) -> HostShardStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SwapShardStore:
    """Shard state in a ``swap.SwapStore`` under keys ``{prefix}{index}/{name}``.

    The swap store is the caller's (opened and closed by it). ``put``/``get`` move one
    named tensor of one shard, e.g. to seed master weights or hand in gradients.
    """

    NAMES = (*STATE_NAMES, "grad", "param16")

    def __init__(self, swap_store: swap.SwapStore, layout: ShardLayout, prefix: str = "adam/"
                 ) -> None:
        self._swap = swap_store
        self._layout = layout
        self.prefix = prefix

    @property
    def layout(self) -> ShardLayout:
        return self._layout

    def key(self, index: int, name: str) -> str:
        if name not in self.NAMES:
            raise ValueError(f"shard tensor name {name!r} is unknown; allowed: {self.NAMES}")
        _check_index(self._layout, index)
        return f"{self.prefix}{index}/{name}"

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return swap.aligned_empty(numel, dtype)  # page-aligned: O_DIRECT without bounce copies

    def put(self, index: int, name: str, tensor: torch.Tensor) -> Future[torch.Tensor]:
        return self._swap.write(self.key(index, name), tensor)

    def get(self, index: int, name: str, out: torch.Tensor | None = None) -> Future[torch.Tensor]:
        return self._swap.read(self.key(index, name), out=out)

    def init_shard(self, index: int, master: torch.Tensor) -> list[Future[torch.Tensor]]:
        """Seed shard `index`: master as given, both moments zero (the first step's state).

        The data goes through page-aligned copies so the writes need no bounce buffer.
        """
        flat = self.empty(master.numel(), torch.float32)
        flat.copy_(master.reshape(-1))
        zeros = self.empty(master.numel(), torch.float32).zero_()
        return [self.put(index, "master", flat),
                self.put(index, "exp_avg", zeros), self.put(index, "exp_avg_sq", zeros)]

    def fetch(self, index: int, into: ShardBuffers) -> Transfer:
        futures = [self._swap.read(self.key(index, k), out=getattr(into, k))
                   for k in (*STATE_NAMES, "grad")]
        return Transfer("fetch", index, into, futures)

    def store(self, index: int, source: ShardBuffers) -> Transfer:
        futures = [self._swap.write(self.key(index, k), getattr(source, k)) for k in STATE_NAMES]
        if source.param16 is not None:
            futures.append(self._swap.write(self.key(index, "param16"), source.param16))
        return Transfer("store", index, source, futures)
