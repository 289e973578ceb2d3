"""LoRA through peft on the engine: the frozen base is partitioned and offloaded with no
optimizer state, load_pretrained fills it from the unwrapped checkpoint, training moves
only the adapters, and the export loads with peft (adapter) or from_pretrained (merged)
with the engine's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_helpers import VOCAB, logits, save_tiny_llama
from safetensors import safe_open

import tierzero
from tierzero.engine.config.train import LoraConfig
from tierzero.engine.hf import LoraError, apply_lora, export_hf

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def test_lora_frozen_base_offloaded_adapter_and_merged_exports(tmp_path: Path) -> None:
    base = save_tiny_llama(tmp_path / "base")
    (tmp_path / "swap").mkdir()
    cfg = tierzero.load_config({"precision": "fp32", "optimizer": {"lr": 2e-2},
                                "zero": {"persistence_threshold_bytes": 0},
                                "offload": {"device": "nvme", "path": str(tmp_path / "swap")}})
    hf = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(base))
    model = apply_lora(hf, LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj")))
    adapters = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    eng, *_ = tierzero.initialize(model=model, config=cfg)
    report = tierzero.load_pretrained(eng, base)  # unwrapped names -> base_layer names
    assert report.tensors == sum(1 for n, _ in model.named_parameters() if "lora_" not in n)

    # Only the adapters get optimizer state; the frozen base keeps param alone.
    groups = [g for u in eng.units for g in u.groups]
    trained = [g for g in groups if g.trainable]
    assert sum(g.numel for g in trained) == sum(adapters.values())
    for g in groups:
        assert eng.store.has(g.key, "exp_avg") == g.trainable, g.key
        assert eng.store.has(g.key, "master") == g.trainable, g.key

    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, VOCAB, (2, 12), generator=g)
        out = eng(input_ids=x, labels=x)
        eng.backward(out.loss)
        eng.step()
    export_hf(eng, tmp_path / "adapter", tokenizer_from=base)
    export_hf(eng, tmp_path / "merged", lora="merged", max_shard_bytes=50_000)
    eng.close()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))
    expected = logits(model, ids)  # the engine's gathered peft model

    names = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(names)
    assert "config.json" not in names
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as h:
        keys = set(h.keys())
    assert len(keys) == len(adapters) and all(".default." not in k for k in keys)
    fresh_base = transformers.LlamaForCausalLM.from_pretrained(base)  # the unchanged base
    with_adapter = peft.PeftModel.from_pretrained(fresh_base, tmp_path / "adapter")
    torch.testing.assert_close(logits(with_adapter, ids), expected, rtol=0, atol=1e-6)
    untrained = logits(transformers.LlamaForCausalLM.from_pretrained(base), ids)
    assert (untrained - expected).abs().max() > 1e-3  # the adapters did change the model

    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n or "base_layer" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, ids), expected, rtol=1e-5, atol=1e-5)
    # the frozen base went through training untouched: merged minus adapter delta = base
    with safe_open(str(base / "model.safetensors"), "pt") as h:
        k_proj = h.get_tensor("model.layers.0.self_attn.k_proj.weight")
    torch.testing.assert_close(merged.model.layers[0].self_attn.k_proj.weight.detach(), k_proj,
                               rtol=0, atol=0)


def test_lora_bad_targets_named(tmp_path: Path) -> None:
    hf = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(
        save_tiny_llama(tmp_path / "base", tokenizer=False)))
    with pytest.raises(LoraError, match="target_modules"):
        apply_lora(hf, LoraConfig(r=4, target_modules=("no_such_proj",)))
    assert apply_lora(hf, LoraConfig(r=0)) is hf


def _two_rank_export(tmp: str, rank: int) -> dict[str, torch.Tensor]:
    """One rank: LoRA on a tiny Llama (the same seed on both ranks), its own batches,
    adapter and merged exports into the shared directory, then the gathered logits."""
    from hf_helpers import llama_config

    torch.manual_seed(0)
    model = apply_lora(transformers.LlamaForCausalLM(llama_config()),
                       LoraConfig(r=4, target_modules=("q_proj", "v_proj")))
    cfg = tierzero.load_config({"precision": "fp32", "optimizer": {"lr": 2e-2},
                                "zero": {"persistence_threshold_bytes": 0},
                                "offload": {"device": "cpu"}})
    eng, *_ = tierzero.initialize(model=model, config=cfg, device="cpu")
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(2):
        x = torch.randint(0, VOCAB, (2, 12), generator=g)
        out = eng(input_ids=x, labels=x)
        eng.backward(out.loss)
        eng.step()
    export_hf(eng, Path(tmp) / "adapter")
    export_hf(eng, Path(tmp) / "merged", lora="merged")
    eng.close()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))
    return {"logits": logits(model, ids), "ids": ids}


@pytest.mark.slow
@pytest.mark.multiproc
def test_lora_export_two_ranks(tmp_path: Path) -> None:
    """Each rank holds half of every group: the exports gather both halves."""
    from functools import partial

    from engine_dist import run_two_ranks
    from hf_helpers import llama_config

    res = run_two_ranks(tmp_path, {"x": partial(_two_rank_export, str(tmp_path))})
    expected, ids = res[0]["x"]["logits"], res[0]["x"]["ids"]
    torch.testing.assert_close(res[1]["x"]["logits"], expected, rtol=0, atol=0)
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(merged, ids), expected, rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)  # the base both ranks built (frozen: unchanged by training)
    base = transformers.LlamaForCausalLM(llama_config())
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(logits(adapted, ids), expected, rtol=0, atol=1e-6)
