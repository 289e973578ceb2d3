"""The gradient home (offload.optimizer.grad_device, [Note: gradient home]) and the optimizer
state in pieces (offload.optimizer.chunk_numel, [Note: optimizer state in chunks]) change
where bytes live, never the numbers: with params and optimizer state on NVMe, every gradient
home and piece size trains to bitwise the same losses and parameters as the unchunked step
with gradients in host memory. Both the step begun during backward (no clipping: each
gradient is consumed as it turns final) and gradients that outlive backward (accumulation
over 2 micro-steps and clipping's global norm) are covered, in bf16 (param assembled from
the kernel's shadow) and fp32.

TinyLM's shards hold 4224-4352 elements, so pieces of 1000 / 4096 / 777 elements cut every
shard into several, with a short last piece (4096: one long piece and one of 256 or 128).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    RefResult,
    engine_train,
    full_params,
    make_batches,
    make_config,
    make_model,
)

from tierzero import engine
from tierzero.engine.config import Config
from tierzero.engine.config.errors import ConfigError
from tierzero.engine.config.schema import (
    BudgetsConfig,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)

STEPS = 3
WHOLE = 1 << 30  # chunk_numel above every shard: the unchunked step


def nvme_config(base: Config, path: Path, grad: str, chunk: int, *,
                host: int | None = 1 << 30) -> Config:
    where = str(path)
    return dataclasses.replace(base, offload=OffloadConfig(
        params=ParamOffloadConfig(device="nvme", path=where),
        optimizer=OptimizerOffloadConfig(device="nvme", path=where,
                                         grad_device=grad,  # type: ignore[arg-type]
                                         chunk_numel=chunk),
        budgets=BudgetsConfig(device_bytes=64 << 10, host_bytes=host)))


def run(base: Config, path: Path, grad: str, chunk: int) -> RefResult:
    sub = path / f"{grad}-{chunk}"
    sub.mkdir()
    gas = base.batch.gradient_accumulation_steps
    return engine_train(nvme_config(base, sub, grad, chunk), make_batches(STEPS * gas), STEPS)


@pytest.mark.parametrize(("precision", "gas", "clip"), [
    ("bf16", 1, 0.0),  # overlap_step: gradients consumed during backward
    ("fp32", 2, 0.5),  # gradients outlive backward: accumulation and clipping
])
def test_every_grad_home_and_chunk_size_matches_the_unchunked_step(
        tmp_path: Path, precision: str, gas: int, clip: float) -> None:
    base = make_config(precision, gas=gas, clip=clip)
    ref = run(base, tmp_path, "cpu", WHOLE)
    assert ref.report is not None
    ref_tiers = ref.report["tiers"]
    assert isinstance(ref_tiers, dict) and ref_tiers["grad_home"] == "host"
    for grad, chunk, home in (("nvme", 1000, "nvme"), ("nvme", WHOLE, "nvme"),
                              ("cpu", 4096, "host"), ("auto", 777, "host")):
        got = run(base, tmp_path, grad, chunk)
        assert got.losses == ref.losses, (grad, chunk)
        for k, v in ref.params.items():
            assert torch.equal(got.params[k], v), (grad, chunk, k)
        assert got.report is not None
        tiers = got.report["tiers"]
        assert isinstance(tiers, dict)
        assert tiers["grad_home"] == home, (grad, tiers["homes"])
        if chunk < WHOLE:  # the ring holds pieces: smaller than the unchunked one
            assert tiers["outside"]["adam_ring"] < ref_tiers["outside"]["adam_ring"]
            assert tiers["outside"]["adam_param"] > 0  # param assembled whole


def test_auto_grad_home_follows_the_host_budget(tmp_path: Path) -> None:
    """auto: host memory while an explicit host budget has room, NVMe without one (host
    memory then does not grow with the model); the gradients' NVMe bytes are counted."""
    base = make_config("bf16")
    for host, home in ((1 << 30, "host"), (None, "nvme")):
        sub = tmp_path / str(host)
        sub.mkdir()
        got = engine_train(nvme_config(base, sub, "auto", WHOLE, host=host), make_batches(1), 1)
        assert got.report is not None
        tiers = got.report["tiers"]
        assert isinstance(tiers, dict)
        assert tiers["grad_home"] == home
        grads = tiers["homes"]["grad"]
        assert set(grads) == {home}
        assert grads[home] == got.report["shard_bytes"]["grad"]


def test_grad_device_needs_an_offloaded_optimizer() -> None:
    base = make_config()
    with pytest.raises(ConfigError, match=r"offload\.optimizer\.grad_device"):
        dataclasses.replace(base, offload=OffloadConfig(
            optimizer=OptimizerOffloadConfig(device="none", grad_device="nvme")))


def test_checkpoint_of_state_in_pieces_resumes_under_any_piece_size(tmp_path: Path) -> None:
    """A checkpoint holds values, not pieces: saved from state in pieces of 1000 elements
    and loaded into whole shards (and back), training goes on bitwise as without a
    save (TieredShardStore assembles a shard from its pieces for the checkpoint)."""
    base = make_config("bf16", clip=0.5)
    batches = make_batches(3)
    ref = run(base, tmp_path, "nvme", WHOLE)
    for first, second in ((1000, WHOLE), (WHOLE, 777)):
        sub = tmp_path / f"ckpt-{first}-{second}"
        sub.mkdir()
        eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                         config=nvme_config(base, sub, "nvme", first))
        losses = []
        for ids, tg in batches[:2]:
            loss = eng(ids, tg)
            eng.backward(loss)
            eng.step()
            losses.append(float(loss.detach()))
        eng.save_checkpoint(sub / "ckpt")
        eng.close()
        model = make_model()
        eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                         config=nvme_config(base, sub, "nvme", second))
        eng.load_checkpoint(sub / "ckpt")
        ids, tg = batches[2]
        loss = eng(ids, tg)
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
        params = full_params(eng, model)
        eng.close()
        assert losses == ref.losses, (first, second)
        for k, v in ref.params.items():
            assert torch.equal(params[k], v), (first, second, k)
