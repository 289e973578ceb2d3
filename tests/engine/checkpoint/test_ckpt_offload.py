"""Checkpoints of offloaded state (offload cpu / nvme / params on nvme / auto): exact resume,
the same file format as offload none (a checkpoint loads under any offload config), faults.

Exact resume is bit for bit (torch.equal): the same kernels see the same bytes. Across
offload configs the optimizer differs (torch's fused AdamW with offload none, the engine's
CPU Adam otherwise), so only the loaded *state* is compared exactly; continued training is
compared with engine_helpers.PARAM_ATOL (1e-5; the CPU Adam differs from torch's AdamW by
about one ulp per update, see tests/engine/test_engine_offload.py).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import assert_resumed, resume_config, run_fresh, run_phase
from engine_dist import run_two_ranks
from engine_helpers import PARAM_ATOL, full_params, make_batches, make_model, stream_of

from tierzero import engine
from tierzero.engine.checkpoint.layout import RankFiles, load_manifest, rank_file, resolve
from tierzero.engine.step.offloaded_adam import OffloadedAdam


@pytest.mark.multiproc
def test_resume_nvme_fp16_fresh_process(tmp_path: Path) -> None:
    """NVMe offload, fp16 (loss scaler skips steps): save in one process, resume in another.
    background=True: the save keeps the state's swap regions and writes them while the
    following steps run ([Note: background save])."""
    n, m = 4, 6
    common = {"precision": "fp16", "gas": 1, "ckpt": str(tmp_path / "ckpt"),
              "offload": "nvme"}
    full = run_fresh(tmp_path, "full", partial(run_phase, 0, stop=n + m, save_at=n,
                                               background=True, swap=str(tmp_path / "s1"),
                                               **common))
    resumed = run_fresh(tmp_path, "resumed", partial(run_phase, 0, stop=n + m, load=True,
                                                     swap=str(tmp_path / "s2"), **common))
    assert_resumed(full, resumed, n)
    assert full["counters"][2] > 0  # fp16 skipped some steps: the scaler state mattered


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_resume_mid_accumulation_bf16(offload: str, tmp_path: Path) -> None:
    """bf16, 2 micro-steps per step, saved after micro-step 3: the half-accumulated fp32
    gradient (homed in host memory for both) is part of the checkpoint."""
    n, m = 3, 7
    common = {"precision": "bf16", "gas": 2, "ckpt": str(tmp_path / "ckpt"),
              "offload": offload}
    full = run_phase(0, stop=n + m, save_at=n, swap=str(tmp_path / "s1"), **common)
    resumed = run_phase(0, stop=n + m, load=True, swap=str(tmp_path / "s2"), **common)
    assert_resumed(full, resumed, n)
    assert any(k.endswith("::grad") for k in RankFiles(resolve(tmp_path / "ckpt", None),
                                                        1).names(0))


@pytest.mark.multiproc
def test_resume_world2_nvme_then_world1_cpu(tmp_path: Path) -> None:
    """Two ranks on NVMe save; two fresh ranks resume exactly; one rank with offload cpu
    loads the same checkpoint resharded, every element where it belongs."""
    n, m = 4, 4
    common = {"precision": "fp32", "gas": 1, "ckpt": str(tmp_path / "ckpt"),
              "offload": "nvme"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    full = run_two_ranks(tmp_path / "a", {"run": partial(
        run_phase, stop=n + m, save_at=n, swap=str(tmp_path / "s1"), **common)})
    resumed = run_two_ranks(tmp_path / "b", {"run": partial(
        run_phase, stop=n + m, load=True, swap=str(tmp_path / "s2"), **common)})
    for r in range(2):
        assert_resumed(full[r]["run"], resumed[r]["run"], n)
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=resume_config("fp32", 1, "cpu"),
                                     device="cpu")
    try:
        eng.load_checkpoint(tmp_path / "ckpt")
        at_save = full[0]["run"]["params_at_save"]
        got = full_params(eng, model)
        assert all(torch.equal(got[k], at_save[k]) for k in at_save)
        assert isinstance(eng.optimizer, OffloadedAdam) and eng.optimizer.steps == n
    finally:
        eng.close()


def _engine(offload: str, swap: Path) -> tuple[engine.ZeroEngine, torch.nn.Module]:
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=resume_config(
        "fp32", 1, offload, str(swap) if offload != "none" else None), device="cpu")
    return eng, model


def _train(eng: engine.ZeroEngine, start: int, stop: int) -> None:
    batches = make_batches(stop)
    for ids, tg in batches[start:stop]:
        eng.backward(eng(ids, tg))
        eng.step()


def _saved_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    files = RankFiles(path, 1)
    try:
        tensors = {n: files.tensor(0, n) for n in files.names(0)}
        meta = json.loads(files.handle(0).metadata()["tierzero"])
    finally:
        files.close()
    return tensors, meta, load_manifest(path)["engine"]


@pytest.mark.parametrize(("src", "dst"), [("none", "nvme"), ("nvme", "none"),
                                          ("cpu", "nvme"), ("none", "params_nvme"),
                                          ("nvme", "auto")])
def test_checkpoint_loads_under_another_offload_config(src: str, dst: str,
                                                       tmp_path: Path) -> None:
    """Saved under `src`, loaded under `dst` and saved again at once: every tensor (shards,
    RNG), the optimizer step, schedule, counters and scaler come back identical. Then both
    train on: the same parameters within PARAM_ATOL (different Adam kernels)."""
    n, m = 4, 3
    a, model_a = _engine(src, tmp_path / "sa")
    b, model_b = _engine(dst, tmp_path / "sb")
    try:
        _train(a, 0, n)
        path_a = a.save_checkpoint(tmp_path / "ck", tag="a")
        b.load_checkpoint(tmp_path / "ck", tag="a")
        path_b = b.save_checkpoint(tmp_path / "ck", tag="b")
        assert isinstance(path_a, Path) and isinstance(path_b, Path)
        ta, meta_a, eng_a = _saved_state(path_a)
        tb, meta_b, eng_b = _saved_state(path_b)
        assert ta.keys() == tb.keys()
        assert not [k for k in ta if not torch.equal(ta[k], tb[k])]
        assert meta_a == meta_b
        # torch's AdamW has flags (fused, amsgrad, ...) the CPU Adam has not: shared keys
        groups_a, groups_b = eng_a.pop("param_groups"), eng_b.pop("param_groups")
        assert eng_a == eng_b and len(groups_a) == len(groups_b) == 1
        shared = groups_a[0].keys() & groups_b[0].keys()
        assert {"lr", "betas", "eps", "weight_decay"} <= shared
        assert all(groups_a[0][k] == groups_b[0][k] for k in shared)
        assert any(k.endswith("::exp_avg_sq") for k in ta)
        _train(a, n, n + m)
        _train(b, n, n + m)
        pa, pb = full_params(a, model_a), full_params(b, model_b)
        worst = max(float((pa[k] - pb[k]).abs().max()) for k in pa)
        assert worst <= PARAM_ATOL, worst
    finally:
        a.close()
        b.close()


def test_consolidate_nvme_checkpoint_equals_gathered_params(tmp_path: Path) -> None:
    eng, model = _engine("nvme", tmp_path / "swap")
    try:
        _train(eng, 0, 3)
        eng.save_checkpoint(tmp_path / "ck")
        want = full_params(eng, model)
    finally:
        eng.close()
    sd = engine.consolidate(tmp_path / "ck")
    assert all(torch.equal(sd[k], want[k]) for k in want)


@pytest.mark.parametrize("fault", ["truncate", "flip"])
def test_damaged_rank_file_is_named_and_nothing_changes(fault: str, tmp_path: Path) -> None:
    eng, model = _engine("nvme", tmp_path / "swap")
    try:
        _train(eng, 0, 2)
        path = eng.save_checkpoint(tmp_path / "ck")
        assert isinstance(path, Path)
        _train(eng, 2, 4)
        before = full_params(eng, model)
        file = path / rank_file(0)
        data = bytearray(file.read_bytes())
        if fault == "truncate":
            data = data[: len(data) - 100]
        else:
            data[len(data) // 2] ^= 0x40  # inside the shard data, past the header
        file.write_bytes(bytes(data))
        what = "truncated" if fault == "truncate" else "corrupted"
        with pytest.raises(engine.CheckpointError, match=rf"{file}.*{what}"):
            eng.load_checkpoint(tmp_path / "ck")
        after = full_params(eng, model)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert eng.global_steps == 4
    finally:
        eng.close()


def test_load_into_a_running_engine_drops_its_caches(tmp_path: Path) -> None:
    """Loading into an NVMe engine that kept training (device caches of param, a recorded
    prefetch order, dirty host caches) continues exactly like a fresh engine loading it."""
    eng, model = _engine("nvme", tmp_path / "sa")
    fresh, fresh_model = _engine("nvme", tmp_path / "sb")
    try:
        _train(eng, 0, 3)
        eng.save_checkpoint(tmp_path / "ck", tag="t")
        _train(eng, 3, 6)
        assert stream_of(eng) is not None
        # step 6's update, deferred into the next forward (clipping, overlap_step: [Note:
        # deferred streamed step]), runs now, not inside the load that would drain it
        eng.step_driver.drain()
        stream_of(eng).wait_idle()  # the next step's read-ahead lands before counting
        read0 = eng.memory_report()["tiers"]["moved"]["nvme_to_host"]
        eng.load_checkpoint(tmp_path / "ck", tag="t")
        # Every shard is replaced from the checkpoint, so its old bytes are not read from
        # NVMe (TierManager.fetch discard). What is read is master shards the small pool
        # evicted before param is rounded from them; reading the old state too would be
        # at least every NVMe-homed byte (param, master, exp_avg, exp_avg_sq).
        read = eng.memory_report()["tiers"]["moved"]["nvme_to_host"] - read0
        nb = eng.store.nbytes()
        on_nvme = sum(nb[k] for k in ("param", "master", "exp_avg", "exp_avg_sq"))
        assert read < on_nvme // 4, (read, on_nvme)
        fresh.load_checkpoint(tmp_path / "ck", tag="t")
        _train(eng, 3, 6)
        _train(fresh, 3, 6)
        a, b = full_params(eng, model), full_params(fresh, fresh_model)
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert eng.global_steps == fresh.global_steps == 6
    finally:
        eng.close()
        fresh.close()
