"""Small models, configs and a plain-PyTorch reference trainer for the engine tests."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierzero import engine
from tierzero.engine.collectives import Comm
from tierzero.engine.config import (
    BatchConfig,
    BudgetsConfig,
    Config,
    OffloadConfig,
    OptimizerConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
    PrecisionConfig,
    SchedulerConfig,
    ZeroConfig,
)
from tierzero.engine.step.in_place import InPlaceStep
from tierzero.engine.step.streamed import StreamedStep
from tierzero.offload.adam_stream import AdamStream

VOCAB, DIM, SEQ = 64, 32, 8
# fp32 parity tolerances; the reasons are in test_engine_parity.py's docstring.
PARAM_ATOL = 1e-5
LOSS_RTOL = 1e-6


class Block(nn.Module):
    """Pre-norm MLP block with a residual: LayerNorm, two biased Linears."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, `n_blocks` blocks, final LayerNorm, biased head. `order` picks which blocks
    run and in which order (dynamic control flow); default all, in order."""

    def __init__(self, n_blocks: int = 4, dim: int = DIM, vocab: int = VOCAB) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.checkpointed = False  # recompute each block in backward (activation checkpointing)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
        x = self.emb(ids)  # (B, T, C)
        for i in range(len(self.blocks)) if order is None else order:
            if self.checkpointed:
                x = checkpoint(self.blocks[i], x, use_reentrant=False)
            else:
                x = self.blocks[i](x)
        logits = self.head(self.norm(x)).float()  # (B, T, V)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1))


def make_model(seed: int = 0, n_blocks: int = 4) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM(n_blocks)
    with torch.no_grad():  # non-trivial LayerNorm affine params
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    return model


def make_batches(n: int, batch: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable task (target = a fixed map of the token), so the loss falls fast."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        out.append((ids, (ids * 5 + 1) % VOCAB))
    return out


def make_config(precision: str = "fp32", *, gas: int = 1, clip: float = 0.0, lr: float = 1e-2,
                stage: int = 3, units: tuple[str, ...] = ("Block",),
                persistence: int = 0, scheduler: SchedulerConfig | None = None,
                overlap: bool = True, reduce_bucket: int = 1_000_000_000) -> Config:
    return Config(
        precision=PrecisionConfig(dtype=precision),  # type: ignore[arg-type]
        zero=ZeroConfig(stage=stage, units=units, persistence_threshold_bytes=persistence,
                        overlap_comm=overlap, reduce_bucket_bytes=reduce_bucket),
        optimizer=OptimizerConfig(type="adamw", lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.1),
        scheduler=scheduler or SchedulerConfig(),
        batch=BatchConfig(gradient_accumulation_steps=gas),
        gradient_clipping=clip,
    )


@dataclass
class RefResult:
    losses: list[float]  # mean over ranks of each micro-step's loss
    params: dict[str, torch.Tensor]
    report: dict[str, object] | None = None  # engine.memory_report() at the end
    # per element, whether an optimizer step used a gradient in Adam's eps regime (where
    # the reference records it: shared_reference, bound_eps_regime in lategrad_helpers)
    eps_regime: dict[str, torch.Tensor] | None = None


def reference_train(model: nn.Module, cfg: Config,
                    batches_per_rank: list[list[tuple[torch.Tensor, torch.Tensor]]], steps: int,
                    orders: list[tuple[int, ...] | None] | None = None) -> RefResult:
    """Plain PyTorch, DDP-equivalent: each micro-step's gradient is the mean over ranks of
    grad(loss_r / gas); AdamW on full fp32 params; clip_grad_norm_ before each step.
    A parameter no micro-step used gets a zero gradient (flat shards have no "None"
    gradient, as in DeepSpeed), where torch.optim would skip it."""
    model = copy.deepcopy(model)
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay)
    gas = cfg.batch.gradient_accumulation_steps or 1
    world = len(batches_per_rank)
    losses: list[float] = []
    for micro in range(steps * gas):
        order = orders[micro] if orders else None
        per_rank = [model(*batches_per_rank[r][micro], order=order) for r in range(world)]
        total = torch.stack(per_rank).mean()
        (total / gas).backward()
        losses.append(float(total.detach()))
        if (micro + 1) % gas == 0:
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if cfg.gradient_clipping > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.gradient_clipping)
            opt.step()
            opt.zero_grad()
    return RefResult(losses, {k: v.detach().clone() for k, v in model.named_parameters()})


def full_params(eng: object, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered, as fp32 copies (a collective on every rank)."""
    out: dict[str, torch.Tensor] = {}
    with engine.GatheredParameters(list(model.parameters())):
        for k, v in model.named_parameters():
            out[k] = v.detach().float().clone()
    return out


def train_steps(eng: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], *,
                loss_device: str | None = None) -> list[float]:
    """One forward, backward and step per batch; each loss as a float (its device checked
    to be `loss_device` when given: the engine moves CPU inputs to its own device)."""
    losses = []
    for ids, tg in batches:
        loss = eng(ids, tg)
        if loss_device is not None:
            assert loss.device.type == loss_device, loss.device
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
    return losses


def engine_train(cfg: Config, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
                 *, model: nn.Module | None = None,
                 orders: list[tuple[int, ...] | None] | None = None,
                 world_mean: bool = False) -> RefResult:
    """Train `model` (default make_model()) with tierzero on this rank's `batches`."""
    model = model if model is not None else make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    gas = cfg.batch.gradient_accumulation_steps or 1
    comm = Comm()
    losses: list[float] = []
    for micro in range(steps * gas):
        ids, tg = batches[micro]
        loss = eng(ids, tg, order=orders[micro] if orders else None)
        eng.backward(loss)
        eng.step()
        val = loss.detach().float().reshape(1).clone()
        if world_mean:
            comm.all_reduce_sum(val)
            val /= comm.world_size
        losses.append(float(val))
    params = full_params(eng, model)
    result = RefResult(losses, params, eng.memory_report())
    eng.close()
    return result


def rank_scenario(rank: int, *, precision: str, gas: int, clip: float, steps: int,
                  overlap: bool = True, reduce_bucket: int = 1_000_000_000) -> RefResult:
    """One rank's part of a two-rank run: its own batches (seed 1 + rank)."""
    cfg = make_config(precision=precision, gas=gas, clip=clip, overlap=overlap,
                      reduce_bucket=reduce_bucket)
    return engine_train(cfg, make_batches(steps * gas, seed=1 + rank), steps, world_mean=True)


def assert_match(got_losses: list[float], got: dict[str, torch.Tensor],
                 ref_losses: list[float], ref: dict[str, torch.Tensor], *,
                 initial: nn.Module | None = None) -> None:
    """Losses and params within the parity tolerances; `initial`: the untrained model
    (default make_model()), to check that training moved the parameters."""
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(ref_losses),
                               rtol=LOSS_RTOL, atol=0.0)
    assert got.keys() == ref.keys()
    for k, want in ref.items():
        torch.testing.assert_close(got[k], want, rtol=0.0, atol=PARAM_ATOL, msg=k)
    # the run must have moved the parameters, or the comparison proves nothing
    start = dict((initial if initial is not None else make_model()).named_parameters())
    moved = max(float((ref[k] - start[k].detach()).abs().max()) for k in ref)
    assert moved > 100 * PARAM_ATOL


def comm_scenario(rank: int) -> dict[str, torch.Tensor]:
    """Reduce-scatter through the backend's own op and through the all_reduce + slice
    fallback (used where gloo lacks reduce_scatter); all-gather of a bf16 shard."""
    comm = Comm()
    full = torch.arange(2 * 256, dtype=torch.float32) * (rank + 1)  # rank r sends (r+1)*x
    native = torch.empty(256)
    comm.reduce_scatter_mean(native, full)
    comm._reduce_scatter_native = False
    fallback = torch.empty(256)
    comm.reduce_scatter_mean(fallback, full)
    gathered = torch.empty(2 * 4, dtype=torch.bfloat16)
    comm.all_gather(gathered, torch.full((4,), float(rank), dtype=torch.bfloat16))
    return {"native": native, "fallback": fallback, "gathered": gathered}


def train_and_gather(model: nn.Module, cfg: Config, seed: int = 1) -> dict[str, object]:
    """Three engine steps on `make_batches(3, seed=seed)` (CPU); the losses and the gathered
    parameters after them. For comparing a partitioned build with a plain one."""
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    losses = []
    for ids, tg in make_batches(3, seed=seed):
        loss = eng(ids, tg)
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
    with engine.GatheredParameters(list(model.parameters())):
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    eng.close()
    return {"losses": losses, "params": params}


def runner_of(eng: object) -> object:
    """The runner of an engine's (or a driver's) offloaded step, else None."""
    return getattr(getattr(eng, "step_driver", eng), "runner", None)


def in_place_of(eng: object) -> InPlaceStep | None:
    """The in-place CPU Adam runner of an engine's offloaded step (OffloadedStep), else
    None (for tests that look inside it; the driver never asks which runner it holds)."""
    runner = runner_of(eng)
    return runner if isinstance(runner, InPlaceStep) else None


def streamed_runner(eng: object) -> StreamedStep:
    """The streamed CPU Adam runner of an engine's offloaded step (asserted to be one)."""
    runner = runner_of(eng)
    assert isinstance(runner, StreamedStep), runner
    return runner


def stream_of(eng: object) -> AdamStream | None:
    """The AdamStream inside an engine's (or driver's) streamed runner, else None."""
    runner = runner_of(eng)
    return runner.stream if isinstance(runner, StreamedStep) else None


DEVICE_BUDGET = 64 << 10  # offload_config's device tier: a few shards


def offload_config(cfg: Config, device: str, path: Path | None) -> Config:
    where = str(path) if path is not None else None
    return dataclasses.replace(cfg, offload=OffloadConfig(
        params=ParamOffloadConfig(device=device, path=where),  # type: ignore[arg-type]
        optimizer=OptimizerOffloadConfig(device=device, path=where),  # type: ignore[arg-type]
        budgets=BudgetsConfig(device_bytes=DEVICE_BUDGET)))


def assert_overlap_matches_off_and_pytorch(cfg_of: Callable[[bool], Config], *, steps: int,
                                           gas: int, clip: float) -> None:
    """`cfg_of(overlap_step)` trained with overlap on and off: the same losses and bits;
    the overlapped run matches plain PyTorch (clip_grad_norm_, AdamW) within the parity
    tolerances."""
    batches = make_batches(steps * gas)
    on = engine_train(cfg_of(True), batches, steps)
    off = engine_train(cfg_of(False), batches, steps)
    assert on.losses == off.losses
    for k, v in off.params.items():
        assert torch.equal(on.params[k], v), k
    ref = reference_train(make_model(), make_config(gas=gas, clip=clip), [batches], steps)
    assert_match(on.losses, on.params, ref.losses, ref.params)


FP16_OVERFLOW_STEP = 2  # index of the step whose loss fp16_overlap_runs blows up


def fp16_overlap_runs(cfg_of: Callable[[bool], Config], n: int
                      ) -> tuple[list[float | None], int, dict[str, torch.Tensor]]:
    """`n` fp16 steps of `cfg_of(overlap_step)` with overlap on and off, the loss of step
    FP16_OVERFLOW_STEP multiplied by 1e9 so that it overflows. Asserts the two runs alike
    (losses, loss scales, the one skip, every bit); returns the overlapped run's scales
    after each step, skipped steps and parameters."""
    runs = {}
    for overlap in (True, False):
        eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg_of(overlap))
        try:
            losses, scales = [], []
            for i, (ids, tg) in enumerate(make_batches(n)):
                loss = eng(ids, tg)
                eng.backward(loss * (1e9 if i == FP16_OVERFLOW_STEP else 1.0))
                eng.step()
                losses.append(float(loss.detach()))
                scales.append(eng.loss_scaler.scale if eng.loss_scaler else None)
            runs[overlap] = (losses, scales, eng.skipped_steps, full_params(eng, eng.module))
        finally:
            eng.close()
    (l_on, s_on, k_on, p_on), (l_off, s_off, k_off, p_off) = runs[True], runs[False]
    assert k_on == k_off == 1 and s_on == s_off and l_on == l_off
    assert s_on[2] == s_on[1] / 2  # type: ignore[operator]  # the overflow halved the scale
    for k, v in p_off.items():
        assert torch.equal(p_on[k], v), k
    return s_on, k_on, p_on


def record_grad_stats(monkeypatch: Any) -> tuple[list[tuple[str, bool]],
                                                list[tuple[str, bool]], list[bool]]:
    """Every gradient measurement the streamed step takes and every group handed to its
    measuring worker ([Note: gradients measured where they are reduced]), each as (group
    key, whether the test had flagged backward as running: set flag[0] around
    eng.backward). Returns (measured, handed, flag)."""
    from tierzero.engine.step import streamed as streamed_mod
    from tierzero.engine.step.measure import MeasureJobs

    calls: list[tuple[str, bool]] = []
    handed: list[tuple[str, bool]] = []
    in_backward = [False]
    real_stat = streamed_mod.grad_stat
    real_submit = MeasureJobs.submit

    def stat(store: object, key: str, *rest: object) -> object:
        calls.append((key, in_backward[0]))
        return real_stat(store, key, *rest)  # type: ignore[arg-type]

    def submit(jobs: MeasureJobs, keys: Any) -> None:
        handed.extend((k, in_backward[0]) for k in keys)
        real_submit(jobs, keys)

    monkeypatch.setattr(streamed_mod, "grad_stat", stat)
    monkeypatch.setattr(MeasureJobs, "submit", submit)
    return calls, handed, in_backward


def copying_gathers(monkeypatch: Any) -> None:
    """Gathers copy out of the staging pool, whose size is offload.params.buffer_count
    ([Note: a gather viewing the pool's buffer] off): for tests of what the copying
    gather's pool does (which params stay cached in it)."""
    monkeypatch.setattr("tierzero.engine.shards.tiered.lending_possible", lambda: False)
    monkeypatch.setattr("tierzero.engine.shards.flat.lending_supported", lambda device: False)


def needs_storage_swap(without: str) -> Any:
    """Skip marker for tests of moving memory between storages
    (`UntypedStorage._swap_data_ptr_`, private: a torch may lack it), naming what the
    engine does `without` it."""
    import pytest

    return pytest.mark.skipif(
        not hasattr(torch.UntypedStorage, "_swap_data_ptr_"),
        reason=f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_: {without}")
