"""A shard's whole-shard inputs to the streamed CPU Adam, read one shard ahead.

[Note: shard inputs read ahead]
The stream's ring reads each piece's master and moments ahead ([Note: streamed optimizer
step] in offload/adam_stream.py), but two inputs are whole-shard: the gradient (one
manager key per shard, used as a view of its host home or cache) and, with a bf16 master
([Note: bf16 master weights] in offload/bf16_master.py), the param of a shard in several
pieces, which is the master and is read whole into the param assembly room. Read only
when the shard's turn came, both are waited for by whoever drives the update, with the
drive idle behind them: at 2.07B with int8 moments they are most of the update's reads
(gradient 1.6 and param 2 of its 5.6 B/param). So once every gradient of the step is
final (a step run whole, or deferred into the next forward), the shard after the one
being updated has its gradient fetched and its param read while this one updates:

    driver   | update k          | update k+1        | ...
    drive    | grad, param k+1   | grad, param k+2   |  (the pieces' state beside them)

Only one shard ahead: the gradient held is one more pool buffer, taken only when the pool
has room for it now (TierManager.fetch_ahead: waiting for room while holding the current
shard's gradient could wait on that very hold; without room the shard is read in its
turn), and the param room has three regions instead of two (one being updated, one read
ahead, one being written; stream_sizes.param_assembly_bytes). While backward still runs a
gradient may change, so a step begun during backward reads the inputs when each shard's
turn comes.

[Note: a param held in host memory]
A whole-shard param read is a copy of bytes some other part of the process may hold
already: the engine's gathered buffer of a unit that stays gathered through backward (the
root, a unit kept for its backward: [Note: reuse distance]) holds this rank's shard of the
param, exactly, as the gather copied it. When the update runs while backward does (a
speculated step, the unclipped early step), such a shard's param is read back from NVMe
only because its cache left the pool (benchmarks/RESULTS.md, "Two training-thread waits
out of the update run during backward"). `source` (AdamStream.param_source) names those
copies: a shard's
param it returns is copied from it instead of read. Its caller guarantees the copy is the
param's current value (the engine checks the manager's version against the one its gather
copied) and that it stays alive until issue() returns; it is consulted only on the thread
that drives the stream, which is the thread that would release the copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .errors import OffloadError
from .manager import TierManager
from .param_assembly import ParamAssembly
from .settings import Tier
from .transfer import TierTransfer

log = logging.getLogger(__name__)

# shard index -> a host copy of its param as it is now, or None ([Note: a param held in
# host memory])
ParamSource = Callable[[int], "torch.Tensor | None"]


@dataclass
class ShardInputs:
    """One shard's gradient, fetched (held until `release`), and the param room `taken`
    from the assembly (start, view) with its read in flight (`param`; bf16 master)."""

    pos: int
    gkey: str
    tier: Tier
    grad: TierTransfer
    taken: tuple[int, torch.Tensor] | None
    param: TierTransfer | None


class ShardAhead:
    """Issues ShardInputs and keeps at most one read ahead; see [Note: shard inputs read
    ahead]. `read_param`: the master is the bf16 param (read whole for a shard in pieces)."""

    def __init__(self, manager: TierManager, keys: Sequence[Mapping[str, str]],
                 numels: Sequence[int], pieces: Sequence[int], assembly: ParamAssembly | None,
                 *, read_param: bool) -> None:
        self._mgr = manager
        self._keys = keys
        self._numels = numels
        self._pieces = pieces  # per shard: how many pieces
        self._p16 = assembly
        self._read_param = read_param
        self._held: ShardInputs | None = None
        self.source: ParamSource | None = None  # [Note: a param held in host memory]

    def assembled(self, index: int) -> bool:
        """The shard's new param is assembled whole (several pieces, with a param)."""
        return (self._p16 is not None and self._pieces[index] > 1
                and "param" in self._keys[index])

    def issue(self, pos: int, index: int, *, ahead: bool = False) -> ShardInputs | None:
        """Start the reads of shard `index` (at `pos` of the step's order); nothing waited.
        `ahead`: while the caller holds the current shard's gradient: None when the
        gradient's cache needs room the pool does not have now (TierManager.fetch_ahead:
        waiting for room then could wait on what the caller holds)."""
        keys = self._keys[index]
        gkey = keys["grad"]
        tier: Tier = "device" if self._mgr.home_of(gkey) == "device" else "host"
        # 1D, its home (host) or a cache; not a use of the order prefetch follows
        got = (self._mgr.fetch_ahead(gkey, tier) if ahead
               else self._mgr.fetch(gkey, tier, ordered=False))
        if got is None:
            return None
        grad = got
        taken: tuple[int, torch.Tensor] | None = None
        param: TierTransfer | None = None
        try:
            if self._read_param and self.assembled(index) and self._p16 is not None:
                taken = self._p16.take(self._numels[index])
                held = self._held_param(index, taken[1])
                if held is not None:  # [Note: a param held in host memory]
                    taken[1].copy_(held)
                else:
                    # its write is announced when the update is deferred: this is its writer
                    param = self._mgr.read_into(keys["param"], taken[1], replacing=True)
        except BaseException:
            self._settle(ShardInputs(pos, gkey, tier, grad, None, None))
            raise
        return ShardInputs(pos, gkey, tier, grad, taken, param)

    def _held_param(self, index: int, room: torch.Tensor) -> torch.Tensor | None:
        """The source's copy of shard `index`'s param, checked against its `room`."""
        held = None if self.source is None else self.source(index)
        if held is not None and (held.numel() != room.numel() or held.dtype != room.dtype
                                 or held.device.type != "cpu"):
            raise OffloadError(f"internal: the param held for shard {index} is {held.numel()} "
                               f"x {held.dtype} on {held.device}; the shard's is "
                               f"{room.numel()} x {room.dtype} in host memory")
        return held

    def take(self, pos: int, index: int) -> ShardInputs:
        """Shard `index`'s inputs: those read ahead for `pos`, else issued now."""
        held, self._held = self._held, None
        if held is not None:
            if held.pos == pos:
                return held
            self._settle(held)
            raise OffloadError(f"internal: the optimizer read shard {held.pos} of the step "
                               f"ahead and is at shard {pos}")
        now = self.issue(pos, index)
        if now is None:
            raise OffloadError(f"internal: the optimizer's fetch of shard {pos}'s inputs "
                               "returned nothing")
        return now

    def ahead(self, pos: int, order: Sequence[int]) -> None:
        """Read ahead the next shard of `order` after `pos` that has elements."""
        nxt = next((p for p in range(pos + 1, len(order)) if self._numels[order[p]]), None)
        if self._held is None and nxt is not None:
            self._held = self.issue(nxt, order[nxt], ahead=True)  # None: read in its turn

    def ready(self, inputs: ShardInputs, index: int
              ) -> tuple[torch.Tensor, tuple[int, torch.Tensor] | None]:
        """Wait for the inputs: (the gradient's 1D view, the room of the new param when it is
        assembled whole, taken now if it was not read into)."""
        grad = inputs.grad.wait()
        taken = inputs.taken
        if taken is None and self.assembled(index) and self._p16 is not None:
            taken = self._p16.take(self._numels[index])
        if inputs.param is not None:  # a bf16 master, read whole
            inputs.param.wait()
        return grad, taken

    def is_param(self, shard: int, key: str) -> bool:
        """`key` is the shard's param (a bf16 master of a shard in one piece is read as its
        "master"): the stream writes it, so an announced write of it is its own."""
        return key == self._keys[shard].get("param")

    def drop(self) -> None:
        """Forget the read ahead (its reads settled, its gradient released)."""
        held, self._held = self._held, None
        if held is not None:
            self._settle(held)

    def _settle(self, inputs: ShardInputs) -> None:
        """Wait for the reads into our buffers without raising, release the gradient."""
        for t in (inputs.grad, inputs.param):
            if t is not None:
                try:
                    t.wait()
                except Exception as exc:  # an interrupt goes on up
                    log.warning("while dropping the optimizer's read-ahead: %s", exc)
        self._mgr.release(inputs.gkey, inputs.tier)
