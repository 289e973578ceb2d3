"""TierZeroTrainer: a transformers.Trainer script with a DeepSpeed JSON config full of "auto"
trains through tierzero with the loss of tierzero's own loop (same batches, the schedule
written out natively), saves tierzero checkpoints and resumes from them with the same
losses, and save_model writes a directory from_pretrained loads with the engine's
logits. Tested with transformers 5.24."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_helpers import logits, save_tiny_llama

import tierzero
from tierzero.engine.config import ConfigError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB = 128
DS_AUTO = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                          "offload_param": {"device": "cpu"}, "reduce_bucket_size": "auto",
                          "stage3_gather_16bit_weights_on_model_save": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}
# The same run written out for tierzero's own loop: WarmupDecayLR is DeepSpeed's log warm-up
# then linear decay; "auto" values are the TrainingArguments below.
NATIVE = {"seed": 3, "precision": "fp32", "zero": {"stage": 3}, "offload": {"device": "cpu"},
          "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01,
                        "betas": [0.9, 0.999], "eps": 1e-8},
          "scheduler": {"type": "warmup_linear", "warmup_steps": 2, "warmup_shape": "log",
                        "total_steps": 4},
          "gradient_clipping": 1.0,
          "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 2}}


class _Rows(torch.utils.data.Dataset[dict[str, list[int]]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.rows = [torch.randint(0, VOCAB, (12,), generator=g).tolist() for _ in range(12)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.rows[i]}


class _Collate:
    """Causal-LM batches; keeps what it built so the reference loop replays the same."""

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []

    def __call__(self, feats: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        ids = torch.tensor([f["input_ids"] for f in feats])
        labels = ids.clone()
        labels[:, :3] = -100  # a masked prefix, as a prompt would be
        self.seen.append({"input_ids": ids.clone(), "labels": labels.clone()})
        return {"input_ids": ids, "labels": labels}


def _trainer(tmp: Path, base: Path, collate: _Collate, **kw: Any) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(tmp / "out"), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-2, weight_decay=0.01, warmup_steps=2,
        max_steps=4, logging_steps=1, save_steps=2, report_to=[], seed=3, use_cpu=True,
        disable_tqdm=True, **kw)
    return tierzero.TierZeroTrainer(
        model=transformers.LlamaForCausalLM.from_pretrained(base), args=args,
        train_dataset=_Rows(), data_collator=collate, tierzero_config=str(tmp / "ds.json"))


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow
def test_trainer_with_deepspeed_auto_matches_tierzero_loop_and_resumes(tmp_path: Path) -> None:
    base = save_tiny_llama(tmp_path / "base", vocab=VOCAB, tokenizer=False)
    (tmp_path / "ds.json").write_text(json.dumps(DS_AUTO))
    collate = _Collate()
    trainer = _trainer(tmp_path, base, collate)
    result = trainer.train()
    losses = _losses(trainer)
    assert result.global_step == 4 and len(losses) == 4 and len(collate.seen) == 8
    trainer.save_model()
    model = trainer.model
    trainer.close()  # the model is whole again: the engine's gathered model
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(
        logits(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out"), ids),
        logits(model, ids), rtol=0, atol=1e-6)
    out = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert {"checkpoint-2", "checkpoint-4", "latest", "config.json", "model.safetensors"} <= set(
        out)

    # tierzero's own loop on the same batches, the config written out natively
    ref = transformers.LlamaForCausalLM.from_pretrained(base)
    eng, *_ = tierzero.initialize(model=ref, config=NATIVE)
    expected = []
    for step in range(4):
        micro = []
        for m in range(2):
            out_ = eng(**collate.seen[2 * step + m])
            eng.backward(out_.loss)
            eng.step()
            micro.append(float(out_.loss.detach()))
        expected.append(sum(micro) / 2)
    eng.close()
    assert losses == pytest.approx(expected, rel=1e-6, abs=0)
    assert losses[-1] < losses[0]

    # resume from checkpoint-2 in a fresh trainer: steps 3 and 4 repeat exactly
    collate2 = _Collate()
    again = _trainer(tmp_path, base, collate2)
    again.args.output_dir = str(tmp_path / "out2")
    again.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    again.close()
    assert _losses(again)[-2:] == pytest.approx(losses[2:], rel=1e-6, abs=0)
    for a, b in zip(collate2.seen[-4:], collate.seen[4:], strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])


def test_trainer_config_errors(tmp_path: Path) -> None:
    base = save_tiny_llama(tmp_path / "base", vocab=VOCAB, tokenizer=False)
    (tmp_path / "ds.json").write_text(json.dumps(DS_AUTO))
    trainer = _trainer(tmp_path, base, _Collate())
    trainer.tierzero_config = None
    with pytest.raises(ConfigError, match="tierzero_config"):
        trainer.train()
    trainer.tierzero_config = {**NATIVE, "batch": {"micro_batch_size": 4}}
    with pytest.raises(ConfigError, match=r"batch\.micro_batch_size"):
        trainer.train()


def test_import_tierzero_needs_no_transformers() -> None:
    """TierZeroTrainer and TierZeroMixin are imported on first use; `import tierzero` pulls
    in neither transformers nor peft."""
    code = ("import sys, tierzero; assert 'transformers' not in sys.modules, 'transformers'; "
            "assert 'peft' not in sys.modules, 'peft'; "
            "assert tierzero.TierZeroTrainer.__name__ == 'TierZeroTrainer'; "
            "assert tierzero.TierZeroMixin.__name__ == 'TierZeroMixin'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, timeout=300, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0, proc.stderr
