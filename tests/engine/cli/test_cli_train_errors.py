"""`tierzero train` refuses bad input before any work, naming what was wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import write_config

from tierzero.engine.cli import main
from tierzero.engine.models import SIZES, TinyLM
from tierzero.engine.train import ByteBatches, DataError, ModelError, build_model, load_bytes


def run_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["train", *args, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tierzero train: error: ")
    return err


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = run_error([str(tmp_path / "nope.yaml")], capsys)
    assert "nope.yaml" in err


@pytest.mark.parametrize(("train", "needle"), [
    ({"model": "builtin:huge"}, "unknown built-in size 'huge'; allowed: builtin:tiny, "
                                "builtin:small, builtin:base"),
    ({"model": "/no/such/model"}, "neither a built-in size"),
    ({"dataset": "/no/such.txt"}, "train.dataset: '/no/such.txt' is not a file"),
    ({"resume": True}, "train.resume: true needs train.checkpoint_dir"),
    ({"resume": "/no/such/ckpt"}, "train.resume: '/no/such/ckpt': no checkpoint there"),
    ({"seq_len": 4096}, "train.seq_len 4096 exceeds builtin:tiny's context of 128"),
    ({"stepz": 3}, "train.stepz: unknown key (did you mean 'steps'?)"),
])
def test_bad_train_settings(train: dict[str, object], needle: str, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    err = run_error([str(write_config(tmp_path, **train))], capsys)
    assert needle in err
    assert not (tmp_path / "runs").exists()  # refused before any work


def test_bad_dataset_extension_and_jsonl(tmp_path: Path) -> None:
    csv = tmp_path / "d.csv"
    csv.write_text("a,b")
    with pytest.raises(DataError, match=r"unknown extension; allowed: \.txt, \.jsonl"):
        load_bytes(str(csv))
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: needs a string field 'text'; found keys"):
        load_bytes(str(bad))
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        load_bytes(str(bad))


def test_dataset_too_short(tmp_path: Path) -> None:
    short = tmp_path / "s.txt"
    short.write_text("hello")
    tokens, source = load_bytes(str(short))
    with pytest.raises(DataError, match=r"has 5 bytes; train\.seq_len 32 needs at least 34"):
        ByteBatches(tokens, 32, 1, seed=0, rank=0, source=source)


@pytest.mark.parametrize(("flag", "needle"), [
    (["--trace-steps", "x"], "--trace-steps 'x': allowed: FIRST,COUNT"),
    (["--trace-steps", "9,1"], "FIRST <= train.steps (6)"),
    (["--steps", "0"], "--steps 0: allowed: an int >= 1"),
    (["--plot", "/no/such/dir/p.png"], "directory /no/such/dir does not exist"),
])
def test_bad_flags(flag: list[str], needle: str, tmp_path: Path,
                   capsys: pytest.CaptureFixture[str]) -> None:
    args = [str(write_config(tmp_path)), *flag]
    if "--trace-steps" in flag:
        args += ["--trace", str(tmp_path / "t.json")]
    assert needle in run_error(args, capsys)


def test_batches_are_next_byte_pairs() -> None:
    tokens, source = load_bytes(None)
    data = ByteBatches(tokens, 16, 3, seed=1, rank=0, source=source)
    x, y = data.next()
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # labels are the inputs shifted by one byte
    other = ByteBatches(tokens, 16, 3, seed=1, rank=1, source=source).next()[0]
    assert not torch.equal(x, other)  # ranks draw different windows


def test_model_sizes_and_units() -> None:
    for cfg in SIZES.values():
        assert sum(p.numel() for p in TinyLM(cfg).parameters()) == cfg.num_parameters
    model = build_model("builtin:tiny", 32)
    assert type(model).__name__ == "TinyLM" and model._no_split_modules == ("Block",)


def test_hf_config_model(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    cfg.save_pretrained(tmp_path / "llama")
    model = build_model(str(tmp_path / "llama"), 32)
    assert type(model).__name__ == "LlamaForCausalLM"
    with pytest.raises(ModelError, match="exceeds max_position_embeddings 64"):
        build_model(str(tmp_path / "llama" / "config.json"), 128)
    small = json.loads((tmp_path / "llama" / "config.json").read_text())
    small["vocab_size"] = 100
    (tmp_path / "llama" / "config.json").write_text(json.dumps(small))
    with pytest.raises(ModelError, match="vocab_size 100; byte-level training needs at least 256"):
        build_model(str(tmp_path / "llama"), 32)


def test_hf_pretrained_directory_is_loaded(tmp_path: Path) -> None:
    """A model directory with weights is fine-tuned from them: the first step's loss is the
    saved model's loss on the first batch (fp32, computed here in plain PyTorch)."""
    transformers = pytest.importorskip("transformers")
    import torch.nn.functional as F
    from cli_helpers import read_metrics

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(123)  # weights unlike what the job's own seed would draw
    saved = transformers.AutoModelForCausalLM.from_config(cfg)
    for p in saved.parameters():
        p.data.normal_(0, 0.2)
    saved.save_pretrained(tmp_path / "ckpt")
    config = write_config(tmp_path, model=str(tmp_path / "ckpt"), steps=1)
    assert main(["train", str(config), "--no-progress"]) == 0
    first = next(r for r in read_metrics(tmp_path) if r["event"] == "step")
    tokens, source = load_bytes(None)
    x, y = ByteBatches(tokens, 32, 2, seed=3, rank=0, source=source).next()
    with torch.no_grad():
        ref = F.cross_entropy(saved(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
    # fp32 both sides, the same weights and batch: equal up to summation order.
    assert first["loss"] == pytest.approx(ref, rel=1e-5)
