"""Where each flat shard's tensors live: the one object the tier manager will replace.

[Note: shard residency] Every per-rank shard tensor (`param`, `grad`,
`master`, `exp_avg`, `exp_avg_sq`) is reached through `ShardStore.tensor()`;
`param` is the shard in the compute dtype (bf16/fp16; with fp32 compute it is the
fp32 master itself, one tensor), what gathers read and the step writes;
nothing else in the engine keeps a reference across a step. `ShardStore`
keeps all of them in device memory (plain CPU memory without CUDA): the
store used when nothing is offloaded. `engine.shards.tiered.TieredShardStore`
is the same interface over offload's TierManager, which moves them between
device, pinned host and NVMe. Code that may run with either reads a shard
inside `with store.use(key, kind) as t:` (fetched and released around the
block); `tensor()` is for shards that stay put (the plain store, or device-
pinned optimizer state).

Callers never test which store they hold: each store says what they may do
(`keeps_views`, `prefetches`, `snapshot_parts`, `optimizer_offloaded`) and keeps
the "gradient zeroed" rule itself ([Note: gradients zeroed on first use]).

[Note: gradients zeroed on first use]
zero_grad() does not write zeros over every gradient shard (a memset of every
gradient would sit on the step's critical path, which plain PyTorch's set-to-None does
not pay): it marks each group's gradient shard zero here (`mark_grads_zeroed`), and the
store turns the mark into zeros when the shard is first used, so callers keep no rule:
- a reduction (`use_grad_sum`) is told the shard is fresh and writes its gradient where
  it would have added it (zeros only where no gradient covers); a fresh shard homed on
  NVMe is not read;
- `use(key, "grad")` and `tensor(key, "grad")` of a marked shard zero it first (a step
  with no backward since, a checkpoint saved mid-accumulation); `use(overwrite=True)`
  (a checkpoint load) just takes the mark;
- `set_order` leaves a marked shard's read out of the prefetch order;
- the update deferred into the next forward reads its gradient with `as_reduced=True`:
  the bytes its step measured, not the mark zero_grad() made after that step;
- the streamed CPU Adam reads gradients through the tier manager, past `use()`, so it
  has the marked ones written first (`write_zeroed_grads`).
A new shard's gradient (`add`) is zero and marked so too: the first step's reductions
write their gradients instead of reading zeros back (from NVMe, where it is homed) to add
to. Every zero written this way is one the eager memset would have written; none is added.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tierzero.offload.settings import OPTIMIZER_CLASSES, TENSOR_CLASSES, TensorClass
from tierzero.offload.state_codec import StoredLayout

if TYPE_CHECKING:
    from tierzero.engine.shards.snapshot import Part, StoreSnapshot

log = logging.getLogger(__name__)


@dataclass
class _Record:
    numel: int
    tensors: dict[TensorClass, torch.Tensor]  # 1D, `numel` elements each, on the store's device


class ShardStore:
    """Owns every shard tensor of this rank, keyed by flat-group name."""

    def __init__(self, device: torch.device, grad_dtype: torch.dtype = torch.float32) -> None:
        self.device = device
        # fp32, or the compute dtype where that is exact ([Note: gradient precision] in
        # shards/grad_precision.py)
        self.grad_dtype = grad_dtype
        self._records: dict[str, _Record] = {}
        # groups reduced into since their last mark (or creation), and whether a second
        # reduction into a compute-precision shard was logged ([Note: gradient precision])
        self._reduced: set[str] = set()
        self._warned_low_sum = False
        # groups whose gradient shard is logically zero but not written ([Note:
        # gradients zeroed on first use])
        self._zeroed: set[str] = set()

    def add(
        self, key: str, master_init: torch.Tensor, compute_dtype: torch.dtype, trainable: bool
    ) -> None:
        """Create the shard tensors of group `key` from its fp32 initial values (1D).

        With fp32 compute the master copy *is* the compute copy (one tensor, no
        duplicate); frozen groups keep only `param`.
        """
        if key in self._records:
            raise ValueError(f"shard group {key!r} registered twice")
        n = master_init.numel()
        param = master_init.to(device=self.device, dtype=compute_dtype, copy=True)
        tensors: dict[TensorClass, torch.Tensor] = {"param": param}
        if trainable:
            master = param if compute_dtype == torch.float32 else master_init.to(
                device=self.device, dtype=torch.float32, copy=True)
            tensors["master"] = master
            for kind in (c for c in OPTIMIZER_CLASSES if c != "master"):  # zeros
                dtype = self.grad_dtype if kind == "grad" else torch.float32
                tensors[kind] = torch.zeros(n, dtype=dtype, device=self.device)
        self._records[key] = _Record(n, tensors)
        if trainable:
            self._zeroed.add(key)  # a new gradient is zero: [Note: gradients zeroed on first use]

    def tensor(self, key: str, kind: TensorClass) -> torch.Tensor:
        """The shard itself (a marked gradient zeroed first: [Note: gradients zeroed on
        first use])."""
        return self._zero_if_marked(key, kind, self._tensor(key, kind))

    def _tensor(self, key: str, kind: TensorClass) -> torch.Tensor:
        rec = self._records.get(key)
        if rec is None:
            raise KeyError(f"no shard group {key!r}; known: {sorted(self._records)[:10]}")
        t = rec.tensors.get(kind)
        if t is None:
            raise KeyError(f"shard group {key!r} has no {kind!r} tensor (frozen parameters "
                           "keep only param)")
        return t

    # -- what callers may do with the shards ------------------------------------------
    @property
    def keeps_views(self) -> bool:
        """A shard tensor stays where it is, authoritative, for the store's life: a caller
        may keep a view of it past `use()` (a gather viewing the param shard, a
        reduction accumulating into the gradient shard asynchronously)."""
        return True

    @property
    def prefetches(self) -> bool:
        """`set_order()` acts: the store reads ahead of the uses it is told of."""
        return False

    def snapshot_parts(self, key: str, kind: TensorClass) -> list[Part] | None:
        """Where a background checkpoint reads this shard later ([Note: snapshot parts] in
        engine/shards/snapshot.py); None: copy it at the save. Resident shards live within
        the device's memory, not beyond the host's: they are copied."""
        del key, kind
        return None

    def open_snapshot(self, keys: list[str], copy_limit: int,
                      awaiting: Collection[str] = ()) -> StoreSnapshot | None:
        """Record the parts `keys` (from snapshot_parts) as they are now, those in
        `awaiting` once an update in progress has ended (StoreSnapshot.landed); None: no
        parts."""
        del copy_limit, awaiting
        if keys:
            raise ValueError(f"this store hands out no snapshot parts; got {keys[:3]}")
        return None

    @property
    def optimizer_offloaded(self) -> bool:
        """Master and moments live off the device: the CPU Adam updates them (never a
        torch optimizer over `tensor()` views)."""
        return False

    @contextmanager
    def use(self, key: str, kind: TensorClass, *, writable: bool = False,
            compute: bool = True, overwrite: bool = False,
            as_reduced: bool = False) -> Iterator[torch.Tensor]:
        """The shard tensor for the duration of the block (`writable`: it will be modified;
        `compute`: for a gather, so on the compute device; `overwrite`: every element will
        be written, so a tiered store need not read it). A gradient marked zero is zeroed
        first, unless `overwrite`; `as_reduced`: the gradient's bytes as its reduction left
        them, mark or not ([Note: gradients zeroed on first use])."""
        del writable, compute  # every tensor here is the authoritative copy
        t = self._tensor(key, kind)
        yield t if as_reduced else self._zero_if_marked(key, kind, t, overwrite=overwrite)

    def lend(self, key: str) -> torch.Tensor | None:
        """Group `key`'s whole param shard in host memory, held past this call, for a gather
        that views it instead of copying it until `end_lend(key)` ([Note: a gather viewing
        the pool's buffer] in shards/lent.py); None: not lent (here a gather on the
        shard's device views the shard itself)."""
        self._tensor(key, "param")  # an unknown key is an error, as in use()
        return None

    def end_lend(self, key: str) -> None:
        """The gather that `lend(key)` served is done with the shard."""
        raise RuntimeError(f"end_lend({key!r}): this store lends nothing")

    def version(self, key: str, kind: TensorClass) -> int | None:
        """A counter that changes whenever the shard's data may change (a copy taken at
        version v is current while this still returns v); None: the store keeps none
        (here the shards are the tensors themselves)."""
        self._tensor(key, kind)  # an unknown key or class is an error, as in use()
        return None

    def moment_layout(self, key: str, kind: TensorClass) -> StoredLayout:
        """How moment `kind` of group `key` is stored ([Note: stored moment layout] in
        offload/state_codec.py): fp32, one piece, here."""
        return StoredLayout.of("fp32", self.tensor(key, kind).numel())

    @contextmanager
    def use_stored(self, key: str, kind: TensorClass, *,
                   overwrite: bool = False) -> Iterator[torch.Tensor]:
        """Moment `kind` in its stored form (`moment_layout`), on its home tier, for the
        block (checkpoints copy these bytes as they are); `overwrite`: the block writes
        every byte."""
        with self.use(key, kind, compute=False, writable=overwrite, overwrite=overwrite) as t:
            yield t

    # -- gradients zeroed on first use ------------------------------------------------
    def mark_grads_zeroed(self, keys: Iterable[str]) -> None:
        """zero_grad(): these gradient shards are zero from now on, without a byte written."""
        keys = list(keys)
        self._zeroed.update(keys)
        self._reduced.difference_update(keys)

    def grad_zeroed(self, key: str) -> bool:
        """The gradient shard of `key` is marked zero (its bytes are stale until used)."""
        return key in self._zeroed

    @contextmanager
    def use_grad_sum(self, key: str) -> Iterator[tuple[torch.Tensor, bool]]:
        """The gradient shard for a reduction to add into, and whether it is fresh: marked
        zero, so its contents are undefined (not read) and the caller writes every element
        instead of adding ([Note: gradients zeroed on first use])."""
        fresh = self.grad_zeroed(key)
        again = key in self._reduced
        self._reduced.add(key)
        if again and self.grad_dtype != torch.float32 and not self._warned_low_sum:
            self._warned_low_sum = True
            log.warning(
                "gradient of %s gets a second contribution in this step (a late gradient, "
                "or backward() twice before step()); it is added in %s, the dtype its "
                "shard is kept in ([Note: gradient precision]); set precision.grad_dtype: "
                "fp32 to sum in fp32", key, str(self.grad_dtype).removeprefix("torch."))
        with self.use(key, "grad", writable=True, overwrite=fresh) as t:
            yield t, fresh

    def write_zeroed_grads(self, keys: Sequence[str]) -> None:
        """Write the zeros of the marked gradient shards among `keys`, for a reader that
        reaches them past `use()` (the streamed CPU Adam)."""
        for key in [k for k in keys if k in self._zeroed]:
            with torch.no_grad(), self.use(key, "grad"):
                pass  # use() writes the zeros and takes the mark

    def _zero_if_marked(self, key: str, kind: TensorClass, t: torch.Tensor, *,
                        overwrite: bool = False) -> torch.Tensor:
        """`t` (the gradient shard of `key`) with zero_grad()'s mark turned into zeros, or
        just taken when the caller overwrites every element."""
        if kind == "grad" and key in self._zeroed:
            if not overwrite:
                with torch.no_grad():
                    t.zero_()
            self._zeroed.discard(key)
        return t

    def declare(self, key: str, numel: int, compute_dtype: torch.dtype, trainable: bool) -> None:
        """Group `key` will be added with `numel` elements; nothing to plan for resident
        shards."""
        del key, numel, compute_dtype, trainable

    def finalize(self) -> None:
        """Every group is declared; nothing to plan for resident shards."""

    def set_order(self, entries: list[tuple[str, TensorClass]]) -> None:
        """The upcoming shard uses (prefetch order); nothing to prefetch here."""
        del entries

    def tier_report(self) -> dict[str, object] | None:
        return None

    def close(self) -> None:
        """Nothing to release: tensors are freed with the store."""

    def has(self, key: str, kind: TensorClass) -> bool:
        rec = self._records.get(key)
        return rec is not None and kind in rec.tensors

    def group_keys(self) -> list[str]:
        return list(self._records)

    def write_param_from_master(self, key: str) -> None:
        """After the optimizer step: the compute copy follows the fp32 master."""
        rec = self._records[key]
        master, param = rec.tensors["master"], rec.tensors["param"]
        if master is not param:
            param.copy_(master)

    def nbytes(self) -> dict[str, int]:
        """Bytes held per shard kind (aliased tensors counted once)."""
        out: dict[str, int] = {kind: 0 for kind in TENSOR_CLASSES}
        for rec in self._records.values():
            seen: set[int] = set()
            for kind, t in rec.tensors.items():
                if id(t) not in seen:
                    seen.add(id(t))
                    out[kind] += t.numel() * t.element_size()
        return out
