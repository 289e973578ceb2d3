"""Exact resume: N micro-steps, save, load in a fresh process, M more == N+M uninterrupted,
bit for bit (torch.equal, no tolerance: the same kernels see the same bytes). Also loading at
another world size (resharded, exact) and what the saved state holds."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from ckpt_helpers import assert_resumed as _assert_resumed
from ckpt_helpers import assert_same_params as _assert_same_params
from ckpt_helpers import resume_config, run_fresh, run_phase
from engine_dist import run_two_ranks
from engine_helpers import full_params, make_model

from tierzero import engine
from tierzero.engine.checkpoint.layout import GroupLayout, RankFiles, load_manifest, resolve


@pytest.mark.multiproc
def test_resume_world1_fp16_fresh_process(tmp_path: Path) -> None:
    """fp16: the dynamic loss scale (and its skipped steps) is part of the state."""
    n, m = 4, 6
    ckpt = str(tmp_path / "ckpt")
    common = {"precision": "fp16", "gas": 1, "ckpt": ckpt}
    full = run_fresh(tmp_path, "full", partial(run_phase, 0, stop=n + m, save_at=n, **common))
    resumed = run_fresh(tmp_path, "resumed",
                        partial(run_phase, 0, stop=n + m, load=True, **common))
    _assert_resumed(full, resumed, n)
    assert full["counters"][2] > 0  # fp16 skipped some steps: the scaler state mattered


@pytest.mark.multiproc
def test_resume_world2_mid_accumulation_then_reshard_to_world1(tmp_path: Path) -> None:
    """Two ranks, bf16, 2 micro-steps per step, saved after micro-step 3 (a half-accumulated
    gradient is saved too), in the background while training goes on. Then the same
    checkpoint loads into one rank: resharded."""
    n, m = 3, 6
    ckpt = str(tmp_path / "ckpt")
    common = {"precision": "bf16", "gas": 2, "ckpt": ckpt}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    full = run_two_ranks(tmp_path / "a", {  # saved in the background, from a snapshot
        "run": partial(run_phase, stop=n + m, save_at=n, background=True, **common)})
    resumed = run_two_ranks(tmp_path / "b", {
        "run": partial(run_phase, stop=n + m, load=True, **common)})
    for r in range(2):
        _assert_resumed(full[r]["run"], resumed[r]["run"], n)
    path = resolve(ckpt, None)
    assert any(":grad" in k for k in RankFiles(path, 2).names(0))
    # consolidated from two ranks' shards: the gathered bf16 parameters, exactly
    sd = engine.consolidate(ckpt)
    at_save = full[0]["run"]["params_at_save"]
    assert all(torch.equal(sd[k].to(torch.bfloat16).float(), at_save[k]) for k in at_save)

    # world size 2 -> 1: every parameter and optimizer element lands where it belongs
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=resume_config("bf16", 2),
                                     device="cpu")
    eng.load_checkpoint(ckpt)
    _assert_same_params(full_params(eng, model), full[0]["run"]["params_at_save"])
    assert eng.micro_steps == n and eng.global_steps == 1
    saved = RankFiles(path, 2)
    manifest = load_manifest(path)
    for g in manifest["groups"]:
        if not g["trainable"]:
            continue
        numel = g["numel"]
        lay = GroupLayout.from_json(g)
        for kind in ("master", "exp_avg", "exp_avg_sq", "grad"):
            want = saved.read_range(lay, kind, 0, numel)
            got = eng.store.tensor(g["key"], kind)[:numel]  # type: ignore[arg-type]
            assert torch.equal(got, want), (g["key"], kind)
    step = eng.optimizer.state[eng.store.tensor(manifest["groups"][0]["key"], "master")]["step"]
    assert float(step) == 1.0
    eng.close()
