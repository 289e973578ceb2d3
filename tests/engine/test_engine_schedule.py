"""Gather/release behaviour: size-0 params outside a gather, the outside-access error,
GatheredParameters, dynamic unit order, persistence and stage 1/2, memory arithmetic."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    DIM,
    PARAM_ATOL,
    assert_match,
    engine_train,
    make_batches,
    make_config,
    make_model,
    reference_train,
)
from torch import nn

from tierzero import engine
from tierzero.engine.shards.flat import SHARD_ALIGN


def test_parameters_hold_no_storage_outside_a_gather() -> None:
    model = make_model()
    shapes = {k: p.shape for k, p in model.named_parameters()}
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=make_config())
    assert all(p.numel() == 0 for p in model.parameters())
    with engine.GatheredParameters(model.blocks[1].parameters()):
        for k, p in model.blocks[1].named_parameters():
            assert p.shape == shapes[f"blocks.1.{k}"]
        assert model.blocks[0].up.weight.numel() == 0  # only the asked-for unit
    assert model.blocks[1].up.weight.numel() == 0
    eng.close()
    assert {k: p.shape for k, p in model.named_parameters()} == shapes


class Peeking(nn.Module):
    """Uses a block's weight from the root's forward: outside the block's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model(n_blocks=2)
        self.peek = True

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.inner(ids, targets)
        if not self.peek:
            return loss
        return loss + self.inner.blocks[0].up.weight.sum() * 0.0


def test_access_outside_unit_forward_names_param_and_fix() -> None:
    model = Peeking()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=make_config())
    ids, tg = make_batches(1)[0]
    with pytest.raises(engine.ParameterNotGatheredError) as err:
        eng(ids, tg)
    msg = str(err.value)
    assert "inner.blocks.0.up.weight" in msg and "GatheredParameters" in msg
    # the failed forward released everything; the engine keeps working after a fix
    assert all(p.numel() == 0 for p in model.parameters())
    model.peek = False
    loss = eng(ids, tg)
    eng.backward(loss)
    eng.step()
    assert torch.isfinite(loss)


def test_gathered_parameters_modifier_writes_shards() -> None:
    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                     config=make_config(precision="bf16"))
    with engine.GatheredParameters([model.blocks[2].up.bias], modifier_rank=0):
        before = model.blocks[2].down.weight.detach().float().clone()
        with torch.no_grad():
            model.blocks[2].up.bias.fill_(0.25)
    with engine.GatheredParameters(list(model.blocks[2].parameters())):
        engine_full = model.blocks[2].up.bias.detach().float().clone()
        after = model.blocks[2].down.weight.detach().float().clone()
    assert torch.equal(engine_full, torch.full((2 * DIM,), 0.25))
    assert torch.equal(before, after)  # untouched params keep their values
    # the fp32 master follows the edit, so the next step starts from it
    unit = next(u for u in eng.units if u.name == "blocks.2")
    key = unit.groups[0].key
    slot = next(s for s in unit.groups[0].slots if s.qname == "blocks.2.up.bias")
    master = eng.store.tensor(key, "master")[slot.offset:slot.offset + slot.numel]
    assert torch.equal(master, torch.full((2 * DIM,), 0.25))
    eng.close()


def test_dynamic_unit_order_is_rerecorded_and_exact() -> None:
    steps = 8
    orders: list[tuple[int, ...] | None] = [None, None, (1, 0, 2, 3), (3, 2, 1, 0),
                                            (0, 2), None, (0, 1, 2, 3, 1), None]
    cfg = make_config(clip=0.5)
    batches = make_batches(steps)
    ref = reference_train(make_model(), cfg, [batches], steps, orders=orders)
    got = engine_train(cfg, batches, steps, orders=orders)
    assert_match(got.losses, got.params, ref.losses, ref.params)
    assert got.report is not None and got.report["trace_changes"] == 6


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_1_and_2_match_pytorch(stage: int) -> None:
    cfg = make_config(stage=stage, gas=2, clip=0.5)
    batches = make_batches(16)
    ref = reference_train(make_model(), cfg, [batches], 8)
    got = engine_train(cfg, batches, 8)
    assert_match(got.losses, got.params, ref.losses, ref.params)


def test_persistent_units_stay_gathered_and_refresh_after_step() -> None:
    model = make_model()
    cfg = make_config(persistence=10**9)  # every block under the threshold
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    ids, tg = make_batches(1)[0]
    eng.backward(eng(ids, tg))
    assert model.blocks[0].up.weight.numel() == DIM * 2 * DIM  # still gathered
    w0 = model.blocks[0].up.weight.detach().clone()
    eng.step()
    eng(ids, tg)  # refreshed from the updated shard before use
    assert not torch.equal(model.blocks[0].up.weight.detach(), w0)
    assert eng.memory_report()["persistent_units"] == 4
    eng.close()


def test_memory_report_is_element_arithmetic() -> None:
    model = make_model()
    sizes = {k: p.numel() for k, p in model.named_parameters()}
    eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                     config=make_config(precision="bf16"))
    rep = eng.memory_report()
    per_unit = [sum(n for k, n in sizes.items() if k.startswith(f"blocks.{i}."))
                for i in range(4)]
    per_unit.append(sum(n for k, n in sizes.items() if not k.startswith("blocks.")))
    padded = [-(-n // SHARD_ALIGN) * SHARD_ALIGN for n in per_unit]  # world size 1
    assert rep["shard_bytes"]["param"] == 2 * sum(padded)
    # one rank, no accumulation: the gradient shards are bf16 ([Note: gradient precision])
    assert rep["shard_bytes"]["grad"] == 2 * sum(padded)
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        assert rep["shard_bytes"][kind] == 4 * sum(padded)
    assert rep["full_model_param_bytes"] == 2 * sum(per_unit)
    assert rep["gathered_bytes"] == 0
    ids, tg = make_batches(1)[0]
    eng.backward(eng(ids, tg))
    # peak: the root plus one block at a time, never two blocks
    assert rep["gathered_peak_bytes"] == 0
    peak = eng.memory_report()["gathered_peak_bytes"]
    assert peak == 2 * (padded[-1] + max(padded[:4]))
    eng.close()


def test_param_values_survive_partitioning() -> None:
    model = make_model()
    want = {k: p.detach().clone() for k, p in model.named_parameters()}
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=make_config())
    with engine.GatheredParameters(list(model.parameters())):
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), want[k], rtol=0, atol=0)
    eng.close()
    assert PARAM_ATOL > 0


def test_activation_checkpointing_recomputes_with_gathered_params() -> None:
    """Blocks recomputed inside backward find their unit gathered, and results stay exact."""
    def ckpt_model() -> nn.Module:
        m = make_model()
        m.checkpointed = True
        return m

    cfg = make_config(gas=2, clip=0.5)
    batches = make_batches(12)
    ref = reference_train(ckpt_model(), cfg, [batches], 6)
    got = engine_train(cfg, batches, 6, model=ckpt_model())
    assert_match(got.losses, got.params, ref.losses, ref.params)
