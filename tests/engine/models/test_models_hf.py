"""Hugging Face architectures from tiny configs (nothing downloaded) train under tierzero
with parity to plain PyTorch: Llama untied, GPT-2 (tied head, Conv1D), Mixtral with
experts that get no tokens, LoRA on a frozen base with HF gradient checkpointing.

Tolerances are those of test_engine_parity.py (fp32 everywhere: the engine computes the
same ops on the same values, differing only in reduction order of gradient sums):
losses rtol 1e-6, parameters atol 1e-5.

GPT-2 and Mixtral train with SGD + momentum, not AdamW: some of their parameters have an
analytically zero gradient (GPT-2's key bias: softmax ignores a shift shared by all keys;
a router's rows for unselected experts: top-k weights are renormalised), so their computed
gradient is rounding noise (~1e-9), which Adam normalises into lr-sized steps of random
sign; any change in summation order then shows as a 1e-4 parameter difference (measured:
GPT-2 c_attn.bias, Mixtral layer-1 router). SGD keeps noise at noise size. Both also
train with AdamW below, compared with the noise-driven elements accounted for."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_dist import run_two_ranks
from engine_helpers import LOSS_RTOL, PARAM_ATOL
from torch import nn

from tierzero import engine

transformers = pytest.importorskip("transformers")
VOCAB = 128


def _llama(tied: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied, attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg)  # type: ignore[no-any-return]


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                  n_positions=32, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg)  # type: ignore[no-any-return]


def _mixtral() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=64, attn_implementation="eager")
    return transformers.MixtralForCausalLM(cfg)  # type: ignore[no-any-return]


def _data(n: int, batch: int = 2, seq: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


Run = tuple[engine.ZeroEngine, nn.Module, list[float], list[float]]  # engine, ref, losses


def _train_both(model: nn.Module, steps: int, data: list[torch.Tensor], *,
                prepare: Callable[[nn.Module], None] | None = None,
                lr: float = 1e-2, units: tuple[str, ...] = (), sgd: bool = False,
                on_ref_grads: Callable[[nn.Module], None] | None = None) -> Run:
    """`steps` optimizer steps of AdamW + clipping on the engine and on a plain copy;
    `on_ref_grads` sees the plain copy's gradients before clipping, every step."""
    ref = copy.deepcopy(model)
    if prepare is not None:
        prepare(model)
        prepare(ref)
    cfg = engine.load_config({"zero": {"stage": 3, "persistence_threshold_bytes": 0,
                                       "units": list(units)},
                              "precision": "fp32", "gradient_clipping": 1.0,
                              "optimizer": {"type": "adamw", "lr": lr, "weight_decay": 0.1}})
    def make_opt(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        if sgd:
            return torch.optim.SGD(params, lr=lr * 10, momentum=0.9, weight_decay=0.1)
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)

    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu", optimizer=make_opt)
    opt = make_opt([p for p in ref.parameters() if p.requires_grad])
    losses, ref_losses = [], []
    for step in range(steps):
        ids = data[step % len(data)]
        out = eng(input_ids=ids, labels=ids)
        eng.backward(out.loss)
        eng.step()
        losses.append(float(out.loss.detach()))
        r = ref(input_ids=ids, labels=ids)
        r.loss.backward()
        ref_losses.append(float(r.loss.detach()))
        if on_ref_grads is not None:
            on_ref_grads(ref)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return eng, ref, losses, ref_losses


def _assert_parity(eng: engine.ZeroEngine, model: nn.Module, ref: nn.Module,
                   losses: list[float], ref_losses: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                               rtol=LOSS_RTOL, atol=0.0)
    with engine.GatheredParameters(list(model.parameters())):
        got = dict(model.named_parameters())
        for k, q in ref.named_parameters():
            torch.testing.assert_close(got[k].detach(), q.detach(), rtol=0.0, atol=PARAM_ATOL,
                                       msg=k)
    assert losses[-1] < losses[0]
    eng.close()


@pytest.mark.parametrize("arch", ["llama-untied", "gpt2"])
def test_hf_parity(arch: str) -> None:
    model = _llama(tied=False) if arch == "llama-untied" else _gpt2()
    eng, ref, losses, ref_losses = _train_both(model, 6, _data(2), sgd=arch == "gpt2")
    blocks = "model.layers" if arch.startswith("llama") else "transformer.h"
    assert [u.name for u in eng.units] == [f"{blocks}.0", f"{blocks}.1", ""]
    if arch == "gpt2":  # tied head and Conv1D blocks
        assert model.lm_head.weight is model.transformer.wte.weight
        assert type(model.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    _assert_parity(eng, model, ref, losses, ref_losses)


def test_mixtral_parity_with_idle_experts() -> None:
    model = _mixtral()
    # 3 tokens, top-2 of 8 experts: at least 2 experts idle per layer. (Top-1 would give
    # the router no gradient: its one weight is normalised to 1.)
    data = _data(2, batch=1, seq=3)
    with torch.no_grad():
        out = copy.deepcopy(model)(input_ids=data[0], output_router_logits=True)
    for logits in out.router_logits:  # per layer, (tokens, experts)
        used = set(logits.topk(2, dim=-1).indices.flatten().tolist())
        assert len(used) <= 6  # some experts get no token in this step
    eng, ref, losses, ref_losses = _train_both(model, 6, data, sgd=True)
    _assert_parity(eng, model, ref, losses, ref_losses)


# AdamW on the architectures above. Rounding-level gradients (see the module docstring)
# get lr-sized Adam steps of random sign, so GPT-2 is compared element by element: an
# element whose plain-PyTorch gradient was nonzero but never exceeded NOISE_GRAD is noise-driven
# and bounded only by Adam's step size (at most lr per step on each side); every other
# element at PARAM_ATOL. NOISE_GRAD is 1e-8: GPT-2's key-bias gradients measure <= 7e-10,
# real gradients here are 1e-5..1e-1 (a handful of real ones cross 1e-8 while small, which
# only makes the check stricter).
NOISE_GRAD = 1e-8
ADAM_LR = 1e-2


def test_gpt2_adamw_parity_outside_noise_gradients() -> None:
    model = _gpt2()
    gmax: dict[str, torch.Tensor] = {}

    def record(ref: nn.Module) -> None:
        for k, p in ref.named_parameters():
            if p.grad is not None:
                g = p.grad.detach().abs()
                gmax[k] = torch.maximum(gmax[k], g) if k in gmax else g.clone()

    steps = 6
    eng, ref, losses, ref_losses = _train_both(model, steps, _data(2), lr=ADAM_LR,
                                               on_ref_grads=record)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                               rtol=LOSS_RTOL, atol=0.0)
    noise_names = set()
    with engine.GatheredParameters(list(model.parameters())):
        got = dict(model.named_parameters())
        for k, q in ref.named_parameters():
            diff = (got[k].detach() - q.detach()).abs()
            noise = (gmax[k] > 0) & (gmax[k] <= NOISE_GRAD)  # exact zeros: compared tightly
            if noise.any():
                noise_names.add(k)
                assert float(diff[noise].max()) <= 2 * steps * ADAM_LR, k
            if (~noise).any():
                assert float(diff[~noise].max()) <= PARAM_ATOL, (k, float(diff[~noise].max()))
    # Only the attention's q/k/v bias holds noise-driven elements (the key part), and it
    # is a minority of that bias: the rule cannot hide a whole tensor.
    assert noise_names <= {f"transformer.h.{i}.attn.c_attn.bias" for i in range(2)}
    for k in noise_names:
        assert int(((gmax[k] > 0) & (gmax[k] <= NOISE_GRAD)).sum()) <= gmax[k].numel() // 3
    assert losses[-1] < losses[0]
    eng.close()


# Mixtral with AdamW: a router row of an expert that no token chose has an analytically zero
# gradient (top-k weights are renormalised), computed as rounding noise (~5e-10), which
# Adam turns into lr-sized steps of random sign, as for GPT-2's key bias above: those
# elements are bounded by Adam's step size (at most lr per step on each side). The noise
# rows then shift the router's logits and, through them, every expert's gradient by a
# little, so the other elements are compared at MIXTRAL_ADAM_ATOL, not PARAM_ATOL. Measured
# after 6 steps with transformers 5.24 (experts as 3D tensors): noise rows <= 2.2e-4 (the
# old single bound of 2e-4 passed by luck with 4.x's per-expert modules), other elements
# <= 1.5e-5; every compared tensor must have moved by more than 50x MIXTRAL_ADAM_ATOL, so
# the check still has teeth.
MIXTRAL_ADAM_ATOL = 2e-4


def test_mixtral_adamw_parity_with_idle_experts() -> None:
    model = _mixtral()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    gmax: dict[str, torch.Tensor] = {}

    def record(ref: nn.Module) -> None:
        for k, p in ref.named_parameters():
            if p.grad is not None:
                g = p.grad.detach().abs()
                gmax[k] = torch.maximum(gmax[k], g) if k in gmax else g.clone()

    steps = 6
    eng, ref, losses, ref_losses = _train_both(model, steps, _data(2, batch=1, seq=3),
                                               lr=ADAM_LR, on_ref_grads=record)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                               rtol=LOSS_RTOL, atol=0.0)
    noise_names = set()
    with engine.GatheredParameters(list(model.parameters())):
        got = dict(model.named_parameters())
        for k, q in ref.named_parameters():
            diff = (got[k].detach() - q.detach()).abs()
            noise = (gmax[k] > 0) & (gmax[k] <= NOISE_GRAD)  # exact zeros: compared tightly
            if noise.any():
                noise_names.add(k)
                assert float(diff[noise].max()) <= 2 * steps * ADAM_LR, k
            if (~noise).any():
                assert float(diff[~noise].max()) <= MIXTRAL_ADAM_ATOL, (k, float(diff.max()))
            moved = float((q.detach() - before[k]).abs().max())
            assert moved > 50 * MIXTRAL_ADAM_ATOL, (k, moved)
    # The routers' idle rows are noise-driven (a minority of each router); elsewhere only
    # a few real gradients below NOISE_GRAD (measured: 43 of 49152 expert elements in
    # layer 0), so the rule cannot hide a tensor.
    routers = {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}
    assert noise_names & routers
    for k in noise_names:
        share = 2 if k in routers else 100
        assert int(((gmax[k] > 0) & (gmax[k] <= NOISE_GRAD)).sum()) <= gmax[k].numel() // share
    eng.close()


class LoRALinear(nn.Module):
    """y = base(x) + B(A(x)) * scale, base frozen (the LoRA recipe, without peft)."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # nonzero, so A gets gradients at once
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scale  # type: ignore[no-any-return]


def _add_lora(model: nn.Module) -> None:
    torch.manual_seed(1)
    for layer in model.model.layers:  # type: ignore[union-attr]
        for name in ("q_proj", "v_proj"):
            setattr(layer.self_attn, name, LoRALinear(getattr(layer.self_attn, name)))
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    hf: Any = model
    if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        hf.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # the name before, deprecated since
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def test_lora_with_hf_checkpointing_parity() -> None:
    """The LoRA + activation checkpointing + ZeRO-3 case: recompute in backward re-gathers
    the frozen base weights; only the adapters get gradient and optimizer state."""
    model = _llama(tied=True)
    eng, ref, losses, ref_losses = _train_both(model, 5, _data(2), prepare=_add_lora)
    assert model.model.gradient_checkpointing
    trainable = [g for u in eng.units for g in u.groups if g.trainable]
    frozen = [g for u in eng.units for g in u.groups if not g.trainable]
    assert trainable and frozen
    for g in frozen:  # no grad, master or moments for frozen groups
        for kind in ("grad", "master", "exp_avg", "exp_avg_sq"):
            assert not eng.store.has(g.key, kind)
    report = eng.memory_report()["shard_bytes"]
    assert report["exp_avg"] == sum(g.shard_numel * 4 for g in trainable)
    _assert_parity(eng, model, ref, losses, ref_losses)


class _Twice(nn.Module):
    """One block called twice per forward, plus a tied input/output embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.block = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU())
        self.other = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> object:
        x = self.emb(input_ids)
        x = x + self.block(x)
        x = self.other(x)
        x = x + self.block(x)  # second call of the same unit
        logits = self.head(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


def test_module_called_twice_and_tied_weights() -> None:
    torch.manual_seed(0)
    model = _Twice()
    eng, ref, losses, ref_losses = _train_both(model, 6, _data(2), units=("Sequential",))
    assert [u.name for u in eng.units] == ["block", ""]
    _assert_parity(eng, model, ref, losses, ref_losses)


def lora_rank_scenario(rank: int) -> dict[str, object]:
    """One rank of a two-rank LoRA + HF checkpointing run: its own batches (seed 1 + rank)."""
    model = _llama(tied=True)
    _add_lora(model)
    cfg = engine.load_config({"zero": {"stage": 3, "persistence_threshold_bytes": 0},
                              "precision": "fp32", "gradient_clipping": 1.0,
                              "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1}})
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, 16), generator=g)
        out = eng(input_ids=ids, labels=ids)
        eng.backward(out.loss)
        eng.step()
        val = out.loss.detach().reshape(1).clone()
        eng.comm.all_reduce_sum(val)
        losses.append(float(val) / 2)
    with engine.GatheredParameters(list(model.parameters())):
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    eng.close()
    return {"losses": losses, "params": params}


@pytest.mark.multiproc
def test_lora_checkpointing_two_ranks(tmp_path: Path) -> None:
    """On two ranks released units really free their storage, so recomputation in backward
    must re-gather the frozen base weights; compared with DDP-style plain PyTorch."""
    res = run_two_ranks(tmp_path, {"lora": lora_rank_scenario})
    ref = _llama(tied=True)
    _add_lora(ref)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.1)
    gens = [torch.Generator().manual_seed(1 + r) for r in range(2)]
    ref_losses = []
    for _ in range(3):
        batches = [torch.randint(0, VOCAB, (2, 16), generator=gens[r]) for r in range(2)]
        loss = torch.stack([ref(input_ids=b, labels=b).loss for b in batches]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(loss.detach()))
    for rank in range(2):
        got = res[rank]["lora"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses),
                                   rtol=LOSS_RTOL, atol=0.0)
        for k, q in ref.named_parameters():
            torch.testing.assert_close(got["params"][k], q.detach(), rtol=0.0,
                                       atol=PARAM_ATOL, msg=k)
