"""Where each flat shard's tensors live: the one object the tier manager will replace.

[Note: shard residency] Every per-rank shard tensor (`param16`, `grad`,
`master`, `exp_avg`, `exp_avg_sq`) is reached through `ShardStore.tensor()`;
nothing else in the engine keeps a reference across a step. `ShardStore`
keeps all of them in device memory (plain CPU memory without CUDA): the
store used when nothing is offloaded. `engine.offload_bridge.TieredShardStore`
is the same interface over offload's TierManager, which moves them between
device, pinned host and NVMe. Code that may run with either reads a shard
inside `with store.use(key, kind) as t:` (fetched and released around the
block); `tensor()` is for shards that stay put (the plain store, or device-
pinned optimizer state).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, get_args

import torch

ShardKind = Literal["param16", "grad", "master", "exp_avg", "exp_avg_sq"]
SHARD_KINDS: tuple[ShardKind, ...] = get_args(ShardKind)


@dataclass
class _Record:
    numel: int
    tensors: dict[ShardKind, torch.Tensor]  # 1D, `numel` elements each, on the store's device


class ShardStore:
    """Owns every shard tensor of this rank, keyed by flat-group name."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._records: dict[str, _Record] = {}

    def add(
        self, key: str, master_init: torch.Tensor, compute_dtype: torch.dtype, trainable: bool
    ) -> None:
        """Create the shard tensors of group `key` from its fp32 initial values (1D).

        With fp32 compute the master copy *is* the compute copy (one tensor, no
        duplicate); frozen groups keep only `param16`.
        """
        if key in self._records:
            raise ValueError(f"shard group {key!r} registered twice")
        n = master_init.numel()
        param16 = master_init.to(device=self.device, dtype=compute_dtype, copy=True)
        tensors: dict[ShardKind, torch.Tensor] = {"param16": param16}
        if trainable:
            master = param16 if compute_dtype == torch.float32 else master_init.to(
                device=self.device, dtype=torch.float32, copy=True)
            tensors["master"] = master
            for kind in ("grad", "exp_avg", "exp_avg_sq"):
                tensors[kind] = torch.zeros(n, dtype=torch.float32, device=self.device)
        self._records[key] = _Record(n, tensors)

    def tensor(self, key: str, kind: ShardKind) -> torch.Tensor:
        rec = self._records.get(key)
        if rec is None:
            raise KeyError(f"no shard group {key!r}; known: {sorted(self._records)[:10]}")
        t = rec.tensors.get(kind)
        if t is None:
            raise KeyError(f"shard group {key!r} has no {kind!r} tensor (frozen parameters "
                           "keep only param16)")
        return t

    @property
    def resident(self) -> bool:
        """Every shard tensor stays where it is for the store's life (views may be kept)."""
        return True

    @contextmanager
    def use(self, key: str, kind: ShardKind, *, writable: bool = False,
            overwrite: bool = False) -> Iterator[torch.Tensor]:
        """The shard tensor for the duration of the block (`writable`: it will be modified;
        `overwrite`: every element will be written, so a tiered store need not read it)."""
        del writable, overwrite  # every tensor here is the authoritative copy
        yield self.tensor(key, kind)

    def declare(self, key: str, numel: int, compute_dtype: torch.dtype, trainable: bool) -> None:
        """Group `key` will be added with `numel` elements; nothing to plan for resident
        shards."""
        del key, numel, compute_dtype, trainable

    def finalize(self) -> None:
        """Every group is declared; nothing to plan for resident shards."""

    def set_order(self, entries: list[tuple[str, ShardKind]]) -> None:
        """The upcoming shard uses (prefetch order); nothing to prefetch here."""
        del entries

    def tier_report(self) -> dict[str, object] | None:
        return None

    def close(self) -> None:
        """Nothing to release: tensors are freed with the store."""

    def has(self, key: str, kind: ShardKind) -> bool:
        rec = self._records.get(key)
        return rec is not None and kind in rec.tensors

    def group_keys(self) -> list[str]:
        return list(self._records)

    def write_param16_from_master(self, key: str) -> None:
        """After the optimizer step: the compute copy follows the fp32 master."""
        rec = self._records[key]
        master, param16 = rec.tensors["master"], rec.tensors["param16"]
        if master is not param16:
            param16.copy_(master)

    def nbytes(self) -> dict[str, int]:
        """Bytes held per shard kind (aliased tensors counted once)."""
        out: dict[str, int] = {kind: 0 for kind in SHARD_KINDS}
        for rec in self._records.values():
            seen: set[int] = set()
            for kind, t in rec.tensors.items():
                if id(t) not in seen:
                    seen.add(id(t))
                    out[kind] += t.numel() * t.element_size()
        return out
