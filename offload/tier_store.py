"""TierShardStore: the pipelined CPU Adam's ShardStore, backed by the TierManager.

Implements [Note: shard store contract] (offload/shard_store.py) on top of the
manager, so the optimizer step reads and writes state wherever placement put
it (host, or NVMe through the pool) under the manager's budgets and accounting.
``keys[i]`` maps tensor class -> the manager's shard key for optimizer shard i
(``param16`` optional; shards with 0 elements have no keys and move nothing).

fetch(i, into): the manager fetches of master, exp_avg, exp_avg_sq and grad are
  issued on the caller's thread, so NVMe reads start at once; one worker then
  waits for each, copies the view into ``into`` and releases it.
store(i, source): the worker fetches each state tensor (and param16) writable
  on its fastest addressable tier, copies ``source`` in and releases it; state
  homed on NVMe is then evicted from host, which writes it back and frees its
  pool buffer. The host cache left by fetch(i) usually makes that fetch a hit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from swap import trace

from .manager import TierManager
from .settings import Tier
from .shard_store import STATE_NAMES, ShardBuffers, ShardLayout, Transfer

_FETCHED = (*STATE_NAMES, "grad")


class TierShardStore:
    """ShardStore over a TierManager; see the module docstring."""

    def __init__(self, manager: TierManager, keys: Sequence[Mapping[str, str]],
                 layout: ShardLayout) -> None:
        if len(keys) != len(layout.numels):
            raise ValueError(f"TierShardStore: {len(keys)} key maps for "
                             f"{len(layout.numels)} shards in the layout")
        for i, (k, n) in enumerate(zip(keys, layout.numels, strict=True)):
            missing = [c for c in _FETCHED if c not in k]
            if n and missing:
                raise ValueError(f"TierShardStore: shard {i} has no key for {missing}")
        self._mgr = manager
        self._keys = [dict(k) for k in keys]
        self._layout = layout
        # One worker copies between the manager's views and the optimizer's
        # buffers, so fetch()/store() return at once and copies keep their order.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tierzero-shard-store")

    @property
    def layout(self) -> ShardLayout:
        return self._layout

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._mgr.host_empty(numel, dtype)

    def _tier(self, key: str) -> Tier:
        return "device" if self._mgr.home_of(key) == "device" else "host"

    def fetch(self, index: int, into: ShardBuffers) -> Transfer:
        numel = self._layout.numels[index]
        if numel == 0:
            return Transfer("fetch", index, into, [_done()])
        keys = self._keys[index]
        pending = [(name, keys[name], self._mgr.fetch(keys[name], self._tier(keys[name])))
                   for name in _FETCHED]

        def run() -> None:
            try:
                for name, key, t in pending:
                    view = t.wait()
                    with trace.span("copy", key, direction="state_in", bytes=view.nbytes):
                        getattr(into, name)[:numel].copy_(view)
            finally:
                for _name, key, _t in pending:
                    self._mgr.release(key)

        return Transfer("fetch", index, into, [self._worker.submit(run)])

    def store(self, index: int, source: ShardBuffers) -> Transfer:
        numel = self._layout.numels[index]
        if numel == 0:
            return Transfer("store", index, source, [_done()])
        keys = self._keys[index]
        names = [*STATE_NAMES]
        if source.param16 is not None and "param16" in keys:
            names.append("param16")

        def run() -> None:
            for name in names:
                key, tier = keys[name], self._tier(keys[name])
                view = self._mgr.fetch(key, tier, writable=True).wait()
                try:
                    with trace.span("copy", key, direction="state_out", bytes=view.nbytes):
                        view.copy_(getattr(source, name)[:numel])
                finally:
                    self._mgr.release(key, tier)
                if self._mgr.home_of(key) == "nvme":
                    self._mgr.evict(key)  # write back now, free the pool buffer

        return Transfer("store", index, source, [self._worker.submit(run)])

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _done() -> Future[None]:
    f: Future[None] = Future()
    f.set_result(None)
    return f
