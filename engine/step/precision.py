"""Compute dtypes and the fp16 loss scaler (config `precision.*`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tierzero.engine.config import LossScaleConfig

if TYPE_CHECKING:
    from tierzero.engine.collectives import Comm
    from tierzero.engine.shards.store import ShardStore
    from tierzero.offload.step_seam import GradMeasure

log = logging.getLogger(__name__)

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def compute_dtype(name: str) -> torch.dtype:
    dtype = COMPUTE_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"precision.dtype {name!r} is not one of {sorted(COMPUTE_DTYPES)}")
    return dtype


class LossScaler:
    """fp16 loss scaling. An overflow always skips the step. Dynamic (value == 0): after
    `hysteresis` overflows the scale halves (never below min_scale); after
    `growth_interval` clean steps it doubles. Static (value > 0): the scale stays."""

    def __init__(self, cfg: LossScaleConfig) -> None:
        self.cfg = cfg
        self.dynamic = cfg.value == 0
        self.scale = float(cfg.value) if not self.dynamic else float(2**cfg.initial_scale_power)
        self._hysteresis = cfg.hysteresis
        self._good_steps = 0
        self.overflows = 0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the scale and the counters behind its next change."""
        return {"scale": self.scale, "hysteresis": self._hysteresis,
                "good_steps": self._good_steps, "overflows": self.overflows}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Back to `state_dict()`'s state; also reads checkpoints that spelled the two
        counters with their attribute names (`_hysteresis`, `_good_steps`)."""
        self.scale = float(state["scale"])
        self._hysteresis = int(state.get("hysteresis", state.get("_hysteresis", 0)))
        self._good_steps = int(state.get("good_steps", state.get("_good_steps", 0)))
        self.overflows = int(state["overflows"])

    def update(self, overflow: bool) -> None:
        if overflow:
            self.overflows += 1
            self._good_steps = 0
            if not self.dynamic:
                log.warning("fp16 gradient overflow: step skipped, static loss scale %g",
                            self.scale)
                return
            if self._hysteresis > 1:
                self._hysteresis -= 1
                log.warning("fp16 gradient overflow: step skipped, loss scale %g kept "
                            "(hysteresis %d left)", self.scale, self._hysteresis)
                return
            old = self.scale
            self.scale = max(self.scale / 2.0, self.cfg.min_scale)
            log.warning("fp16 gradient overflow: step skipped, loss scale %g -> %g",
                        old, self.scale)
            return
        if self.cfg.consecutive_hysteresis:
            self._hysteresis = self.cfg.hysteresis
        if not self.dynamic:
            return
        self._good_steps += 1
        if self._good_steps >= self.cfg.growth_interval:
            self.scale *= 2.0
            self._good_steps = 0
            self._hysteresis = self.cfg.hysteresis


# [Note: the gradient norm on every step]
# Every optimizer step takes the global L2 norm of the gradients, before clipping and
# unscaled, with clipping on or off (ZeroEngine.get_global_grad_norm(), the `grad_norm` of
# `tierzero train`'s step log and metrics, and of TierZeroTrainer's logs, as Hugging Face's
# Trainer logs it). It is the square root of the sum, in fixed group order and over the
# ranks, of each group's `grad_stat`, taken where the gradient is already being touched:
#   - the early step (overlap_step, no clipping): each group right before it is handed
#     to the update, just after its reduction (OffloadedStep.groups_final);
#   - clipping / fp16, or gradients that may leave host memory (grad_device nvme or
#     auto): a measuring pass during backward, right after each reduction ([Note:
#     gradients measured where they are reduced] in step/streamed.py, [Note: deferred
#     step] in step/in_place.py);
#   - otherwise (gradients on the device, or in host memory with overlap_step off): in
#     step(), one pass over the shards in memory.
# So the norm never reads a gradient back from NVMe that the step would not read anyway.
# A non-finite norm skips the step with clipping on or off (ZeroEngine._step).
@dataclass(frozen=True)
class GradStat:
    """What clipping and the fp16 overflow check need of one gradient shard."""

    sq_norm: float  # squared L2 norm of the shard in float64 ([Note: the gradient norm in blocks])
    finite: bool  # no inf or NaN in it


# [Note: the gradient norm in blocks]
# A gradient shard's squared norm (GradStat.sq_norm) is the float64 sum, in order, of the
# squares of the fp32 L2 norms of its blocks of NORM_BLOCK elements; a bf16 / fp16 block is
# upcast exactly first. On the CPU, torch's vector_norm of a whole shard runs on one
# thread summing squares in a few fp32 accumulators, so its error grows with the shard (a
# large model's layer is tens of millions of elements: benchmarks/RESULTS.md), and a bf16
# shard would need a whole fp32 copy first (written, then read back). In blocks a few are
# upcast at a time into a small scratch, each block's norm is good to fp32 rounding and
# is reduced on one thread, and the sum depends neither on torch's thread count nor on
# the thread that measures (a test holds it to the same float with 1 and 2 threads). The
# fp32 shard and the same shard kept at compute precision still measure bit for bit alike
# ([Note: gradient precision] in shards/grad_precision.py): the same blocks, upcast
# exactly, summed in the same order.
# On a GPU the blocks are the rows of a (rows, NORM_BLOCK) view, normed in one kernel and
# their squares summed in float64 on the device: no round trip to the host per block.
NORM_BLOCK = 1 << 17


# Blocks normed per call on the CPU: one vector_norm over a (rows, NORM_BLOCK) view
# reduces each row on one thread (the rows spread over torch's threads) with the same
# float as that block alone; a call per block would hand the GIL back and forth with the
# I/O threads thousands of times a shard.
_BLOCKS_PER_CALL = 16


def _sq_norm_cpu(g: torch.Tensor) -> float:
    n = g.numel()
    whole = n // NORM_BLOCK * NORM_BLOCK
    step = NORM_BLOCK * _BLOCKS_PER_CALL
    # a bf16 / fp16 shard is upcast a call's blocks at a time (at most 8 MiB of fp32)
    scratch = (None if g.dtype == torch.float32
               else torch.empty(min(n, step), dtype=torch.float32))

    def fp32(lo: int, hi: int) -> torch.Tensor:
        if scratch is None:
            return g[lo:hi]
        scratch[:hi - lo].copy_(g[lo:hi])
        return scratch[:hi - lo]

    norms: list[float] = []
    for lo in range(0, whole, step):
        rows = fp32(lo, min(whole, lo + step)).view(-1, NORM_BLOCK)
        norms += torch.linalg.vector_norm(rows, dim=1).tolist()
    if n > whole:  # the last, shorter block
        norms.append(float(torch.linalg.vector_norm(fp32(whole, n))))
    total = 0.0
    for norm in norms:  # in block order: the same sum whichever thread measures
        total += norm * norm
    return total


def _sq_norm_device(g: torch.Tensor) -> float:
    n = g.numel()
    rows, tail = divmod(n, NORM_BLOCK)
    parts = []
    if rows:
        parts.append(torch.linalg.vector_norm(g[:rows * NORM_BLOCK].view(rows, NORM_BLOCK),
                                              dim=1, dtype=torch.float32))
    if tail:
        parts.append(torch.linalg.vector_norm(g[rows * NORM_BLOCK:],
                                              dtype=torch.float32).reshape(1))
    if not parts:
        return 0.0
    return float(torch.cat(parts).double().square().sum().cpu())


def grad_stat(store: ShardStore, key: str) -> GradStat:
    """The shard's squared norm in float64, in blocks ([Note: the gradient norm in
    blocks]; ZeroEngine._clip sums these in a fixed order, whichever thread measured
    them) and whether every element is finite: a finite norm proves it; a non-finite one
    is checked element by element (the sum of squares of finite values can overflow
    fp32)."""
    with store.use(key, "grad") as shard:
        if shard.is_meta:  # a dry run (tierzero plan): no values; ZeroEngine._clip reports none
            return GradStat(0.0, True)
        g = shard.reshape(-1)
        sq = _sq_norm_cpu(g) if g.device.type == "cpu" else _sq_norm_device(g)
        finite = math.isfinite(sq) or bool(torch.isfinite(g).all())
    return GradStat(sq, finite)


def global_grad_norm(stats: Mapping[str, GradMeasure], keys: Sequence[str], comm: Comm,
                     device: torch.device) -> float:
    """The L2 norm over every rank of the gradients measured in `stats`: fp32 norm per shard
    (as torch's clip_grad_norm_ per tensor; no fp64 copy of the shard), squares summed in
    fp64 in the fixed order `keys` (grad_stat), then over ranks."""
    total = 0.0
    for k in keys:
        total += stats[k].sq_norm
    sq = torch.tensor([total], dtype=torch.float64, device=device)
    comm.all_reduce_sum(sq, "the squared gradient norm")
    return math.sqrt(float(sq.item()))


def has_overflow(grads: list[torch.Tensor]) -> bool:
    """True when any gradient holds inf or NaN (local to this rank)."""
    return any(not bool(torch.isfinite(g).all()) for g in grads)
