"""Init, load_pretrained and a LoRA + HF checkpointing fine-tune with the engine on a CUDA
device; compared with plain PyTorch on the same GPU.

Tolerances as in test_engine_cuda.py (fp32, TF32 off, only summation order differs; the
CPU bounds with 10x margin for GPU reduction kernels): params 1e-4, losses 1e-5."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_model
from safetensors.torch import save_file

from tierzero import engine
from tierzero.engine.init.context import is_partitioned

pytestmark = pytest.mark.cuda


def _cfg() -> engine.Config:
    return engine.load_config({"zero": {"stage": 3, "units": ["Block"],
                                        "persistence_threshold_bytes": 0,
                                        "max_live_bytes": 8_000, "init_live_bytes": 8_000},
                               "precision": "fp32"})


def test_init_and_load_pretrained_on_cuda(tmp_path: Path) -> None:
    ref = make_model(seed=0)
    with engine.Init(config=_cfg()):
        model = make_model(seed=0)
    assert all(is_partitioned(p) for p in model.parameters())
    eng, _, _, _ = engine.initialize(model=model, config=_cfg())
    assert eng.device.type == "cuda"
    with engine.GatheredParameters(list(model.parameters())):
        for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.device.type == "cuda"
            assert torch.equal(p.cpu(), q.detach()), k
    sd = {k: v.detach().clone() for k, v in make_model(seed=5).state_dict().items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    engine.load_pretrained(eng, tmp_path)
    with engine.GatheredParameters(list(model.parameters())):
        for k, p in model.named_parameters():
            assert torch.equal(p.cpu(), sd[k]), k
    ids = torch.zeros(2, 8, dtype=torch.long)
    loss = eng(ids, ids)
    eng.backward(loss)
    eng.step()
    eng.close()


def test_lora_hf_checkpointing_on_cuda() -> None:
    pytest.importorskip("transformers")
    import test_models_hf as hf

    model = hf._llama(tied=True)
    ref = hf._llama(tied=True)
    hf._add_lora(model)
    hf._add_lora(ref)
    ref.cuda()
    cfg = engine.load_config({"zero": {"stage": 3, "persistence_threshold_bytes": 0},
                              "precision": "fp32", "gradient_clipping": 1.0,
                              "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1}})
    eng, _, _, _ = engine.initialize(model=model, config=cfg)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.1)
    losses, ref_losses = [], []
    for ids in hf._data(2) * 2:
        out = eng(input_ids=ids, labels=ids)
        eng.backward(out.loss)
        eng.step()
        losses.append(float(out.loss.detach()))
        r = ref(input_ids=ids.cuda(), labels=ids.cuda())
        r.loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(r.loss.detach()))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                               atol=0.0)
    with engine.GatheredParameters(list(model.parameters())):
        got = {k: v.detach().cpu() for k, v in model.named_parameters()}
    for k, q in ref.named_parameters():
        torch.testing.assert_close(got[k], q.detach().cpu(), rtol=0.0, atol=1e-4, msg=k)
    eng.close()
