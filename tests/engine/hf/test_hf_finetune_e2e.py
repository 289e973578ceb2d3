"""End to end: a tiny pretrained Llama directory with its own tokenizer fine-tunes from a chat
.jsonl with `tierzero train` (nvme offload), full or LoRA; the eval loss falls, and the
Hugging Face directory the run writes loads (from_pretrained, or peft for the adapter)
with the logits of the model the run ended with (its last checkpoint, consolidated)
and with the run's tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from cli_helpers import read_metrics
from data_helpers import chat_rows, pretrained_dir, write_jsonl
from hf_helpers import logits

import tierzero
from tierzero.engine.cli import main
from tierzero.engine.config.train import LoraConfig
from tierzero.engine.hf import apply_lora

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
STEPS = 30


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return pretrained_dir(tmp_path_factory.mktemp("llama"))


def _run(tmp: Path, model: Path, lr: float, **train: Any) -> tuple[Path, list[dict[str, Any]]]:
    (tmp / "nvme").mkdir()
    data = write_jsonl(tmp / "chat.jsonl", chat_rows(80))
    cfg = {"seed": 3, "precision": "fp32",
           "optimizer": {"type": "adamw", "lr": lr, "weight_decay": 0.0},
           "batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
           "offload": {"device": "nvme", "path": str(tmp / "nvme")},
           "train": {"model": str(model), "dataset": str(data), "seq_len": 32, "steps": STEPS,
                     "eval_fraction": 0.25, "eval_interval": STEPS,
                     "checkpoint_interval": STEPS, "out_dir": str(tmp / "runs"), **train}}
    (tmp / "ft.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp / "ft.yaml"), "--no-progress"]) == 0
    (run,) = (tmp / "runs").iterdir()
    return run, read_metrics(tmp)


def _final_model(model: Path, run: Path, lora: LoraConfig | None) -> torch.nn.Module:
    """The model the run ended with: its last checkpoint, consolidated (fp32 master)."""
    net = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(model))
    if lora is not None:
        net = apply_lora(net, lora)
    net.load_state_dict(tierzero.consolidate(run / "checkpoints", f"step{STEPS}"), strict=True)
    return net


def _ids(tok: Any) -> torch.Tensor:
    msgs = [{"role": "user", "content": "What color is the sky?"}]
    return torch.tensor([tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)])


def _check_tokenizer(out: Path, tok: Any) -> None:
    got = transformers.AutoTokenizer.from_pretrained(out)
    msgs = [{"role": "user", "content": "What color is the snow?"}]
    assert got("The sun is yellow.")["input_ids"] == tok("The sun is yellow.")["input_ids"]
    assert got.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(
        msgs, tokenize=False)


def test_finetune_chat_full_model_exports_for_from_pretrained(
        tmp_path: Path, llama_dir: tuple[Path, Any]) -> None:
    model, tok = llama_dir
    run, rows = _run(tmp_path, model, 1e-2)
    end = rows[-1]
    assert end["last_eval_loss"] < 0.8 * end["first_eval_loss"]
    out = run / "hf" / "final"
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    ids = _ids(tok)
    expected = logits(_final_model(model, run, None), ids)
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=0, atol=1e-6)
    pretrained = logits(transformers.LlamaForCausalLM.from_pretrained(model), ids)
    assert (pretrained - expected).abs().max() > 1e-2  # fine-tuning moved it
    _check_tokenizer(out, tok)


def test_finetune_chat_lora_adapter_loads_with_peft(
        tmp_path: Path, llama_dir: tuple[Path, Any]) -> None:
    model, tok = llama_dir
    lora = LoraConfig(r=8, alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    run, rows = _run(tmp_path, model, 3e-2,
                     lora={"r": 8, "alpha": 16, "target_modules": list(lora.target_modules)})
    end = rows[-1]
    # (the frozen random head limits what adapters on attention can do in 30 steps: the
    # held-out loss falls by 0.4 nats here; untrained it would not move)
    assert end["last_eval_loss"] < end["first_eval_loss"] - 0.2
    out = run / "hf" / "final"
    assert (out / "adapter_model.safetensors").is_file() and not (out / "config.json").exists()
    adapted = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(model),
                                             out)
    ids = _ids(tok)
    torch.testing.assert_close(logits(adapted, ids), logits(_final_model(model, run, lora), ids),
                               rtol=0, atol=1e-6)
    _check_tokenizer(out, tok)
