"""TRL's SFTTrainer through tierzero by adding the mixin: `class SFT(TierZeroMixin,
trl.SFTTrainer)` with a chat dataset (TRL applies the chat template, tokenizes, masks,
packs and collates), parameters and optimizer state on NVMe, LoRA through TRL's
`peft_config` and without, against the same script on TRL's own SFTTrainer; the saved
model (or adapter) loads with from_pretrained. Tested with TRL 1.16.

Tolerance: both sides run fp32 on the same batches (each step's batch is the whole
dataset, so the two samplers differ only in row order, which the token-mean loss does not
see), so the losses and the gradient norms differ only by float rounding: tierzero's CPU
Adam against torch's AdamW, and the gradients reduced in another order. Measured:
within 1e-7 relative over 4 steps at lr 1e-2; asserted rel 1e-5, a hundred times that,
still far below the change of one step (> 1e-3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")

WORDS = [f"w{i}" for i in range(60)]
VOCAB = ["<unk>", "</s>", "<pad>", "user", "assistant", *WORDS]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
STEPS, ROWS = 4, 8


def _tiny_chat_llama(path: Path) -> Path:
    """A tiny Llama and a word-level tokenizer with a chat template, as save_pretrained
    writes them (nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(VOCAB), max_position_embeddings=64,
        pad_token_id=2, eos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path


def _chats() -> Any:
    g = torch.Generator().manual_seed(1)

    def words(n: int) -> str:
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())

    return datasets.Dataset.from_list([
        {"messages": [{"role": "user", "content": words(3 + i % 4)},
                      {"role": "assistant", "content": words(5 + i % 3)}]}
        for i in range(ROWS)])


class SFT(tierzero.TierZeroMixin, trl.SFTTrainer):
    """The whole change to an SFT script: this class instead of trl.SFTTrainer."""


def _run(cls: type, base: Path, out: Path, *, lora: bool, packing: bool, accum: int = 1,
         **extra: Any) -> tuple[Any, list[dict[str, float]]]:
    """The SFT script: TRL's defaults except fp32 (for a tight comparison), a constant lr
    and the whole dataset in each step's batch."""
    args = trl.SFTConfig(
        output_dir=str(out), per_device_train_batch_size=ROWS // accum,
        gradient_accumulation_steps=accum, max_steps=STEPS,
        learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, report_to=[],
        seed=3, use_cpu=True, disable_tqdm=True, save_strategy="no", bf16=False,
        max_length=32, packing=packing)
    peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                  task_type="CAUSAL_LM") if lora else None
    trainer = cls(model=transformers.LlamaForCausalLM.from_pretrained(base), args=args,
                  train_dataset=_chats(),
                  processing_class=transformers.AutoTokenizer.from_pretrained(base),
                  peft_config=peft_config, **extra)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.parametrize(("lora", "packing"), [(False, False), (True, False), (False, True)],
                         ids=["full", "lora", "full-packed"])
def test_sft_script_with_the_mixin_matches_trl(tmp_path: Path, lora: bool,
                                               packing: bool) -> None:
    base = _tiny_chat_llama(tmp_path / "base")
    swap = tmp_path / "swap"
    swap.mkdir()
    ds_config = {  # HF-style DeepSpeed JSON: the Trainer's AdamW and schedule, NVMe offload
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3, "sub_group_size": 0,
            "offload_param": {"device": "nvme", "nvme_path": str(swap)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)}}}
    _, expected = _run(trl.SFTTrainer, base, tmp_path / "ref", lora=lora, packing=packing)
    trainer, got = _run(SFT, base, tmp_path / "out", lora=lora, packing=packing,
                        tierzero_config=ds_config)
    assert trainer.engine is not None
    # SFTConfig's default activation checkpointing, switched on before training as
    # Trainer.train does
    assert any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())
    assert trainer.engine.config.offload.params.device == "nvme"
    assert len(got) == len(expected) == STEPS
    for key in ("loss", "grad_norm"):
        assert [h[key] for h in got] == pytest.approx([h[key] for h in expected], rel=1e-5,
                                                       abs=0), key
    # TRL's own metrics come through its compute_loss and log
    assert [h["mean_token_accuracy"] for h in got] == pytest.approx(
        [h["mean_token_accuracy"] for h in expected], rel=1e-5)
    assert [h["num_tokens"] for h in got] == [h["num_tokens"] for h in expected]
    assert got[-1]["loss"] < got[0]["loss"]

    trainer.save_model()
    model = trainer.model
    trainer.close()  # the model is whole again: the engine's trained model
    out = tmp_path / "out"
    ids = torch.randint(0, len(VOCAB), (2, 9), generator=torch.Generator().manual_seed(4))
    if lora:
        assert (out / "adapter_config.json").is_file() and not (out / "config.json").exists()
        loaded = peft.PeftModel.from_pretrained(
            transformers.LlamaForCausalLM.from_pretrained(base), out)
    else:
        loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=1e-6)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template([{"role": "user", "content": "w1"}], tokenize=False) == (
        "user w1 </s> ")


@pytest.mark.slow
def test_sft_with_accumulation_runs_layer_major(tmp_path: Path) -> None:
    """Two micro-batches per step on NVMe offload: the mixin steps through train_batch,
    layer-major (the model's own checkpointing left off) as micro-step, bit for bit
    ([Note: layer-major schedule])."""
    base = _tiny_chat_llama(tmp_path / "base")
    runs = {}
    for schedule in ("micro_step", "layer_major"):
        swap = tmp_path / f"swap-{schedule}"
        swap.mkdir()
        config = {"zero": {"stage": 3}, "precision": "fp32",
                  "optimizer": {"type": "adamw", "lr": 1e-2},
                  "batch": {"micro_batch_size": ROWS // 2, "gradient_accumulation_steps": 2,
                            "schedule": schedule},
                  "offload": {"device": "nvme", "path": str(swap)}}
        trainer, hist = _run(SFT, base, tmp_path / schedule, lora=True, packing=False,
                             accum=2, tierzero_config=config)
        assert trainer.engine.schedule == schedule
        checkpointed = any(getattr(m, "gradient_checkpointing", False)
                           for m in trainer.model.modules())
        assert checkpointed == (schedule == "micro_step")
        runs[schedule] = [h["loss"] for h in hist]
        trainer.close()
    assert len(runs["layer_major"]) == STEPS
    assert runs["layer_major"] == runs["micro_step"]


def test_mixin_must_come_first() -> None:
    with pytest.raises(TypeError, match=r"TierZeroMixin must come before the Trainer class"):
        type("Wrong", (trl.SFTTrainer, tierzero.TierZeroMixin), {})
    assert issubclass(tierzero.TierZeroTrainer, tierzero.TierZeroMixin)
    assert tierzero.TierZeroTrainer.train is tierzero.TierZeroMixin.train
    assert SFT.compute_loss is trl.SFTTrainer.compute_loss  # TRL's loss and metrics stay
