"""Checkpoints written before the compute-precision parameter shard was renamed from
`param16` to `param` still load: tests/data/ckpt_param16/ was written by the last tree
that used the old name (its make_legacy_ckpt.py), with a frozen group saved as `param16`."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from engine_helpers import full_params, make_batches, make_config, make_model, train_steps
from safetensors.torch import load_file

from tierzero import engine
from tierzero.engine.checkpoint.consolidate import consolidate_to_safetensors
from tierzero.engine.checkpoint.layout import GroupLayout, load_manifest, resolve

DATA = Path(__file__).parents[2] / "data" / "ckpt_param16"


def _model() -> torch.nn.Module:
    model = make_model(n_blocks=1)
    model.emb.weight.requires_grad_(False)
    return model


def test_legacy_layout_reads_param16_as_param() -> None:
    path = resolve(DATA / "ckpt", None)
    groups = [GroupLayout.from_json(g) for g in load_manifest(path)["groups"]]
    frozen = [g for g in groups if not g.trainable]
    assert frozen and all(g.kinds == ("param",) for g in frozen)
    assert all(g.tensor_name("param") == f"{g.key}::param16" for g in frozen)
    assert all(g.as_json()["kinds"] == ["param16"] for g in frozen)  # round trip as saved


def test_legacy_checkpoint_loads_and_trains(tmp_path: Path) -> None:
    expected = load_file(str(DATA / "expected_params.safetensors"))
    model = _model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=make_config("bf16"))
    try:
        shutil.copytree(DATA / "ckpt", tmp_path / "ckpt")
        eng.load_checkpoint(str(tmp_path / "ckpt"))
        got = full_params(eng, model)
        assert got.keys() == expected.keys()
        for k, v in expected.items():
            assert torch.equal(got[k], v), k
        train_steps(eng, make_batches(4)[2:])  # and it trains on from there
        assert not torch.equal(full_params(eng, model)["head.weight"], expected["head.weight"])
        assert torch.equal(full_params(eng, model)["emb.weight"], expected["emb.weight"])
    finally:
        eng.close()


def test_legacy_checkpoint_consolidates(tmp_path: Path) -> None:
    shutil.copytree(DATA / "ckpt", tmp_path / "ckpt")
    out = tmp_path / "hf"
    consolidate_to_safetensors(str(tmp_path / "ckpt"), str(out))
    expected = load_file(str(DATA / "expected_params.safetensors"))
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(str(f)))
    assert torch.equal(got["emb.weight"].float(), expected["emb.weight"])
