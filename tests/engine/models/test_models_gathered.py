"""engine.GatheredParameters on two gloo ranks: a parameter read outside its unit's forward
(inside the model's forward, with autograd saving it) trains as in plain PyTorch; with
`modifier_rank=r` rank r's in-place edits reach every rank's shards (compute copy and fp32
master) on exit; with `modifier_rank=None` edits are discarded.

Parity tolerances as in test_engine_parity.py (fp32; only gradient summation order
differs): losses rtol 1e-6, parameters atol 1e-5."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from engine_dist import run_two_ranks
from engine_helpers import LOSS_RTOL, PARAM_ATOL, TinyLM, make_batches
from torch import nn

from tierzero import engine

STEPS = 3


class External(TinyLM):
    """The root forward reads block 0's weight outside block 0 (before and after it runs)."""

    def forward(self, ids: torch.Tensor, targets: torch.Tensor,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
        x = self.emb(ids)  # (B, T, C)
        w = self.blocks[0].up.weight  # (2C, C), owned by unit blocks.0
        with engine.GatheredParameters([w]):
            x = x + 0.1 * (x @ w.T)[..., :x.shape[-1]]  # before blocks.0 runs
        for b in self.blocks:
            x = b(x)
        with engine.GatheredParameters([w]):
            x = x + 0.1 * (x @ w.T)[..., x.shape[-1]:]  # after it was released
        logits = self.head(self.norm(x)).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1))


def _cfg() -> engine.Config:
    return engine.load_config({"zero": {"stage": 3, "units": ["Block"],
                                        "persistence_threshold_bytes": 0},
                               "precision": "fp32", "optimizer": {"type": "adamw", "lr": 1e-2}})


def _model() -> External:
    torch.manual_seed(0)
    return External(3)


def scenario(rank: int) -> dict[str, object]:
    model = _model()
    eng, _, _, _ = engine.initialize(model=model, config=_cfg(), device="cpu")
    losses = []
    for ids, tg in make_batches(STEPS, seed=1 + rank):
        loss = eng(ids, tg)
        eng.backward(loss)
        eng.step()
        val = loss.detach().reshape(1).clone()
        eng.comm.all_reduce_sum(val)
        losses.append(float(val) / 2)
    with engine.GatheredParameters(list(model.parameters())):
        trained = {k: v.detach().clone() for k, v in model.named_parameters()}
    # modifier_rank=1: rank 1's edit wins everywhere; rank 0's different edit is dropped
    head = model.head.weight
    with engine.GatheredParameters([head], modifier_rank=1), torch.no_grad():
        head.fill_(float(rank + 1) * 0.5)
    with engine.GatheredParameters([head]):
        after_modifier = head.detach().clone()
    block_w = model.blocks[1].up.weight
    with engine.GatheredParameters([block_w]), torch.no_grad():  # modifier None: dropped
        before = block_w.detach().clone()
        block_w.zero_()
    with engine.GatheredParameters([block_w]):
        after_none = block_w.detach().clone()
    group = next(g for u in eng.units for g in u.groups
                 if any(s.param is head for s in g.slots))
    slot = next(s for s in group.slots if s.param is head)
    lo = rank * group.shard_numel
    a, b = max(lo, slot.offset), min(lo + group.shard_numel, slot.offset + slot.numel)
    master = eng.store.tensor(group.key, "master")[a - lo:b - lo].clone()
    eng.close()
    return {"losses": losses, "trained": trained, "after_modifier": after_modifier,
            "master_slice": master, "before": before, "after_none": after_none}


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = copy.deepcopy(_model())
    c = _cfg().optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=c.betas, eps=c.eps,
                            weight_decay=c.weight_decay)
    per_rank = [make_batches(STEPS, seed=1 + r) for r in range(2)]
    losses = []
    for i in range(STEPS):
        loss = torch.stack([model(*per_rank[r][i]) for r in range(2)]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.multiproc
def test_external_params_and_modifier_rank_two_ranks(tmp_path: Path) -> None:
    res = run_two_ranks(tmp_path, {"s": scenario})
    ref_losses, ref_params = _reference()
    for rank in range(2):
        r = res[rank]["s"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses),
                                   rtol=LOSS_RTOL, atol=0.0)
        for k, want in ref_params.items():
            torch.testing.assert_close(r["trained"][k], want, rtol=0.0, atol=PARAM_ATOL,
                                       msg=k)
        assert torch.equal(r["after_modifier"], torch.full_like(r["after_modifier"], 1.0))
        assert r["master_slice"].numel() > 0
        assert torch.equal(r["master_slice"], torch.full_like(r["master_slice"], 1.0))
        assert torch.equal(r["after_none"], r["before"]) and r["before"].abs().sum() > 0
