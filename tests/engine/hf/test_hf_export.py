"""export_hf: a live engine's model as a Hugging Face directory. Weights equal the engine's
(fp32 master exactly; bf16 = the master rounded), from_pretrained gives the engine's
logits, offloaded (nvme) state streams one group at a time, sharded files carry an
index, tokenizer files are copied, nothing is overwritten; load_pretrained writes into
offloaded shards after initialize."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_helpers import VOCAB, logits, save_tiny_llama
from safetensors import safe_open

import tierzero
from tierzero.engine.hf import ExportError, export_hf

transformers = pytest.importorskip("transformers")


def _cfg(tmp: Path, device: str = "nvme") -> tierzero.Config:
    (tmp / "swap").mkdir(exist_ok=True)
    offload = {"device": device, "path": str(tmp / "swap")} if device == "nvme" else {
        "device": device}
    return tierzero.load_config({"precision": "fp32", "optimizer": {"lr": 1e-2},
                                 "zero": {"persistence_threshold_bytes": 0},
                                 "offload": offload})


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    return out


def _train(eng: tierzero.ZeroEngine, steps: int, seed: int = 1) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (2, 12), generator=g)
        out = eng(input_ids=x, labels=x)
        eng.backward(out.loss)
        eng.step()
        losses.append(float(out.loss.detach()))
    return losses


def test_export_full_model_from_nvme_matches_engine(tmp_path: Path) -> None:
    base = save_tiny_llama(tmp_path / "base")
    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(base))
    eng, *_ = tierzero.initialize(model=model, config=_cfg(tmp_path))
    tierzero.load_pretrained(eng, base)  # into nvme-offloaded shards, after initialize
    export_hf(eng, tmp_path / "step0")
    assert {k: v.shape for k, v in _tensors(tmp_path / "step0").items()} == {
        k: v.shape for k, v in _tensors(base).items()}
    for k, v in _tensors(base).items():  # the file's values, exactly
        assert torch.equal(_tensors(tmp_path / "step0")[k], v), k

    _train(eng, 3)
    out = export_hf(eng, tmp_path / "out", max_shard_bytes=40_000, tokenizer_from=base)
    export_hf(eng, tmp_path / "bf16", dtype="bf16")
    with pytest.raises(ExportError, match="already exists"):
        export_hf(eng, tmp_path / "out")
    eng.close()  # every parameter whole again: the engine's gathered model
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    expected = logits(model, ids)

    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in names
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(_tensors(out)) and set(index["weight_map"].values()) \
        == set(shards)
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert f in names
    assert json.loads((out / "config.json").read_text()).get("dtype") == "float32"
    assert not (tmp_path / ".out.partial").exists()

    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=0, atol=1e-6)
    for k, v in _tensors(out).items():  # trained: moved away from the pretrained values
        assert not torch.equal(v, _tensors(base)[k]) or "norm" in k, k
    fp32, bf16 = _tensors(out), _tensors(tmp_path / "bf16")
    assert set(bf16) == set(fp32)
    for k, v in bf16.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, fp32[k].to(torch.bfloat16)), k
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("w3 w4")["input_ids"] == [5, 6]


def test_export_tied_weights_and_cpu_offload(tmp_path: Path) -> None:
    base = save_tiny_llama(tmp_path / "base", tie=True, tokenizer=False)
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    eng, *_ = tierzero.initialize(model=model, config=_cfg(tmp_path, "cpu"))
    _train(eng, 2)
    out = export_hf(eng, tmp_path / "out")
    eng.close()
    assert "lm_head.weight" not in _tensors(out)  # tied: written once, as save_pretrained does
    ids = torch.randint(0, VOCAB, (1, 8))
    torch.testing.assert_close(logits(transformers.LlamaForCausalLM.from_pretrained(out), ids),
                               logits(model, ids), rtol=0, atol=1e-6)


def test_export_refuses_models_without_hf_config(tmp_path: Path) -> None:
    from tierzero.engine.models import SIZES, TinyLM

    eng, *_ = tierzero.initialize(model=TinyLM(SIZES["tiny"]), config=_cfg(tmp_path, "none"))
    try:
        with pytest.raises(ExportError, match="no Hugging Face config"):
            export_hf(eng, tmp_path / "out")
        with pytest.raises(ExportError, match="allowed: fp32, bf16"):
            export_hf(eng, tmp_path / "out", dtype="fp16")
    finally:
        eng.close()
    assert not (tmp_path / "out").exists()


def test_export_fault_raises_and_publishes_nothing(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails midway (disk full) is an ExportError naming the directory; the
    output directory never appears, and a retry after the fault writes it whole."""
    from tierzero.engine.checkpoint.io import SafetensorsWriter

    base = save_tiny_llama(tmp_path / "base", tokenizer=False)
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    eng, *_ = tierzero.initialize(model=model, config=_cfg(tmp_path, "none"))
    real = SafetensorsWriter.write
    calls = {"n": 0}

    def failing(self: SafetensorsWriter, name: str, tensor: torch.Tensor) -> None:
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError(28, "No space left on device")
        real(self, name, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", failing)
    with pytest.raises(ExportError, match=r"No space left on device") as info:
        export_hf(eng, tmp_path / "out", max_shard_bytes=30_000)
    assert ".out.partial" in str(info.value)
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(SafetensorsWriter, "write", real)
    export_hf(eng, tmp_path / "out", max_shard_bytes=30_000)  # the leftover is replaced
    eng.close()
    assert _tensors(tmp_path / "out").keys() == _tensors(base).keys()
    assert not (tmp_path / ".out.partial").exists()
