"""Late gradients (reentrant checkpoint segments sharing parameters) against plain PyTorch.

A parameter used in two reentrant checkpoint segments, or in one and outside it, has its
AccumulateGrad fire once per autograd graph task; the engine reduces a group as soon as
all its parameters fired once, so later firings are late gradients ([Note: late
gradients] in engine/late_grads.py). Before that Note they were dropped: these runs
then differed from plain PyTorch by ~5e-2 in parameters after 3 steps.

Tolerances: engine_helpers.PARAM_ATOL / LOSS_RTOL, the fp32 parity tolerances of
test_engine_parity.py (summation order only: a late part is added to the shard after
the first part, where plain PyTorch adds it to `.grad` before the step, ~1e-7 relative).
Every run also checks that late gradients happened (`memory_report()["late_gradients"]`),
so a model change that stops producing them cannot pass silently.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from engine_dist import run_two_ranks
from engine_helpers import LOSS_RTOL, RefResult, assert_match, engine_train, make_batches
from lategrad_helpers import (
    bound_eps_regime,
    first_boundary_grads,
    make_hook_model,
    make_shared_model,
    reference_grads,
    shared_config,
    shared_reference,
)

STEPS = 8
# Gradients at one boundary: rank means and late parts summed in another order than
# plain PyTorch's, ~1e-7 relative (measured <= 2e-7 of each tensor's largest element).
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7
GAS4_PARAM_ATOL = 1e-3  # see test_shared_segments_two_ranks_match_ddp_reference


def _late(result: RefResult) -> int:
    assert result.report is not None
    late = result.report["late_gradients"]
    assert isinstance(late, int)
    return late


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("gas", [1, 4])
def test_shared_segments_match_pytorch(offload: str, gas: int, tmp_path: Path) -> None:
    cfg = shared_config(gas=gas, clip=0.5, offload=offload, path=tmp_path)
    batches = make_batches(STEPS * gas)
    ref = shared_reference(make_shared_model(), cfg, [batches], STEPS)
    got = engine_train(cfg, batches, STEPS, model=make_shared_model())
    # per backward: block 2 (inside and outside segment B), block 0 (segments A and B),
    # the embedding weight (segment B and the root's lookup) fire late
    assert _late(got) >= STEPS * gas * 3
    assert_match(got.losses, got.params, ref.losses, ref.params)


@pytest.mark.parametrize(("frozen", "stage"), [(True, 3), (False, 2), (False, 1)])
def test_frozen_units_and_stages_1_2_match_pytorch(frozen: bool, stage: int) -> None:
    """Frozen: block 0 and the root hold frozen parameters, so they reduce only at the end
    of backward (nothing of theirs is late); block 2 still is. Stages 1 and 2: every block
    unit persistent (never released), the same scheduler."""
    cfg = shared_config(gas=2, clip=0.5, stage=stage)
    batches = make_batches(STEPS * 2)
    model = make_shared_model(frozen=frozen)
    ref = shared_reference(model, cfg, [batches], STEPS)
    got = engine_train(cfg, batches, STEPS, model=make_shared_model(frozen=frozen))
    assert _late(got) > 0
    bound_eps_regime(got.params, ref, cfg.optimizer.lr, STEPS)
    assert_match(got.losses, got.params, ref.losses, ref.params)
    if frozen:
        start = dict(model.named_parameters())
        for k in ("blocks.0.norm.weight", "norm.bias"):
            assert torch.equal(got.params[k], start[k].detach()), k


@pytest.mark.parametrize(("offload", "gas"), [("none", 1), ("cpu", 2)])
def test_backward_called_inside_a_hook_matches_pytorch(offload: str, gas: int) -> None:
    """torch.autograd.backward of an auxiliary loss inside a hook of the main backward:
    block 0 and the embedding get their gradient in two graph tasks."""
    cfg = shared_config(gas=gas, clip=0.5, offload=offload)
    batches = make_batches(STEPS * gas)
    ref = shared_reference(make_hook_model(), cfg, [batches], STEPS)
    got = engine_train(cfg, batches, STEPS, model=make_hook_model())
    assert _late(got) >= STEPS * gas  # block 0's parameters, or the embedding's
    assert_match(got.losses, got.params, ref.losses, ref.params)


def test_non_reentrant_segments_have_no_late_gradients() -> None:
    """The same model with use_reentrant=False: one graph task, every parameter fires once."""
    cfg = shared_config(gas=1, clip=0.5)
    batches = make_batches(3)
    ref = shared_reference(make_shared_model(reentrant=False), cfg, [batches], 3)
    got = engine_train(cfg, batches, 3, model=make_shared_model(reentrant=False))
    assert _late(got) == 0
    assert_match(got.losses, got.params, ref.losses, ref.params)


def _rank_run(rank: int, *, offload: str, gas: int, overlap_step: bool, clip: float,
              root: str) -> RefResult:
    path = Path(root) / f"rank{rank}"
    path.mkdir(exist_ok=True)
    cfg = shared_config(gas=gas, clip=clip, offload=offload, path=path,
                        overlap_step=overlap_step)
    return engine_train(cfg, make_batches(STEPS * gas, seed=1 + rank), STEPS,
                        model=make_shared_model(), world_mean=True)


@pytest.mark.multiproc
def test_shared_segments_two_ranks_match_ddp_reference(tmp_path: Path) -> None:
    """Late reductions are collectives: both ranks issue the same ones in the same order
    (a mismatch would hang or mix groups), and the result is plain PyTorch's.

    Gradient accumulation 4 on two ranks is checked on the gradient itself (the fp32
    shards at the first boundary against plain PyTorch's `.grad`, before any step) and
    on the losses of 8 steps, at the tight tolerances; its parameters after 8 steps only
    within GAS4_PARAM_ATOL: one AdamW element of this model (emb.weight[48, 1], its
    first gradient at step 2 cancels to about Adam's eps) turns the ~1e-7 relative
    summation-order difference of the rank mean into 1.2e-5 without any late gradient
    (use_reentrant=False) and 1.2e-4 with them (the late part is averaged over ranks
    separately); every other element is within PARAM_ATOL."""
    cases = {  # name: (offload, gas, overlap_step, clip)
        "none-gas1": ("none", 1, False, 0.5),
        "nvme-gas1": ("nvme", 1, False, 0.5),
        "cpu-early": ("cpu", 1, True, 0.0),  # the step begun during backward
        "cpu-gas4": ("cpu", 4, False, 0.5),
    }
    scenarios: dict[str, Callable[[int], object]] = {
        name: partial(_rank_run, offload=o, gas=g, overlap_step=e, clip=c, root=str(tmp_path))
        for name, (o, g, e, c) in cases.items()}
    grads = {"grads-none-sync": ("none", False), "grads-nvme": ("nvme", True)}
    for name, (o, oc) in grads.items():
        scenarios[name] = partial(first_boundary_grads, gas=4, world=2, offload=o,
                                  root=str(tmp_path), overlap_comm=oc)
    results = run_two_ranks(tmp_path, scenarios)
    for name, (_, gas, _, clip) in cases.items():
        r0, r1 = results[0][name], results[1][name]
        assert r0.losses == r1.losses, name
        for k in r0.params:
            assert torch.equal(r0.params[k], r1.params[k]), (name, k)
        assert _late(r0) >= STEPS * gas * 3 and _late(r1) == _late(r0), name
        cfg = shared_config(gas=gas, clip=clip)
        per_rank = [make_batches(STEPS * gas, seed=1 + r) for r in range(2)]
        ref = shared_reference(make_shared_model(), cfg, per_rank, STEPS)
        if gas == 1:
            assert_match(r0.losses, r0.params, ref.losses, ref.params)
            continue
        torch.testing.assert_close(torch.tensor(r0.losses), torch.tensor(ref.losses),
                                   rtol=LOSS_RTOL, atol=0.0)
        for k, want in ref.params.items():
            torch.testing.assert_close(r0.params[k], want, rtol=0.0, atol=GAS4_PARAM_ATOL,
                                       msg=k)
    want = reference_grads(gas=4, world=2)
    for name in grads:
        got = results[0][name]
        assert got.keys() == want.keys()
        for k, g in want.items():
            assert torch.equal(got[k], results[1][name][k]), (name, k)
            torch.testing.assert_close(got[k], g, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=k)


def test_first_boundary_gradients_match_pytorch_world1() -> None:
    """One rank, 4 micro-steps: the accumulated fp32 shards hold plain PyTorch's `.grad`
    (same additions in the same order: measured bit-identical)."""
    got = first_boundary_grads(0, gas=4, world=1)
    want = reference_grads(gas=4, world=1)
    assert got.keys() == want.keys()
    for k, g in want.items():
        torch.testing.assert_close(got[k], g, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=k)
