"""Consolidation: whole weights from shards equal the model's gathered parameters exactly;
safetensors output (single, sharded with an index, fp32/bf16) through the CLI, streamed one
tensor at a time, and loadable by transformers' from_pretrained."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from engine_helpers import full_params, make_batches, make_config, make_model
from safetensors.torch import load_file

import tierzero.engine.checkpoint.consolidate as cons
from tierzero import engine
from tierzero.engine.cli import main


def _train_and_save(tmp: Path, precision: str) -> dict[str, torch.Tensor]:
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=make_config(precision=precision),
                                     device="cpu")
    for ids, tg in make_batches(3):
        eng.backward(eng(ids, tg))
        eng.step()
    eng.save_checkpoint(tmp)
    params = full_params(eng, model)  # gathered compute-dtype values, as fp32
    eng.close()
    return params


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_consolidated_equals_gathered_parameters(tmp_path: Path, precision: str) -> None:
    """fp32: master is the compute copy, so equal as is. bf16: the gathered parameter is the
    fp32 master rounded to bf16, so the fp32 consolidation rounded the same way is equal."""
    gathered = _train_and_save(tmp_path, precision)
    sd = engine.consolidate(tmp_path)
    assert list(sd) == list(gathered)
    for k, v in gathered.items():
        assert sd[k].dtype == torch.float32
        got = sd[k] if precision == "fp32" else sd[k].to(torch.bfloat16).float()
        assert torch.equal(got, v), k
    low = engine.consolidate(tmp_path, dtype=torch.bfloat16)
    assert all(torch.equal(low[k], sd[k].to(torch.bfloat16)) for k in sd)


def test_cli_sharded_output_streams_one_tensor_at_a_time(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    _train_and_save(tmp_path / "ckpt", "fp32")
    want = engine.consolidate(tmp_path / "ckpt")
    alive: list[weakref.ref[torch.Tensor]] = []
    most = 0
    original = cons._Source.read

    def tracking_read(self: cons._Source, item: cons._Item, out: torch.dtype) -> torch.Tensor:
        nonlocal most
        t = original(self, item, out)
        alive.append(weakref.ref(t))
        most = max(most, sum(r() is not None for r in alive))
        return t

    monkeypatch.setattr(cons._Source, "read", tracking_read)
    out = tmp_path / "hf"
    assert main(["consolidate", str(tmp_path / "ckpt"), str(out),
                 "--max-shard-size", "20KB"]) == 0
    assert most == 1  # never two consolidated tensors in memory at once
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert capsys.readouterr().out.splitlines()[-1].endswith("index.json")
    got: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(out / f)
        assert sum(t.numel() * 4 for t in part.values()) <= 20_000 or len(part) == 1
        assert all(index["weight_map"][k] == f for k in part)
        got.update(part)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in want.values())

    single = tmp_path / "bf16"
    assert main(["consolidate", str(tmp_path / "ckpt"), str(single), "--dtype", "bf16"]) == 0
    low = load_file(single / "model.safetensors")
    assert all(torch.equal(low[k], want[k].to(torch.bfloat16)) for k in want)


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["consolidate", str(tmp_path / "nope"), str(tmp_path / "out")]) == 1
    assert "nope' does not exist" in capsys.readouterr().err
    _train_and_save(tmp_path / "ckpt", "fp32")
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "o"),
                 "--max-shard-size", "5XB"]) == 1
    assert "--max-shard-size: '5XB' is not allowed" in capsys.readouterr().err


transformers = pytest.importorskip("transformers")


def _hf_models() -> dict[str, torch.nn.Module]:
    llama = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 64, "attn_implementation": "eager"}
    torch.manual_seed(0)
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama,
                                                                  tie_word_embeddings=True))
    untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama,
                                                                    tie_word_embeddings=False))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4,
        attn_implementation="eager"))
    return {"llama-tied": tied, "llama-untied": untied, "gpt2": gpt2}


@pytest.mark.parametrize("name", ["llama-tied", "llama-untied", "gpt2"])
def test_from_pretrained_loads_consolidated_weights(tmp_path: Path, name: str) -> None:
    model = _hf_models()[name].eval()  # no dropout: logits compare exactly
    cfg = engine.load_config({"zero": {"stage": 3}, "precision": "fp32",
                              "optimizer": {"type": "adamw", "lr": 1e-2}})
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        eng.backward(eng(input_ids=ids, labels=ids).loss)
        eng.step()
    eng.save_checkpoint(tmp_path / "ckpt")
    eng.close()  # parameters whole again: the reference
    out = tmp_path / "hf"
    assert main(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 0
    assert (out / "config.json").is_file()
    # the same attention kernel as the reference (from_pretrained would pick sdpa)
    loaded = type(model).from_pretrained(out, attn_implementation="eager").eval()
    ref_sd, got_sd = model.state_dict(), loaded.state_dict()
    assert ref_sd.keys() == got_sd.keys()
    bad = [k for k in ref_sd if not torch.equal(ref_sd[k], got_sd[k])]
    assert not bad, bad
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
