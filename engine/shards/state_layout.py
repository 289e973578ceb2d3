"""How each shard group's tensors are kept: manager keys, pieces, stored form, and the host
buffers the streamed CPU Adam needs for them. Shared by the store (engine/shards/tiered.py)
and the streamed step (engine/step/streamed.py); holds no tensor.

Manager keys are "<group key>:<class>"; master and moments streamed from NVMe in several
pieces (offload.optimizer.chunk_numel, [Note: optimizer state in chunks] in
offload/adam_stream.py) are "<group key>:<class>@<first element>" per piece:

    group "blk.0/bf16/trainable", 2.5M elements, chunk_numel 1M
      param, grad                 blk.0/bf16/trainable:param        [0, 2.5M)
      master, exp_avg, exp_avg_sq blk.0/bf16/trainable:master@0     [0, 1M)
                                  blk.0/bf16/trainable:master@1000000 ...

Moments kept compressed (offload.optimizer.state_precision bf16 / int8, see
offload/state_codec.py) are uint8 manager keys of state_codec.moment_nbytes(numel) bytes.
With offload.optimizer.master_precision bf16 a trainable group has no master key: its
param is the master ([Note: bf16 master weights] in offload/bf16_master.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierzero.offload import ShardSpec
from tierzero.offload.bf16_master import check_master, shard_salt
from tierzero.offload.host_ring import page_up
from tierzero.offload.settings import (
    MOMENT_CLASSES,
    OPTIMIZER_CLASSES,
    STATE_CLASSES,
    TENSOR_CLASSES,
    TensorClass,
)
from tierzero.offload.state_codec import StoredLayout, moment_nbytes
from tierzero.offload.stream_sizes import param_assembly_bytes, piece_bytes, ring_capacity

Pieces = list[tuple[str, int, int]]  # (manager key, first element, end) of each piece

# [Note: the ring's floor]
# The CPU Adam ring's bytes are how far its reads run ahead of the update. In the deferred
# and speculated steps the update runs on its own thread beside forward's or backward's
# compute, which takes every core for a unit's compute at a time; meanwhile the reads fill
# the ring and then stop, and the drive idles until the update frees room. Four mean fp32
# pieces are a few request sizes, less of the drive's time than one unit's compute at the
# users' scale. So the default ring holds at least the largest shard group's streamed
# state as the ring carries it (its pieces, piece_bytes, at their precision): reads run a
# unit ahead; up to RING_FLOOR_BYTES, a fixed size, so a model of large units does not pay
# a whole unit's fp32 state in host memory. Host memory stays bounded by the largest unit.
# An explicit offload.optimizer.buffer_bytes is taken as it is.
RING_FLOOR_BYTES = 256 << 20

# [Note: dry-run pieces]
# tierzero plan runs the engine on meta tensors and counts bytes ([Note: plan from the
# engine] in engine/plan/dry_run.py). Every piece of master and moments is a record in the tier
# manager and an item of the CPU Adam's stream, and each costs Python work per step: at
# the default chunk_numel (1M elements) a 70B model has ~70,000 pieces per kind. A dry run
# therefore cuts each shard into at most DRY_PIECES pieces (never smaller than
# chunk_numel). The bytes it counts are the same (the same elements cross the same tiers:
# the state pieces are read into the stream's ring, never into the manager's pool, and the
# dry swap counts logical bytes), a shard is in several pieces exactly when it would be in
# a real run, and the host memory it reports for the stream's buffers (ring_bytes,
# param_ring_bytes, the tier budget's host_outside) is computed from the real pieces.
# Two things differ from a real run: the stream's own ring on meta is larger (it must hold
# a coarse piece; the dry run reports pipeline_bytes() instead of what that ring took), and
# its read-ahead during forward covers whole coarse pieces, so some state reads count in
# forward instead of backward (the step's totals are exact; the split between the two
# phases is not).
DRY_PIECES = 16


@dataclass(frozen=True)
class _Group:
    numel: int  # elements of this rank's shard
    kinds: tuple[TensorClass, ...]  # param, and the optimizer classes when trainable
    dtype: torch.dtype  # the compute dtype (param's)


@dataclass(frozen=True)
class RingRequest:
    """offload.optimizer.buffer_count buffers of buffer_bytes each (None: the mean piece
    as fp32 state, the ring at least a unit's state up to RING_FLOOR_BYTES,
    StateLayout.ring_bytes), the shards cut for that mean at `piece_numel` elements
    (None: at the real pieces)."""

    buffer_count: int
    buffer_bytes: int | None
    piece_numel: int | None = None


class StateLayout:
    """Every declared group's classes, pieces and stored form.

    `streamed`: the CPU Adam streams master and moments through its ring (state off the
    host), which is what `chunk_numel` (elements per piece, 0: whole shards) and the ring
    sizes apply to. `coarse`: a dry run ([Note: dry-run pieces]). `master_precision` bf16:
    trainable groups keep no master ([Note: bf16 master weights]); `rank` names this rank's
    shards in the salt of their stochastic rounding.
    """

    def __init__(self, *, streamed: bool, chunk_numel: int, state_precision: str,
                 coarse: bool, ring: RingRequest,
                 grad_dtype: torch.dtype = torch.float32, master_precision: str = "fp32",
                 rank: int = 0) -> None:
        check_master(master_precision)
        self.master_precision = master_precision
        self.rank = rank
        self.streamed = streamed
        self.grad_dtype = grad_dtype  # [Note: gradient precision] in shards/grad_precision.py
        self.chunk_numel = chunk_numel if streamed else 0
        self.state_precision = state_precision
        self.coarse = coarse and self.chunk_numel > 0
        self.ring = ring
        self._groups: dict[str, _Group] = {}

    # -- groups ------------------------------------------------------------------------
    def declare(self, key: str, numel: int, compute_dtype: torch.dtype,
                trainable: bool) -> None:
        if key in self._groups:
            raise ValueError(f"shard group {key!r} declared twice")
        optim = tuple(c for c in OPTIMIZER_CLASSES
                      if c != "master" or self.master_precision == "fp32")
        kinds = ("param", *optim) if trainable else ("param",)
        self._groups[key] = _Group(numel, kinds, compute_dtype)

    def matches(self, key: str, numel: int, compute_dtype: torch.dtype,
                trainable: bool) -> bool:
        """Group `key` was declared with these sizes."""
        g = self._groups.get(key)
        return g is not None and (g.numel, g.dtype, len(g.kinds) > 1) == (
            numel, compute_dtype, trainable)

    def check(self, key: str, kind: TensorClass) -> None:
        """KeyError naming the group unless it has `kind`."""
        g = self._groups.get(key)
        if g is None:
            raise KeyError(f"no shard group {key!r}; known: {sorted(self._groups)[:10]}")
        if kind not in g.kinds:
            raise KeyError(f"shard group {key!r} has no {kind!r} tensor (frozen parameters "
                           "keep only param)")

    def has(self, key: str, kind: TensorClass) -> bool:
        g = self._groups.get(key)
        return g is not None and kind in g.kinds

    def group_keys(self) -> list[str]:
        return list(self._groups)

    def kinds(self, key: str) -> tuple[TensorClass, ...]:
        return self._groups[key].kinds

    def numel(self, key: str) -> int:
        return self._groups[key].numel

    def param_dtype(self, key: str) -> torch.dtype:
        return self._groups[key].dtype

    # -- keys and pieces ---------------------------------------------------------------
    def pieces(self, key: str, kind: TensorClass) -> Pieces:
        """(manager key, first element, end) of each piece of ``kind`` of group ``key``:
        master and moments of a shard above chunk_numel elements are stored in pieces of
        that size ([Note: optimizer state in chunks]); everything else is one piece under
        "<key>:<kind>"."""
        n = self._groups[key].numel
        step = self.chunk_numel
        if kind not in STATE_CLASSES or not step or n <= step:
            return [(f"{key}:{kind}", 0, n)]
        if self.coarse:
            step = max(step, -(-n // DRY_PIECES))
        return [(f"{key}:{kind}@{lo}", lo, min(n, lo + step)) for lo in range(0, n, step)]

    def manager_key(self, key: str, kind: TensorClass) -> str:
        """The manager key of a kind stored in one piece (see pieces() for the others)."""
        self.check(key, kind)
        pieces = self.pieces(key, kind)
        if len(pieces) != 1:
            raise KeyError(f"shard group {key!r} keeps its {kind} in {len(pieces)} pieces; "
                           "use pieces()")
        return pieces[0][0]

    def stream_pieces(self, key: str) -> list[tuple[int, int, dict[str, str]]]:
        """(lo, hi, {master / exp_avg / exp_avg_sq: manager key}) of each piece of group
        ``key``'s optimizer state, as offload.AdamStream takes them (no master with a bf16
        master: the stream reads the param)."""
        kinds = [c for c in STATE_CLASSES if c in self.kinds(key)]
        per = [self.pieces(key, kind) for kind in kinds]
        return [(parts[0][1], parts[0][2], {str(c): p[0] for c, p in zip(
                    kinds, parts, strict=True)}) for parts in zip(*per, strict=True)]

    def master_salt(self, key: str) -> int:
        """The salt of group ``key``'s bf16 master rounding on this rank (bf16_master)."""
        return shard_salt(f"{key}@rank{self.rank}")

    def specs(self) -> list[ShardSpec]:
        """Every piece as the tier manager holds it, in declaration order (blocks in
        forward order, the root last: the order the host allowance takes param in, [Note:
        which shards the host keeps] in engine/shards/tier_config.py)."""
        return [self._spec(mkey, kind, hi - lo, g.dtype) for key, g in self._groups.items()
                for kind in g.kinds for mkey, lo, hi in self.pieces(key, kind)]

    def _spec(self, mkey: str, kind: TensorClass, numel: int, dtype: torch.dtype) -> ShardSpec:
        if kind == "param":
            return ShardSpec(mkey, kind, numel, dtype)
        if self.compressed(kind):
            return ShardSpec(mkey, kind, moment_nbytes(numel, self.state_precision), torch.uint8)
        return ShardSpec(mkey, kind, numel, self.grad_dtype if kind == "grad" else torch.float32)

    # -- stored form -------------------------------------------------------------------
    def compressed(self, kind: str) -> bool:
        """``kind`` is a moment kept compressed (uint8 keys, [Note: 8-bit moment codes])."""
        return self.state_precision != "fp32" and kind in MOMENT_CLASSES

    def moment_layout(self, key: str, kind: TensorClass) -> StoredLayout:
        """How moment `kind` of `key` is stored: state_precision, in these pieces ([Note:
        stored moment layout] in offload/state_codec.py)."""
        self.check(key, kind)
        pieces = self.pieces(key, kind)
        return StoredLayout.of(self.state_precision if self.compressed(kind) else "fp32",
                               self.numel(key), pieces[0][2] - pieces[0][1])

    def stored_ranges(self, key: str, kind: TensorClass) -> tuple[Pieces, int]:
        """A compressed moment's pieces as (manager key, first byte, end byte) of its
        stored bytes laid end to end in element order, and their total."""
        out, pos = [], 0
        for mkey, lo, hi in self.pieces(key, kind):
            nb = moment_nbytes(hi - lo, self.state_precision)
            out.append((mkey, pos, pos + nb))
            pos += nb
        return out, pos

    def nbytes(self) -> dict[str, int]:
        """Bytes held per class, as stored."""
        out: dict[str, int] = dict.fromkeys(TENSOR_CLASSES, 0)
        for g in self._groups.values():
            for kind in g.kinds:
                if self.compressed(kind):
                    out[kind] += moment_nbytes(g.numel, self.state_precision)
                    continue
                dtype = {"param": g.dtype, "grad": self.grad_dtype}.get(kind, torch.float32)
                size = torch.finfo(dtype).bits // 8
                out[kind] += g.numel * size
        return out

    # -- the streamed CPU Adam's host buffers (offload/stream_sizes.py) ----------------
    def _real_lengths(self, n: int, step: int | None = None) -> list[tuple[int, int]]:
        """(length, how many) of the pieces a shard of ``n`` elements has in a real run
        (cut at `step` elements instead: the ring's default, RingRequest.piece_numel): the
        full pieces and the shorter last one. By length, not piece by piece: a 70B model
        has tens of thousands of pieces, all of one or two lengths."""
        step = self.chunk_numel if step is None else step
        if not step or n <= step:
            return [(n, 1)]
        full, rest = divmod(n, step)
        return [(step, full)] + ([(rest, 1)] if rest else [])

    def ring_bytes(self) -> int:
        """Host bytes of the CPU Adam stream's ring ([Note: streamed optimizer step]): the
        requested buffers, at least the largest piece's; from the real pieces, also in a
        dry run. 0 when nothing streams. buffer_bytes None: each buffer is the mean piece's
        fp32 master and moments (with the bf16/fp16 param of a shard in one piece) whatever
        the state and master precision, the shards cut at RingRequest.piece_numel (fp32's
        pieces: [Note: a moment piece is one request] in tier_config.py); the ring at least
        the largest group's streamed state, up to RING_FLOOR_BYTES ([Note: the ring's
        floor]): the ring's bytes are how far reads run ahead of the update and writes
        behind it, which the drive needs in bytes, so compressed pieces (int8 moments and a
        bf16 master: a sixth of the bytes, in pieces of four times the elements) fill the
        same ring several to a buffer instead of leaving the drive a sixth of the work in
        flight."""
        if not self.streamed:
            return 0
        state = [g for g in self._groups.values() if len(g.kinds) > 1 and g.numel]
        if not state:
            return 0
        sizes = {self._piece_bytes(g, length) for g in state
                 for length, _ in self._real_lengths(g.numel)}
        if self.ring.buffer_bytes is not None:
            return ring_capacity(self.ring.buffer_count * self.ring.buffer_bytes, sizes)
        fp32 = [(self._piece_bytes(g, length, fp32=True), count) for g in state
                for length, count in self._real_lengths(g.numel, self.ring.piece_numel)]
        each = sum(b * c for b, c in fp32) // sum(c for _, c in fp32)
        unit = max(sum(self._piece_bytes(g, length) * count
                       for length, count in self._real_lengths(g.numel)) for g in state)
        return ring_capacity(max(self.ring.buffer_count * each, min(unit, RING_FLOOR_BYTES)),
                             sizes)

    def _piece_bytes(self, g: _Group, length: int, *, fp32: bool = False) -> int:
        """The ring bytes of a piece of `length` elements of `g`; `fp32`: as if its master
        and moments were fp32."""
        low = torch.finfo(g.dtype).bits // 8 if g.dtype != torch.float32 else 0
        whole = length == g.numel  # one piece: its param is carved from the ring too
        if self.master_precision == "bf16" and not fp32:
            # the param is the master: in the ring if the shard is whole
            return piece_bytes(length, self.state_precision, 0, 2 if whole else 0)
        return piece_bytes(length, "fp32" if fp32 else self.state_precision,
                           low if whole else 0)

    def param_ring_bytes(self) -> int:
        """Host bytes where the stream assembles the new param of shards in several
        pieces: two of the largest such shard ([Note: optimizer state in chunks]); three
        with a bf16 master ([Note: shard inputs read ahead] in offload/shard_inputs.py)."""
        if not self.chunk_numel:
            return 0
        whole = [page_up(g.numel * (torch.finfo(g.dtype).bits // 8
                                    if g.dtype != torch.float32 else 4))
                 for g in self._groups.values()
                 if len(g.kinds) > 1 and g.numel > self.chunk_numel]
        return param_assembly_bytes(whole, 3 if self.master_precision == "bf16" else 2)

    def pipeline_bytes(self) -> int:
        """Host bytes the CPU Adam stream allocates outside the tier manager's pool: its
        ring and its param assembly room."""
        return self.ring_bytes() + self.param_ring_bytes()
