"""A model whose reentrant checkpointed segments share parameters (late gradients), and a
plain-PyTorch reference trainer for it that respects frozen parameters.

With `torch.utils.checkpoint(..., use_reentrant=True)` each segment's backward is its own
autograd graph task, so a parameter used in two segments (or in a segment and outside)
has its AccumulateGrad fire once per task: after the first, the engine may already have
reduced its group ([Note: late gradients] in engine/late_grads.py).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
from engine_helpers import DIM, RefResult, TinyLM, make_batches, make_config
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierzero import engine
from tierzero.engine.config import (
    BudgetsConfig,
    Config,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)


class SharedSegmentsLM(TinyLM):
    """TinyLM with 4 blocks run as: segment A = checkpoint(block 0, block 1); block 2 plainly;
    segment B = checkpoint(block 2, block 3, block 0, a mix with the embedding's weight).

    Block 0 runs in two segments (two graph tasks), block 2 inside and outside a segment,
    and the embedding weight (a root parameter, as a tied weight would be) in segment B and
    in the root's lookup. `reentrant=False` is the same model with non-reentrant segments.
    `plan` (segment A's blocks, the plain block, segment B's blocks) may be changed between
    steps (dynamic control flow)."""

    def __init__(self, reentrant: bool = True) -> None:
        super().__init__(4)
        self.reentrant = reentrant
        self.plan: tuple[tuple[int, ...], int, tuple[int, ...]] = ((0, 1), 2, (2, 3, 0))

    def _seg_a(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        for i in self.plan[0]:
            x = self.blocks[i](x)
        return x

    def _seg_b(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        for i in self.plan[2]:
            x = self.blocks[i](x)
        return x + 0.1 * torch.tanh(x @ self.emb.weight[:DIM])  # (C, C) slice of (V, C)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
        del order
        x = self.emb(ids)  # (B, T, C)
        x = checkpoint(self._seg_a, x, use_reentrant=self.reentrant)
        x = self.blocks[self.plan[1]](x)
        x = checkpoint(self._seg_b, x, use_reentrant=self.reentrant)
        logits = self.head(self.norm(x)).float()  # (B, T, V)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1))


class RootSegmentLM(TinyLM):
    """TinyLM whose only reentrant segment holds no unit: the embedding weight (a root
    parameter) mixed into the activations after the blocks. Its nested backward comes
    unannounced (no unit runs with gradients off in forward), so the root's group is
    reduced, and can be handed to the early optimizer step, before the embedding lookup's
    gradient arrives."""

    def _mix(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return x + 0.1 * torch.tanh(x @ self.emb.weight[:DIM])

    def forward(self, ids: torch.Tensor, targets: torch.Tensor,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
        del order
        x = self.emb(ids)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = checkpoint(self._mix, x, use_reentrant=True)
        logits = self.head(self.norm(x)).float()  # (B, T, V)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1))


class HookBackwardLM(TinyLM):
    """TinyLM with an auxiliary loss on block 0's output that a tensor hook backpropagates
    from inside the main backward (user code calling torch.autograd.backward in a hook):
    a nested graph task through block 0 and the embedding, which the main task then
    reaches again."""

    def forward(self, ids: torch.Tensor, targets: torch.Tensor,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
        del order
        x = self.blocks[0](self.emb(ids))  # (B, T, C)
        aux = 0.05 * (x ** 2).mean()
        x = self.blocks[1](x)
        if torch.is_grad_enabled():
            x.register_hook(lambda _g: torch.autograd.backward(aux, retain_graph=True))
        for block in self.blocks[2:]:
            x = block(x)
        logits = self.head(self.norm(x)).float()  # (B, T, V)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1))


def make_hook_model(seed: int = 0) -> HookBackwardLM:
    torch.manual_seed(seed)
    model = HookBackwardLM(4)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    return model


def make_shared_model(seed: int = 0, *, frozen: bool = False,
                      reentrant: bool = True) -> SharedSegmentsLM:
    """`frozen`: block 0's LayerNorm and the final LayerNorm frozen (the engine's
    has_frozen path: those units reduce at the end of backward)."""
    torch.manual_seed(seed)
    model = SharedSegmentsLM(reentrant)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    if frozen:
        for p in (*model.blocks[0].norm.parameters(), *model.norm.parameters()):
            p.requires_grad_(False)
    return model


def shared_reference(model: nn.Module, cfg: Config,
                     batches_per_rank: list[list[tuple[torch.Tensor, torch.Tensor]]],
                     steps: int, device: str = "cpu") -> RefResult:
    """Plain PyTorch, DDP-equivalent (mean over ranks of grad(loss_r / gas)); AdamW over the
    trainable parameters, a trainable one without a gradient getting zeros (as the flat
    shards); clip_grad_norm_ before each step. Parameters are returned on the CPU."""
    model = copy.deepcopy(model).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optimizer
    opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay)
    gas = cfg.batch.gradient_accumulation_steps or 1
    world = len(batches_per_rank)
    losses: list[float] = []
    names = {id(p): k for k, p in model.named_parameters()}
    regime = {names[id(p)]: torch.zeros(p.shape, dtype=torch.bool) for p in params}
    for micro in range(steps * gas):
        total = torch.stack([model(*(t.to(device) for t in batches_per_rank[r][micro]))
                             for r in range(world)]).mean()
        (total / gas).backward()
        losses.append(float(total.detach()))
        if (micro + 1) % gas == 0:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if cfg.gradient_clipping > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.gradient_clipping)
            for p in params:
                g = p.grad.detach().abs().cpu()  # type: ignore[union-attr]
                regime[names[id(p)]] |= (g > 0) & (g < EPS_REGIME * o.eps)
            opt.step()
            opt.zero_grad()
    return RefResult(losses, {k: v.detach().float().cpu() for k, v in model.named_parameters()},
                     eps_regime=regime)


# A gradient under EPS_REGIME * eps puts Adam's update, lr m / (sqrt(v) + eps), in the
# regime where it follows the gradient's size rather than its sign.
EPS_REGIME = 100


def bound_eps_regime(got: dict[str, torch.Tensor], ref: RefResult, lr: float,
                     steps: int) -> None:
    """Elements that some step updated from a gradient under EPS_REGIME eps (not zero):
    a gradient that small comes from terms that cancel, so the order of the fp32 sums (the
    engine's late gradients against autograd's, the thread count's split of a reduction)
    sets much of it, and in that regime Adam's update follows it: one element of the
    frozen-units case ended 1.1e-5 from the reference with one intra-op thread (its row's
    gradient 6e-8 in the step that moved it apart), over PARAM_ATOL. Compared within 2 lr
    a step, then set equal in `got` for assert_match to compare the rest."""
    if ref.eps_regime is None:
        raise ValueError("the reference recorded no gradients (shared_reference does)")
    for k, mask in ref.eps_regime.items():
        if bool(mask.any()):
            assert float((got[k] - ref.params[k]).abs()[mask].max()) <= 2 * lr * steps, k
            got[k][mask] = ref.params[k][mask]


def shared_config(*, gas: int = 1, clip: float = 0.5, offload: str = "none",
                  path: Path | None = None, overlap_step: bool = False, stage: int = 3,
                  overlap_comm: bool = True) -> Config:
    """make_config plus offload "none", "cpu" or "nvme" (params and optimizer state both
    there, swap files under `path`; a device budget below the param shards, as in
    test_engine_offload.py, so device caches are evicted and re-fetched in a step)."""
    cfg = make_config(gas=gas, clip=clip, stage=stage, overlap=overlap_comm)
    if offload == "none":
        return cfg
    where = str(path) if offload == "nvme" else None
    return dataclasses.replace(cfg, offload=OffloadConfig(
        params=ParamOffloadConfig(device=offload, path=where),  # type: ignore[arg-type]
        optimizer=OptimizerOffloadConfig(device=offload, path=where,  # type: ignore[arg-type]
                                         overlap_step=overlap_step),
        budgets=BudgetsConfig(device_bytes=64 << 10)))


def first_boundary_grads(rank: int, *, gas: int, world: int, offload: str = "none",
                         root: str = "", overlap_comm: bool = True) -> dict[str, torch.Tensor]:
    """The engine's gradient at the first accumulation boundary (gas micro-steps of this
    rank's batches, before any optimizer step), gathered from every rank's fp32 shards,
    per parameter. Compared with plain PyTorch's `.grad` by `reference_grads`."""
    path = Path(root) / f"grads-rank{rank}" if root else None
    if path is not None:
        path.mkdir(exist_ok=True)
    cfg = shared_config(gas=gas, clip=0.0, offload=offload, path=path,
                        overlap_comm=overlap_comm)
    model = make_shared_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    for ids, tg in make_batches(gas, seed=1 + rank):
        eng.backward(eng(ids, tg))
    out: dict[str, torch.Tensor] = {}
    for unit in eng.units:
        for g in unit.groups:
            if not g.trainable:
                continue
            full = torch.empty(g.padded_numel)
            with eng.store.use(g.key, "grad") as shard:
                eng.comm.all_gather(full, shard.clone())
            for s in g.slots:
                out[s.qname] = full[s.offset:s.offset + s.numel].view(s.shape).clone()
    assert eng.comm.world_size == world
    eng.close()
    return out


def reference_grads(*, gas: int, world: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch's accumulated `.grad` for first_boundary_grads' micro-steps."""
    model = make_shared_model()
    per_rank = [make_batches(gas, seed=1 + r) for r in range(world)]
    for micro in range(gas):
        total = torch.stack([model(*per_rank[r][micro]) for r in range(world)]).mean()
        (total / gas).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
