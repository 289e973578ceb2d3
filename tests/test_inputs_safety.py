"""Bad or hostile input gets a clear error before work starts: a user optimizer, model
state read outside the engine, weight indexes, Hugging Face configs shipping code,
overflowing config values, and unexpected CLI errors as one line."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_helpers import MACHINE
from engine_helpers import make_batches, make_config, make_model, reference_train
from safetensors.torch import save_file

from tierzero import engine
from tierzero.engine import cli
from tierzero.engine.plan.shapes import model_shape
from tierzero.engine.train.model_source import ModelError, build_model


def test_user_adamw_optimizer_is_rebuilt_and_matches_torch() -> None:
    # torch.optim.AdamW's defaults hold decoupled_weight_decay, which AdamW() refuses.
    cfg = make_config()
    model = make_model(n_blocks=2)
    batches = make_batches(3)
    ref = reference_train(model, cfg, [batches], steps=3)
    o = cfg.optimizer
    user = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                             weight_decay=o.weight_decay)
    eng, opt, _, _ = engine.initialize(model=model, config=cfg, optimizer=user, device="cpu")
    try:
        assert type(opt) is torch.optim.AdamW and opt.defaults["lr"] == o.lr
        for ids, tg in batches:
            eng.backward(eng(ids, tg))
            eng.step()
        with engine.GatheredParameters(list(model.parameters())):
            got = {k: v.detach().clone() for k, v in model.named_parameters()}
    finally:
        eng.close()
    for k, want in ref.params.items():
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-6, msg=k)


def test_state_dict_of_released_parameters_is_an_error_not_empty_tensors() -> None:
    model = make_model(n_blocks=2)
    eng, _, _, _ = engine.initialize(model=model, config=make_config(), device="cpu")
    try:
        for ids, tg in make_batches(1):
            eng.backward(eng(ids, tg))
            eng.step()
        with pytest.raises(engine.ParameterNotGatheredError,
                           match=r"state_dict\(\): \d+ partitioned parameter.*'emb\.weight'.*"
                                 r"GatheredParameters"):
            model.state_dict()
        live = model.state_dict(keep_vars=True)  # the Parameters themselves: not copies
        assert live["emb.weight"] is model.emb.weight
        with engine.GatheredParameters(list(model.parameters())):
            gathered = {k: v.clone() for k, v in model.state_dict().items()}
        assert all(v.numel() == p.numel() for v, p in zip(
            gathered.values(), make_model(n_blocks=2).state_dict().values(), strict=True))
    finally:
        eng.close()
    assert all(torch.equal(gathered[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["/etc/hostname", "../outside.safetensors", "sub/../../x"])
def test_weight_index_naming_files_outside_the_directory_is_refused(
    tmp_path: Path, name: str
) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    sd = make_model(n_blocks=1).state_dict()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "outside.safetensors"))
    index = {"weight_map": {k: name for k in sd}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(engine.PretrainedLoadError, match=r"names weight files outside"):
        engine.load_pretrained(make_model(n_blocks=1), model_dir)


def test_weight_index_through_a_symlink_out_is_refused(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    sd = make_model(n_blocks=1).state_dict()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "real.safetensors"))
    (model_dir / "w.safetensors").symlink_to(tmp_path / "real.safetensors")
    index = {"weight_map": dict.fromkeys(sd, "w.safetensors")}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(engine.PretrainedLoadError, match=r"outside.*\['w\.safetensors'\]"):
        engine.load_pretrained(make_model(n_blocks=1), model_dir)


def test_hf_config_with_auto_map_never_prompts_or_runs_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")

    def no_prompt(*_args: Any) -> str:
        raise AssertionError("transformers prompted on stdin for trust_remote_code")

    monkeypatch.setattr(builtins, "input", no_prompt)
    cfg = {"model_type": "llama", "vocab_size": 256, "hidden_size": 16,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 2, "max_position_embeddings": 64,
           "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                        "AutoModelForCausalLM": "modeling_evil.EvilModel"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "configuration_evil.py").write_text("raise SystemExit('remote code ran')\n")
    (tmp_path / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    model = build_model(str(tmp_path), 32)
    assert type(model).__name__ == "LlamaForCausalLM"
    # `tierzero plan --model DIR` reads the config through the same loader, on meta tensors
    assert type(model_shape(str(tmp_path)).module).__name__ == "LlamaForCausalLM"
    cfg["model_type"] = "evil-unknown"  # only remote code could build this one
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"^train\.model: .*without running code it ships"):
        build_model(str(tmp_path), 32)
    with pytest.raises(ModelError, match=r"^--model .*without running code it ships"):
        model_shape(str(tmp_path))


def test_tokenizer_with_auto_map_never_prompts_or_runs_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from data_helpers import tiny_tokenizer

    from tierzero.engine.train.data.tokenizer import load_tokenizer

    tiny_tokenizer(tmp_path)
    cfg_file = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    cfg_file.write_text(json.dumps(cfg))
    (tmp_path / "tokenization_evil.py").write_text("raise SystemExit('remote code ran')\n")

    def no_prompt(*_args: Any) -> str:
        raise AssertionError("transformers prompted on stdin for trust_remote_code")

    monkeypatch.setattr(builtins, "input", no_prompt)
    tok = load_tokenizer(str(tmp_path), "builtin:tiny")  # the local fast tokenizer
    assert type(tok).__name__ == "HFTokenizer"


@pytest.mark.parametrize(("text", "key"), [
    ("zero: {max_live_bytes: '1e400'}", "zero.max_live_bytes"),
    ("zero: {max_live_bytes: 1.0e+30}", "zero.max_live_bytes"),
    ("seed: 1180591620717411303424", "seed"),
    ("nvme: {threads: 1.0e+9}", "nvme.threads"),
    ("nvme: {queue_depth: 100000}", "nvme.queue_depth"),
    ("train: {steps: '1e30'}", "train.steps"),
])
def test_overflowing_config_values_are_rejected_by_config_check(
    tmp_path: Path, text: str, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    assert cli.main(["config", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tierzero config check: error: {path}: {key}: ")
    assert err.count("\n") == 1


def test_unexpected_cli_error_is_one_line_and_debug_shows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(_args: object) -> int:
        raise RuntimeError("first line\n  second line")

    monkeypatch.setattr(cli, "run_consolidate", broken)
    assert cli.main(["consolidate", "a", "b"]) == 1
    err = capsys.readouterr().err
    assert err == ("tierzero consolidate: error: RuntimeError: first line second line "
                   "(run with --debug for the traceback)\n")
    with pytest.raises(RuntimeError, match="first line"):
        cli.main(["consolidate", "a", "b", "--debug"])


def test_plan_write_into_a_missing_directory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "no" / "such" / "plan.yaml"
    code = cli.main(["plan", "--model", "40B", *MACHINE, "--nvme-path", str(tmp_path),
                     "--write", str(target)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("tierzero plan: error: FileNotFoundError") and "Traceback" not in err
    assert "plan.yaml" in err
