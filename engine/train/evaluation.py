"""The training loss and the evaluation pass of `tierzero train`."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tierzero import engine
from tierzero.engine.train.data import IGNORE, Batch
from tierzero.engine.train.metrics import MetricsWriter

log = logging.getLogger(__name__)


def token_loss(logits: torch.Tensor, labels: torch.Tensor, *,
               reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of next-token `labels` (B, T), skipping IGNORE (prompt tokens and
    padding). A batch with no target at all gives 0 with zero gradients, not NaN."""
    flat = logits.float().flatten(0, 1)  # (B*T, V)
    target = labels.to(logits.device).flatten()
    if reduction == "mean" and not bool((target != IGNORE).any()):
        return flat.sum() * 0.0
    return F.cross_entropy(flat, target, ignore_index=IGNORE, reduction=reduction)


def evaluate(eng: engine.ZeroEngine, batches: list[Batch], world: int) -> tuple[float, int]:
    """(mean loss per target token, target tokens) over every rank's evaluation batches;
    forward only, in eval mode (every rank runs the same number of forwards)."""
    total = torch.zeros(2, dtype=torch.float64)  # [loss sum, target tokens]
    eng.eval()
    try:
        with torch.no_grad():
            for x, y in batches:
                out = eng(input_ids=x)
                logits = out.logits if hasattr(out, "logits") else out[0]  # (B, T, V)
                total[0] += float(token_loss(logits, y, reduction="sum").item())
                total[1] += int((y != IGNORE).sum())
    finally:
        eng.train()
    if world > 1:
        dist.all_reduce(total)
    loss_sum, count = float(total[0]), int(total[1])
    return loss_sum / max(count, 1), count


def eval_event(eng: engine.ZeroEngine, batches: list[Batch], step: int, *, world: int,
               writer: MetricsWriter | None) -> dict[str, Any]:
    """Evaluate at `step`: the metrics event, written (rank 0's `writer`) and logged."""
    t0 = time.perf_counter()
    loss, tokens = evaluate(eng, batches, world)
    event = {"event": "eval", "step": step, "eval_loss": loss, "eval_tokens": tokens,
             "eval_s": time.perf_counter() - t0}
    if writer:
        writer.write(event)
    if eng.comm.rank == 0:
        log.info("eval at step %d | eval loss %.4f | %d target tokens | %.2f s", step, loss,
                 tokens, event["eval_s"])
    return event
