"""TierShardStore: the pipelined CPU Adam's ShardStore, backed by the TierManager.

Implements [Note: shard store contract] (offload/shard_store.py) on top of the
manager, so the optimizer step reads and writes state wherever placement put
it (host, or NVMe through the pool) under the manager's budgets and accounting.
``keys[i]`` maps tensor class -> the manager's shard key for optimizer shard i
(``param16`` optional; shards with 0 elements have no keys and move nothing).

fetch(i, into): one worker reads master, exp_avg, exp_avg_sq and grad straight
  into ``into`` (TierManager.read_into: NVMe-homed state goes from the swap file
  to the buffer, no pool buffer); store(i, source): the worker writes the state
  (and param16) from ``source`` (TierManager.write_from), reading nothing first.
  The engine's optimizer uses offload.AdamStream instead, which also keeps its
  traffic running across steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .manager import TierManager
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

    def fetch(self, index: int, into: ShardBuffers) -> Transfer:
        numel = self._layout.numels[index]
        if numel == 0:
            return Transfer("fetch", index, into, [_done()])
        keys = self._keys[index]

        def run() -> None:
            # straight into the caller's buffers (NVMe: no pool buffer, no extra copy)
            pending = [self._mgr.read_into(keys[name], getattr(into, name)[:numel])
                       for name in _FETCHED]
            for t in pending:
                t.wait()

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
            # the whole shard is overwritten: nothing is read first (a staged store that
            # fetched the old state writable read every byte twice per step)
            pending = [self._mgr.write_from(keys[name], getattr(source, name)[:numel])
                       for name in names]
            for t in pending:
                t.wait()

        return Transfer("store", index, source, [self._worker.submit(run)])

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _done() -> Future[None]:
    f: Future[None] = Future()
    f.set_result(None)
    return f
