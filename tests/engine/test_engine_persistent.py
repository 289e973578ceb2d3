"""Units that stay gathered between steps never show pre-step values.

Every unit at stage 1 and 2, and a stage-3 unit under zero.persistence_threshold_bytes,
keeps a full copy of its parameters; the optimizer step and load_checkpoint change the
shards ([Note: persistent units after the step] in engine/schedule.py). Checked against
plain PyTorch (AdamW, fp32) at the parity tolerances of test_engine_parity.py: what
`model.state_dict()` and `model.parameters()` give between steps, a forward whose root
reads a block's weight before the block runs, and the first forward after
load_checkpoint; stages 1, 2 and 3, offload none / cpu / nvme, one and two gloo ranks.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import pytest
import torch
from engine_dist import run_two_ranks
from engine_helpers import (
    LOSS_RTOL,
    PARAM_ATOL,
    TinyLM,
    make_batches,
    make_config,
    reference_train,
)
from torch import nn

from tierzero import engine
from tierzero.engine.access import ParameterNotGatheredError
from tierzero.engine.collectives import Comm
from tierzero.engine.config import (
    BudgetsConfig,
    Config,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)

STEPS = 3
SAVE_AFTER = 1  # checkpoint after this many steps, loaded back after the last


class EarlyReadLM(TinyLM):
    """TinyLM whose root scales the embeddings by block 2's LayerNorm weight before any
    block runs: a read of a block unit's parameter outside that unit's forward."""

    def forward(self, ids: torch.Tensor, targets: torch.Tensor,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
        x = self.emb(ids) * self.blocks[2].norm.weight.detach()  # (B, T, C)
        for i in range(len(self.blocks)) if order is None else order:
            x = self.blocks[i](x)
        logits = self.head(self.norm(x)).float()  # (B, T, V)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1))


def make_early_model() -> EarlyReadLM:
    torch.manual_seed(0)
    model = EarlyReadLM()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    return model


def config(stage: int, offload: str, path: Path, persistence: int = 10**9) -> Config:
    """Every block under the persistence threshold (stage 3), the given offload (of the
    optimizer state only at stage 1/2, whose parameters are not partitioned)."""
    cfg = make_config(stage=stage, clip=0.5, persistence=persistence)
    if offload == "none":
        return cfg
    where = str(path) if offload == "nvme" else None
    return dataclasses.replace(cfg, offload=OffloadConfig(
        params=ParamOffloadConfig(device=offload if stage == 3 else "none",  # type: ignore[arg-type]
                                  path=where),
        optimizer=OptimizerOffloadConfig(device=offload, path=where),  # type: ignore[arg-type]
        budgets=BudgetsConfig(device_bytes=1 << 30)))


def _read(model: nn.Module) -> dict[str, torch.Tensor]:
    """What user code between steps sees: state_dict() and parameters(), as copies.
    state_dict() refuses released parameters (the stage-3 root) by name instead of
    saving empty tensors; parameters() then shows them empty, never old."""
    listed = {k: p.detach().clone() for k, p in model.named_parameters()}
    try:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()
                 if not k.endswith(("running_mean", "running_var"))}
    except ParameterNotGatheredError as err:
        released = [k for k, p in listed.items() if p.numel() == 0]
        assert released and released[0] in str(err), str(err)
        return listed
    for k, p in listed.items():  # the same tensors either way
        assert torch.equal(p, state[k]), k
    return state


def scenario(rank: int, *, stage: int, offload: str, tmp: Path) -> dict[str, object]:
    """STEPS steps on this rank's batches (seed 1 + rank), reading every parameter after
    each; then load the checkpoint saved after SAVE_AFTER steps, read again, and run the
    next step again from there."""
    tmp = tmp / f"s{stage}-{offload}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / f"swap{rank}").mkdir(exist_ok=True)
    model = make_early_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                     config=config(stage, offload, tmp / f"swap{rank}"))
    comm = Comm()
    batches = make_batches(STEPS, seed=1 + rank)
    losses, reads = [], []
    for step, (ids, tg) in enumerate(batches):
        loss = eng(ids, tg)
        eng.backward(loss)
        eng.step()
        val = loss.detach().reshape(1).clone()
        comm.all_reduce_sum(val)
        losses.append(float(val) / comm.world_size)
        reads.append(_read(model))
        if step + 1 == SAVE_AFTER:
            eng.save_checkpoint(tmp / "ckpt")
    eng.load_checkpoint(tmp / "ckpt")
    after_load = _read(model)
    ids, tg = batches[SAVE_AFTER]
    loss = eng(ids, tg)  # the first forward after the load reads block 2 early
    val = loss.detach().reshape(1).clone()
    comm.all_reduce_sum(val)
    eng.backward(loss)
    eng.step()
    out = {"losses": losses, "reads": reads, "after_load": after_load,
           "loss_after_load": float(val) / comm.world_size, "after_load_step": _read(model),
           "persistent": {u.label: u.persistent for u in eng.units}}
    eng.close()
    return out


def _check(got: dict[str, object], stage: int, world: int) -> None:
    per_rank = [make_batches(STEPS, seed=1 + r) for r in range(world)]
    cfg = make_config(clip=0.5)
    refs = [reference_train(make_early_model(), cfg, per_rank, k) for k in range(STEPS + 1)]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(refs[-1].losses),
                               rtol=LOSS_RTOL, atol=0.0)
    # after load_checkpoint the model is the one after SAVE_AFTER steps; the next step's
    # loss and parameters are the reference's step SAVE_AFTER + 1
    torch.testing.assert_close(torch.tensor(got["loss_after_load"]),
                               torch.tensor(refs[-1].losses[SAVE_AFTER]), rtol=LOSS_RTOL,
                               atol=0.0)
    reads = [*got["reads"], got["after_load"], got["after_load_step"]]  # type: ignore[misc]
    want = [refs[k + 1] for k in range(STEPS)] + [refs[SAVE_AFTER], refs[SAVE_AFTER + 1]]
    persistent = got["persistent"]
    assert isinstance(persistent, dict)
    assert all(persistent.values()) == (stage < 3)
    assert all(v for k, v in persistent.items() if k != "<root>")  # every block unit
    for read, ref in zip(reads, want, strict=True):
        for k, value in ref.params.items():
            if stage == 3 and not k.startswith("blocks."):
                assert read[k].numel() == 0, k  # the root is released: empty, never old
                continue
            torch.testing.assert_close(read[k], value, rtol=0.0, atol=PARAM_ATOL, msg=k)
    start = dict(make_early_model().named_parameters())
    assert float((refs[1].params["blocks.2.norm.weight"]
                  - start["blocks.2.norm.weight"].detach()).abs().max()) > 100 * PARAM_ATOL


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_persistent_units_current_between_steps(stage: int, offload: str,
                                                tmp_path: Path) -> None:
    _check(scenario(0, stage=stage, offload=offload, tmp=tmp_path), stage, world=1)


@pytest.mark.multiproc
def test_persistent_units_current_two_ranks(tmp_path: Path) -> None:
    # each stage and each offload once (the one-rank test crosses them all)
    cases = [(1, "none"), (2, "cpu"), (3, "nvme")]
    scenarios = {f"s{s}-{o}": partial(scenario, stage=s, offload=o, tmp=tmp_path)
                 for s, o in cases}
    results = run_two_ranks(tmp_path, scenarios)
    for stage, offload in cases:
        for rank in range(2):
            _check(results[rank][f"s{stage}-{offload}"], stage, world=2)


def test_early_read_of_released_unit_names_the_parameter() -> None:
    """Stage 3 with blocks above the threshold: block 2 is released when the root reads
    its weight, which is an error naming it, not a silent empty or old value."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_early_model(),
                                     config=config(3, "none", Path("unused"), persistence=0))
    ids, tg = make_batches(1)[0]
    with pytest.raises(ParameterNotGatheredError, match=r"blocks\.2\.norm\.weight"):
        eng(ids, tg)
    eng.close()
