"""A Hugging Face transformer (tiny Llama from a config, no download) under the engine:
units from `_no_split_modules`, tied embeddings in the root unit, rotary buffers, the
ModelOutput return type; parity with plain PyTorch (tolerances as in
test_engine_parity.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import LOSS_RTOL, PARAM_ATOL

from tierzero import engine

transformers = pytest.importorskip("transformers")


def _tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, attn_implementation="eager")
    model: torch.nn.Module = transformers.LlamaForCausalLM(cfg)
    return model


def test_tiny_llama_matches_pytorch() -> None:
    model = _tiny_llama()
    ref = copy.deepcopy(model)
    cfg = engine.load_config({"zero": {"stage": 3}, "precision": "fp32",
                              "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1},
                              "batch": {"gradient_accumulation_steps": 2},
                              "gradient_clipping": 1.0})
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    assert [u.name for u in eng.units] == ["model.layers.0", "model.layers.1",
                                           "model.layers.2", ""]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tie kept
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(2)]  # memorisable
    losses, ref_losses = [], []
    for micro in range(12):
        ids = data[micro % 2]
        out = eng(input_ids=ids, labels=ids)
        eng.backward(out.loss)
        eng.step()
        losses.append(float(out.loss.detach()))
        r = ref(input_ids=ids, labels=ids)
        (r.loss / 2).backward()
        ref_losses.append(float(r.loss.detach()))
        if micro % 2 == 1:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                               rtol=LOSS_RTOL, atol=0.0)
    with engine.GatheredParameters(list(model.parameters())):
        for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0.0, atol=PARAM_ATOL,
                                       msg=k)
    assert losses[-1] < losses[0]
    eng.close()
