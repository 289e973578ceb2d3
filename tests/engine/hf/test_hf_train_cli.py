"""`tierzero train` with train.lora and train.export on a tiny pretrained Llama directory
(nvme offload): Hugging Face directories at checkpoints and at the end, whose logits are
those of the model the run's checkpoint holds; settings that cannot work are refused
before any work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hf_helpers import VOCAB, logits, save_tiny_llama

import tierzero
from tierzero.engine.cli import main
from tierzero.engine.config.train import LoraConfig
from tierzero.engine.hf import apply_lora
from tierzero.engine.train.checkpoints import TrainError
from tierzero.engine.train.setup import TrainOptions, check_settings

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _config(tmp: Path, **train: Any) -> Path:
    (tmp / "swap").mkdir(exist_ok=True)
    cfg = {"seed": 3, "precision": "fp32", "optimizer": {"lr": 1e-2},
           "offload": {"device": "nvme", "path": str(tmp / "swap")},
           "batch": {"micro_batch_size": 2},
           "train": {"model": str(tmp / "base"), "steps": 4, "seq_len": 16,
                     "out_dir": str(tmp / "runs"), "checkpoint_interval": 2, **train}}
    path = tmp / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _checkpoint_model(run: Path, lora: bool) -> torch.nn.Module:
    """The model the run's last checkpoint holds (consolidated fp32 shards)."""
    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(
        run.parent.parent / "base"))
    if lora:
        model = apply_lora(model, LoraConfig(r=4, target_modules=("q_proj", "v_proj")))
    state = tierzero.consolidate(run / "checkpoints", "step4")
    model.load_state_dict(state, strict=True)
    return model


def test_train_lora_exports_adapter_at_checkpoints_and_end(tmp_path: Path) -> None:
    base = save_tiny_llama(tmp_path / "base")
    config = _config(tmp_path, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]},
                     export={"at_checkpoints": True})
    assert main(["train", str(config), "--no-progress"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in (run / "hf").iterdir()) == ["final", "step2", "step4"]
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    expected = logits(_checkpoint_model(run, lora=True), ids)
    for tag in ("step4", "final"):
        got = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base),
                                             run / "hf" / tag)
        torch.testing.assert_close(logits(got, ids), expected, rtol=0, atol=1e-6)
    assert (run / "hf" / "final" / "tokenizer.json").is_file()
    step2 = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base),
                                           run / "hf" / "step2")
    assert (logits(step2, ids) - expected).abs().max() > 1e-4  # two more steps changed it


def test_train_full_model_export_loads_with_from_pretrained(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path / "base", tokenizer=False)
    export_dir = tmp_path / "exports"
    config = _config(tmp_path, export={"dir": str(export_dir), "dtype": "fp32",
                                       "max_shard_bytes": 60_000})
    assert main(["train", str(config), "--no-progress"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    final = export_dir / "final"
    assert (final / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits(transformers.LlamaForCausalLM.from_pretrained(final), ids),
                               logits(_checkpoint_model(run, lora=False), ids),
                               rtol=0, atol=1e-6)
    # a second run into the same export directory is refused before any work
    assert main(["train", str(config), "--no-progress"]) == 1
    assert len(list((tmp_path / "runs").iterdir())) == 1


@pytest.mark.parametrize(("train", "match"), [
    ({"model": "builtin:tiny", "export": {"at_checkpoints": True}}, "no Hugging Face format"),
    ({"export": {"at_checkpoints": True}, "checkpoint_interval": 0}, "checkpoint_interval"),
    ({"model": "builtin:tiny", "lora": {"r": 4}}, "target_modules"),
])
def test_train_hf_settings_refused(tmp_path: Path, train: dict[str, Any], match: str) -> None:
    save_tiny_llama(tmp_path / "base", tokenizer=False)
    config = tierzero.load_config(_config(tmp_path, **train))
    with pytest.raises(TrainError, match=match):
        check_settings(config, TrainOptions(progress=False))
