"""The streamed step (optimizer state on NVMe) deferred into the next forward ([Note: deferred
streamed step] in engine/step/deferred_stream.py).

With clipping or fp16 and offload.optimizer.overlap_step, step() hands the update to a
worker that runs it during the next forward, each unit's groups before its gather. The
results must be those of the update in step(): bit for bit the run that measures during
backward and updates in step() (the driver's MEASURE mode, today's step for this config
before the deferral) and the run with overlap_step off, over steps where clipping fires
and steps where it does not, an fp16 overflow skipping a step, and compressed moments;
and plain PyTorch's (clip_grad_norm_ + AdamW, GradScaler) within the parity tolerances.
What reads or writes shards between steps waits; a background save does not; a failure
is raised naming the group and loses no committed checkpoint. Slow updates are made by
an injected sleep, never by timing.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_bg_helpers import StreamHold, bg_run, saved_tensors
from engine_dist import run_two_ranks
from engine_helpers import (
    FP16_OVERFLOW_STEP,
    assert_match,
    fp16_overlap_runs,
    full_params,
    make_batches,
    make_config,
    make_model,
    offload_config,
)
from engine_helpers import (
    streamed_runner as runner,
)
from test_deferred_step import assert_within_fp16_noise, grad_scaler_train

from tierzero import engine
from tierzero.engine.checkpoint.layout import LATEST, CheckpointError, load_manifest
from tierzero.engine.config import Config
from tierzero.engine.config.schema import LossScaleConfig, PrecisionConfig
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.step.offloaded import OffloadedStep, StepMode
from tierzero.offload.adam_stream import AdamStream

# loss multipliers: the gradient norm is about 1.5 at x1 and 0.75 at x0.5, so clipping at
# 1.0 fires on the x1 steps and not on the others
SCALES = (1.0, 0.5, 1.0, 0.5, 1.0)
MODES = {"defer": None, "measure": StepMode.MEASURE}  # forced driver modes (None: chosen)


def nvme_cfg(path: Path, *, overlap: bool = True, clip: float = 1.0, fp16: bool = False,
             state: str = "fp32", chunk: int | None = None, grads: str = "auto") -> Config:
    """Params and optimizer state on NVMe (the streamed CPU Adam), swap files in `path`;
    `grads`: offload.optimizer.grad_device (auto: NVMe here; cpu: the default run's)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = offload_config(make_config(clip=clip), "nvme", path)
    opt = dataclasses.replace(cfg.offload.optimizer, overlap_step=overlap,  # type: ignore[arg-type]
                              state_precision=state, grad_device=grads)
    if chunk is not None:  # master and moments in pieces: [Note: optimizer state in chunks]
        opt = dataclasses.replace(opt, chunk_numel=chunk)
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, optimizer=opt))
    if fp16:  # dynamic scaling from 2**8, growth every 2 good steps
        ls = LossScaleConfig(initial_scale_power=8, growth_interval=2, hysteresis=1)
        cfg = dataclasses.replace(cfg, precision=PrecisionConfig(dtype="fp16", loss_scale=ls))
    return cfg


def train(cfg: Config, batches: list[tuple[torch.Tensor, torch.Tensor]],
          scales: tuple[float, ...], mode: StepMode | None = None) -> dict[str, Any]:
    """One step per batch, its loss times `scales[i]`; `mode` forces the driver's mode.
    Returns losses, clip coefficients, whether each step() returned with the update
    pending, the parameters and the memory report."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
    driver = eng.step_driver
    assert isinstance(driver, OffloadedStep)
    if mode is not None:
        driver.mode = mode
    out: dict[str, Any] = {"mode": driver.mode, "losses": [], "coefs": [], "pending": []}
    try:
        for (ids, tg), scale in zip(batches, scales, strict=True):
            loss = eng(ids, tg)
            eng.backward(loss * scale)
            eng.step()
            out["losses"].append(float(loss.detach()))
            out["coefs"].append(eng.get_clip_coef())
            out["pending"].append(runner(eng).deferred)
        out["params"] = full_params(eng, eng.module)
        out["report"] = eng.memory_report()
    finally:
        eng.close()
    return out


def reference(batches: list[tuple[torch.Tensor, torch.Tensor]], scales: tuple[float, ...],
              clip: float, device: str = "cpu") -> dict[str, Any]:
    """Plain PyTorch on `device`: AdamW on fp32 parameters, clip_grad_norm_ before each
    step. The parameters come back as CPU copies."""
    model = make_model().to(device)
    o = make_config().optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay)
    losses, norms = [], []
    for (ids, tg), scale in zip(batches, scales, strict=True):
        loss = model(ids.to(device), tg.to(device))
        (loss * scale).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms,
            "params": {k: v.detach().to("cpu", copy=True) for k, v in model.named_parameters()}}


def same_checkpoints(a: Path, b: Path, *, micro_steps: int = 0) -> None:
    """The same state; `micro_steps`: backward passes b ran past a (a step that failed
    after its backward)."""
    ma, mb = load_manifest(a), load_manifest(b)
    ma["engine"]["counters"]["micro_steps"] += micro_steps
    assert ma["engine"] == mb["engine"] and ma["groups"] == mb["groups"]
    ta, tb = saved_tensors(a, 0), saved_tensors(b, 0)
    assert ta.keys() == tb.keys()
    bad = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not bad, bad


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"] and a["coefs"] == b["coefs"]
    bad = [k for k in b["params"] if not torch.equal(a["params"][k], b["params"][k])]
    assert not bad, bad


@pytest.mark.parametrize(("chunk", "grads"), [(None, "auto"), (1024, "cpu")])
def test_deferred_step_is_bit_identical_and_matches_pytorch(tmp_path: Path,
                                                            chunk: int | None,
                                                            grads: str) -> None:
    """Clipping fires on some steps and not on others; deferred, measured-then-updated in
    step() and overlap off give the same bits; the deferred run matches PyTorch. `chunk`:
    every group's state in several pieces, its param assembled whole; `grads`: where the
    gradients wait for the next forward (NVMe, or host memory as in the default run)."""
    batches = make_batches(len(SCALES))
    runs = {name: train(nvme_cfg(tmp_path / name, chunk=chunk, grads=grads), batches,
                        SCALES, mode) for name, mode in MODES.items()}
    runs["off"] = train(nvme_cfg(tmp_path / "off", overlap=False, chunk=chunk, grads=grads),
                        batches, SCALES)
    defer = runs["defer"]
    assert defer["mode"] is StepMode.DEFER and all(defer["pending"])
    assert not any(runs["measure"]["pending"]) and runs["off"]["mode"] is not StepMode.DEFER
    fired = [c < 1.0 for c in defer["coefs"]]
    assert fired == [s == 1.0 for s in SCALES], defer["coefs"]  # fires, and not
    for name in ("measure", "off"):
        assert_same(defer, runs[name])
    ref = reference(batches, SCALES, 1.0)
    assert_match(defer["losses"], defer["params"], ref["losses"], ref["params"])
    assert defer["report"]["tiers"]["order_mismatches"] == 0


def test_layer_major_accumulation_deferred_is_bit_identical(tmp_path: Path) -> None:
    """Two micro-batches per step through train_batch (batch.schedule auto: layer-major with
    offload): the deferred update runs in the next pass's forward, each unit waited for by
    the micro-batch threads that gather it; the same bits as overlap off."""
    batches = make_batches(6)
    out = {}
    for overlap in (True, False):
        cfg = nvme_cfg(tmp_path / str(overlap), overlap=overlap, grads="cpu")
        cfg = dataclasses.replace(cfg, batch=dataclasses.replace(
            cfg.batch, gradient_accumulation_steps=2))
        eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
        try:
            assert eng.schedule == "layer_major"
            losses = []
            for s in range(3):
                got = eng.train_batch(batches[2 * s:2 * s + 2], lambda mb, e=eng: e(*mb))
                losses += [float(x) for x in got]
                assert runner(eng).deferred == overlap
            out[overlap] = (losses, full_params(eng, eng.module))
        finally:
            eng.close()
    assert out[True][0] == out[False][0]
    assert all(torch.equal(out[True][1][k], v) for k, v in out[False][1].items())


@pytest.mark.parametrize("state", ["bf16", "int8"])
def test_compressed_moments_deferred_are_bit_identical(tmp_path: Path, state: str) -> None:
    batches = make_batches(len(SCALES))
    runs = {name: train(nvme_cfg(tmp_path / name, state=state), batches, SCALES, mode)
            for name, mode in MODES.items()}
    assert all(runs["defer"]["pending"])
    assert_same(runs["defer"], runs["measure"])


def test_fp16_deferred_skips_the_overflow_step_like_grad_scaler(tmp_path: Path) -> None:
    """fp16 loss scaling, an overflow skipping a step mid-run: deferred and overlap off
    give the same skip, scales and bits (fp16_overlap_runs); the scales and the skip are
    torch.amp.GradScaler's, the parameters within fp16 noise of it."""
    scales, skipped, params = fp16_overlap_runs(
        lambda overlap: nvme_cfg(tmp_path / str(overlap), overlap=overlap, fp16=True), 6)
    want_params, want_scales, want_skips = grad_scaler_train(make_batches(6),
                                                             FP16_OVERFLOW_STEP, 1.0)
    assert scales == want_scales and skipped == want_skips == 1
    assert_within_fp16_noise(params, want_params)


# -- the update during the next forward --------------------------------------------------
@pytest.fixture
def slow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ZeroEngine]:
    """Clipping 1.0, state on NVMe, gradients in host memory (as in the default run); the
    deferred update's worker takes 50 ms more per group: step() returns with it still
    running."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=nvme_cfg(tmp_path / "swap", grads="cpu"))
    stream = runner(eng).stream
    real = stream.mark_final

    def slowed(indices: Any) -> None:
        if threading.current_thread().name.startswith("tierzero-adam-deferred"):
            time.sleep(0.05)
        real(indices)

    monkeypatch.setattr(stream, "mark_final", slowed)
    try:
        yield eng
    finally:
        eng.close()


def _one_step(eng: ZeroEngine, seed: int = 1, hold: StreamHold | None = None) -> None:
    """One step; `hold`: the update it defers is held (set after backward, which waited
    for the updates of the steps before)."""
    ids, tg = make_batches(1, seed=seed)[0]
    eng.backward(eng(ids, tg))
    if hold is not None:
        hold.holding.set()
    eng.step()


def _after(steps: int, path: Path) -> dict[str, torch.Tensor]:
    """The parameters after `steps` steps of seeds 1.., the update in step() (overlap off)."""
    batches = [make_batches(1, seed=s)[0] for s in range(1, steps + 1)]
    return train(nvme_cfg(path, overlap=False, grads="cpu"), batches, (1.0,) * steps)["params"]


def test_each_unit_waits_for_its_own_groups_and_gathers_its_new_param_from_host(
        slow: ZeroEngine, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    eng = slow
    _one_step(eng)
    _one_step(eng, seed=2)  # the step order and caches settled
    step = runner(eng)
    deferred = step._deferred
    assert step.deferred and deferred._done < len(deferred._order)  # still running
    seen: list[tuple[str, bool]] = []  # (unit, its groups ended) right after its gather
    real_gather = eng.scheduler.ensure_gathered

    def spy_gather(unit: Any) -> None:
        real_gather(unit)
        keys = [g.key for g in unit.groups if g.trainable]
        seen.append((unit.label, not deferred._order  # every group's update has ended
                     or all(deferred._pos[k] < deferred._done for k in keys)))

    monkeypatch.setattr(eng.scheduler, "ensure_gathered", spy_gather)
    tiers0 = eng.memory_report()["tiers"]["moved_by_class"]["nvme_to_host"]
    ids, tg = make_batches(1, seed=3)[0]
    loss = eng(ids, tg)
    tiers1 = eng.memory_report()["tiers"]["moved_by_class"]["nvme_to_host"]
    assert len(seen) == len(eng.units) and all(done for _, done in seen), seen
    # every param was gathered from the host cache its update left (no NVMe read back)
    assert tiers1.get("param", 0) == tiers0.get("param", 0)
    eng.backward(loss)
    eng.step()
    monkeypatch.setattr(eng.scheduler, "ensure_gathered", real_gather)
    busy, hidden = step.worker_times()
    assert busy > 0.0 and 0.0 <= hidden <= busy
    got = full_params(eng, eng.module)
    for k, v in _after(3, tmp_path / "ref").items():
        assert torch.equal(got[k], v), k


def test_load_checkpoint_gathered_parameters_state_dict_and_close_wait(
        slow: ZeroEngine, tmp_path: Path) -> None:
    eng = slow
    _one_step(eng)
    assert runner(eng).deferred
    eng.save_checkpoint(tmp_path / "ck", tag="t")  # synchronous: after the update
    assert not runner(eng).deferred
    _one_step(eng, seed=2)
    block = eng.units[1]
    with engine.GatheredParameters(list(block.module.parameters())):
        assert all(runner(eng)._deferred._pos.get(g.key, -1) < runner(eng)._deferred._done
                   or not runner(eng).deferred for g in block.groups)
    _one_step(eng, seed=3)
    assert runner(eng).deferred
    eng.load_checkpoint(tmp_path / "ck", tag="t")  # the pending update ran first
    assert not runner(eng).deferred
    got = full_params(eng, eng.module)
    want1 = _after(1, tmp_path / "ref1")
    assert all(torch.equal(got[k], v) for k, v in want1.items())
    _one_step(eng, seed=2)
    assert runner(eng).deferred
    with engine.GatheredParameters(list(eng.module.parameters())):
        sd = {k: v.detach().clone() for k, v in eng.module.state_dict().items()}  # drained
    assert not runner(eng).deferred
    for k, v in _after(2, tmp_path / "ref2").items():
        assert torch.equal(sd[k].float(), v), k
    _one_step(eng, seed=3)
    assert runner(eng).deferred
    eng.close()  # the update runs to its end; parameters are whole again
    want = _after(3, tmp_path / "ref3")
    for k, p in eng.module.named_parameters():
        assert torch.equal(p.detach().float(), want[k]), k


# -- background saves ([Note: saving a deferred step] in engine/checkpoint/deferred.py) ----
def test_background_save_returns_while_the_deferred_stream_is_held(tmp_path: Path) -> None:
    """The deferred update is held before its first group: save_checkpoint(background=
    True) returns (one that waited for the update would wait for the release), and its
    writer cannot finish before the groups have landed. Released, the checkpoint equals a
    synchronous save at the same step."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=nvme_cfg(tmp_path / "swap", clip=0.5))
    hold = StreamHold(eng)
    try:
        _one_step(eng)
        _one_step(eng, seed=2, hold=hold)
        pending = eng.save_checkpoint(tmp_path / "ck", tag="bg", background=True)
        assert isinstance(pending, engine.PendingSave) and pending.background
        assert hold.ended == [] and hold.step.deferred
        assert not pending.done()
        hold.stop()
        pending.wait()
        assert pending.stats.held_s < 30  # (returned before the release, see above)
        eng.save_checkpoint(tmp_path / "ck", tag="sync")
    finally:
        hold.stop()
        eng.close()
    same_checkpoints(tmp_path / "ck" / "bg", tmp_path / "ck" / "sync")


@pytest.mark.parametrize("gate", [True, False])
def test_background_save_of_a_held_deferred_stream_resumes_exactly(tmp_path: Path,
                                                                  gate: bool) -> None:
    """NVMe offload: saved at step 3 with its deferred update held until the call returned,
    then steps 4-6 (`gate`: the writer waits for them, so their writes replace every kept
    region first): the files equal a synchronous save at step 3, and a resume ends bit for
    bit where the uninterrupted run did; no kept region is left."""
    common = {"offload": "nvme", "n": 3, "m": 3}
    bg = bg_run(0, ckpt=str(tmp_path / "bg"), swap=str(tmp_path / "s1"), background=True,
                gate=gate, hold=True, **common)
    assert bg["fallback"] is None and bg["held_ended"] == [] and bg["held_pending"]
    bg_run(0, ckpt=str(tmp_path / "sync"), swap=str(tmp_path / "s2"), background=False,
           **common)
    same_checkpoints(tmp_path / "bg" / "s", tmp_path / "sync" / "s")
    resumed = bg_run(0, ckpt=str(tmp_path / "bg"), swap=str(tmp_path / "s3"),
                     background=False, load=True, **common)
    bad = [k for k in bg["params"] if not torch.equal(bg["params"][k], resumed["params"][k])]
    assert not bad, bad
    assert bg["swap_after"].kept_regions == 0 and bg["swap_after"].kept_retired_bytes == 0
    if gate:  # the regions the update left were kept while the next steps replaced them
        assert bg["swap_gated"].kept_regions > 0


def test_failed_deferred_group_raises_by_name_and_keeps_the_committed_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel fails on one group of the deferred update while a background save waits
    for it: the save fails naming the group, `latest` still names the checkpoint committed
    before, which loads; the next forward raises naming the group; training goes on."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=nvme_cfg(tmp_path / "swap"))
    hold = StreamHold(eng)
    bad = eng._train_keys[1]
    step = runner(eng)
    bad_piece = step.stream._chunks[step._keys.index(bad)][0].keys["master"]
    real_kernel = AdamStream._update
    failing = threading.Event()

    def kernel(self: Any, bufs: Any, piece: Any, *args: Any) -> float:
        if failing.is_set() and piece.keys["master"] == bad_piece:
            raise OSError("injected kernel failure")
        return real_kernel(self, bufs, piece, *args)

    monkeypatch.setattr(AdamStream, "_update", kernel)
    ck = tmp_path / "ck"
    try:
        _one_step(eng)
        eng.save_checkpoint(ck, tag="good")
        good = full_params(eng, eng.module)
        failing.set()
        _one_step(eng, seed=2, hold=hold)
        pending = eng.save_checkpoint(ck, tag="bg", background=True)
        hold.stop()
        with pytest.raises(CheckpointError, match=f"shard group '{re.escape(bad)}'.*"
                                                  "injected kernel failure"):
            pending.wait()
        assert (ck / LATEST).read_text().strip() == "good"
        assert not (ck / "bg").exists() and not (ck / ".bg.partial").exists()
        ids, tg = make_batches(1)[0]
        with pytest.raises(RuntimeError, match=f"shard group '{re.escape(bad)}'.*injected"):
            eng(ids, tg)
        failing.clear()
        eng.load_checkpoint(ck)  # the committed one
        got = full_params(eng, eng.module)
        assert all(torch.equal(got[k], good[k]) for k in good)
        for seed in (2, 3):  # training goes on
            _one_step(eng, seed)
        eng.step_driver.drain()
    finally:
        hold.stop()
        eng.close()


@pytest.mark.parametrize("fault", [3, 40])
def test_a_failed_write_of_the_deferred_update_is_never_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: int) -> None:
    """One swap write of a deferred update fails (EIO) while the next forward runs it
    (speculation off). Wherever the failure is told (that step, or a later call that
    settles it), a shard whose write was lost is never saved ([Note: a lost write] in
    offload/core.py): a checkpoint after a step that ran through is refused, naming the
    failure, or equals the same run's without the failure (the write went through a host
    cache that kept its data). Where the update itself failed partway, the groups it
    reached keep it ([Note: deferred streamed step]) and the save is refused ([Note: a
    partial step] in engine/step/offloaded.py); a failure told elsewhere (a gather's read,
    a flush) leaves the update whole. The checkpoint from before loads and training goes
    on."""
    from swap_helpers import faulty_swaps

    def config(name: str) -> Config:
        cfg = nvme_cfg(tmp_path / name)
        opt = dataclasses.replace(cfg.offload.optimizer, speculate_step=False)
        return dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, optimizer=opt))

    ref, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=config("ref"))
    try:
        for seed in (1, 2, 3):
            _one_step(ref, seed)
        ref.save_checkpoint(tmp_path / "ck_ref", tag="after")
    finally:
        ref.close()
    ios = faulty_swaps(monkeypatch)
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=config("swap"))
    told: list[Exception] = []

    def reported(fn: Any) -> bool:
        """fn() ran through (True), or raised the injected failure, told once."""
        try:
            fn()
            return True
        except Exception as exc:
            chain, at = [], exc  # the failure or what it caused (a refused read of its shard)
            while at is not None and len(chain) < 8:
                chain.append(f"{type(at).__name__}: {at}")
                at = at.__cause__ or at.__context__
            text = " <- ".join(chain)
            assert any(s in text for s in ("EIO", "Input/output error",
                                           "last write of this shard failed")), text
            told.append(exc)
            return False

    try:
        _one_step(eng, 1)
        eng.save_checkpoint(tmp_path / "ck", tag="before")
        before = full_params(eng, eng.module)
        _one_step(eng, 2)  # its update is deferred into the next forward
        ios[-1].arm("pwrite", 5, after=fault)
        stepped = reported(functools.partial(_one_step, eng, 3))
        if reported(lambda: eng.save_checkpoint(tmp_path / "ck", tag="after")) and stepped:
            same_checkpoints(tmp_path / "ck_ref" / "after", tmp_path / "ck" / "after")
        assert (tmp_path / "ck" / LATEST).read_text().strip() in ("before", "after")
        if not reported(lambda: eng.load_checkpoint(tmp_path / "ck", tag="before")):
            eng.load_checkpoint(tmp_path / "ck", tag="before")  # told late, once
        got = full_params(eng, eng.module)
        assert all(torch.equal(got[k], before[k]) for k in before)
        for seed in (4, 5):  # training goes on
            if not reported(functools.partial(_one_step, eng, seed)):
                eng.zero_grad()
                _one_step(eng, seed)
        eng.step_driver.drain()
        assert len(told) <= 3, told  # the step, the save, one late settle at most
    finally:
        eng.close()


# -- two ranks ----------------------------------------------------------------------------
def _ranks(rank: int, path: str) -> dict[str, Any]:
    batches = make_batches(len(SCALES), seed=1 + rank)
    out = {}
    for name, mode in {**MODES, "off": None}.items():
        cfg = nvme_cfg(Path(path) / f"{name}{rank}", overlap=name != "off")
        run = train(cfg, batches, SCALES, mode)
        run.pop("report")
        out[name] = run
    return out


@pytest.mark.multiproc
def test_two_ranks_deferred_is_bit_identical_and_matches_ddp(tmp_path: Path) -> None:
    (tmp_path / "swap").mkdir()
    r0, r1 = (r["r"] for r in run_two_ranks(
        tmp_path, {"r": functools.partial(_ranks, path=str(tmp_path / "swap"))}))
    for rank in (r0, r1):
        assert all(rank["defer"]["pending"]) and rank["defer"]["mode"] is StepMode.DEFER
        for name in ("measure", "off"):
            assert_same(rank["defer"], rank[name])
    bad = [k for k in r0["defer"]["params"]
           if not torch.equal(r0["defer"]["params"][k], r1["defer"]["params"][k])]
    assert not bad, bad
    per_rank = [make_batches(len(SCALES), seed=1 + r) for r in range(2)]
    model = make_model()
    o = make_config().optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay)
    for i, scale in enumerate(SCALES):  # DDP: the mean over ranks of each rank's gradient
        torch.stack([model(*per_rank[r][i]) for r in range(2)]).mean().mul(scale).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    ref = {k: v.detach() for k, v in model.named_parameters()}
    for k, v in ref.items():
        torch.testing.assert_close(r0["defer"]["params"][k], v, rtol=0.0, atol=1e-5, msg=k)
