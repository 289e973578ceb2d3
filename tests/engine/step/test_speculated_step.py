"""The streamed update speculated into backward ([Note: speculated step] in
engine/step/speculation.py).

With optimizer state on NVMe, clipping or fp16 and overlap_step, the update of a step that
follows an unclipped one runs during backward and step() commits it (the coefficient is
exactly 1) or undoes it and runs the exact update. Every run here is compared bit for bit
with the same run under `offload.optimizer.speculate_step: false` (the deferred step, whose
own parity with plain PyTorch is tested in test_deferred_stream.py), and with PyTorch
itself within engine_helpers' parity tolerances: steps where clipping fires after
speculated ones, an fp16 overflow on a speculated step, compressed moments and a bf16
master, a forward and a checkpoint between backward and step(), a late gradient on a
group the speculation had updated, a failed backward, and two ranks. Which steps were
speculated follows from the policy and the clip pattern, never from timing.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_dist import run_two_ranks
from engine_helpers import (
    assert_match,
    copying_gathers,
    full_params,
    make_batches,
    make_model,
)
from lategrad_helpers import RootSegmentLM, shared_config
from test_deferred_stream import assert_same, nvme_cfg, reference

from tierzero import engine
from tierzero.engine.config import Config
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.step.offloaded import OffloadedStep, StepMode
from tierzero.offload.step_seam import StepState

# loss multipliers: the gradient norm is about 1.5 at x1 and 0.75 at x0.5 (clipping at 1.0
# fires on the x1 steps only). Steps 1-3 are speculated (each after an unclipped step), 3
# is clipped and undone, which doubles the calm needed to 2: 4 and 5 are not speculated,
# 6 and 7 are.
SCALES = (0.5, 0.5, 0.5, 1.0, 0.5, 0.5, 0.5, 0.5)
SPECULATED = [False, True, True, True, False, False, True, True]


def with_speculation(cfg: Config, on: bool) -> Config:
    opt = dataclasses.replace(cfg.offload.optimizer, speculate_step=on)
    return dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, optimizer=opt))


def driver_of(eng: ZeroEngine) -> OffloadedStep:
    driver = eng.step_driver
    assert isinstance(driver, OffloadedStep)
    return driver


def train(cfg: Config, scales: tuple[float, ...], *, model: torch.nn.Module | None = None,
          between: Any = None, seed: int | None = None) -> dict[str, Any]:
    """One step per batch, its loss times `scales[i]`; `between(eng, i)` runs between
    backward and step(). Records per step whether backward speculated the update."""
    model = make_model() if model is None else model
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    driver = driver_of(eng)
    out: dict[str, Any] = {"losses": [], "coefs": [], "speculated": [], "updates": []}
    try:
        batches = (make_batches(len(scales)) if seed is None
                   else make_batches(len(scales), seed=seed))
        for i, ((ids, tg), scale) in enumerate(zip(batches, scales, strict=True)):
            loss = eng(ids, tg)
            eng.backward(loss * scale)
            out["speculated"].append(driver.state is StepState.SPECULATING)
            if between is not None:
                between(eng, i)
            eng.step()
            out["losses"].append(float(loss.detach()))
            out["coefs"].append(eng.get_clip_coef())
            out["updates"].append(driver.last_update)
        out["params"] = full_params(eng, model)
        out["param_read"] = eng.memory_report()["tiers"]["moved_by_class"]["nvme_to_host"][
            "param"]
        out["stats"] = driver.stats()
        out["skipped"] = eng.skipped_steps
        out["mode"] = driver.mode
    finally:
        eng.close()
    return out


def two_calm_steps(cfg: Config, model: torch.nn.Module, n: int
                   ) -> tuple[ZeroEngine, OffloadedStep, list[Any]]:
    """An engine over `model` after two unclipped steps (the next one is speculated) and
    the `n` batches they began."""
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    batches = make_batches(n)
    try:
        for ids, tg in batches[:2]:
            eng.backward(eng(ids, tg) * 0.5)
            eng.step()
    except BaseException:
        eng.close()
        raise
    return eng, driver_of(eng), batches


def pair(cfg_of: Any, scales: tuple[float, ...] = SCALES, **kw: Any
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run speculating and the same run with speculate_step off; asserted alike."""
    on = train(with_speculation(cfg_of("on"), True), scales, **kw)
    off = train(with_speculation(cfg_of("off"), False), scales, **kw)
    assert on["mode"] is StepMode.DEFER and not any(off["speculated"])
    assert_same(on, off)
    assert on["skipped"] == off["skipped"]
    return on, off


@pytest.mark.parametrize(("chunk", "grads"), [(None, "auto"), (1024, "cpu")])
def test_speculated_steps_commit_or_undo_bit_identical_to_the_deferred_step(
        tmp_path: Path, chunk: int | None, grads: str) -> None:
    """`chunk`: the state in several pieces per group; `grads`: gradients homed on NVMe
    (written down after their speculated use) or in host memory."""
    on, _ = pair(lambda name: nvme_cfg(tmp_path / name, chunk=chunk, grads=grads))
    assert on["speculated"] == SPECULATED
    assert on["updates"] == ["deferred", "speculated", "speculated", "undone", "deferred",
                             "deferred", "speculated", "speculated"]
    assert [c < 1.0 for c in on["coefs"]] == [s == 1.0 for s in SCALES], on["coefs"]
    assert on["stats"]["speculated_steps"] == 5 and on["stats"]["undone_steps"] == 1
    ref = reference(make_batches(len(SCALES)), SCALES, 1.0)
    assert_match(on["losses"], on["params"], ref["losses"], ref["params"])


@pytest.mark.parametrize("state", ["bf16", "int8"])
def test_compressed_moments_speculated_are_bit_identical(tmp_path: Path, state: str) -> None:
    on, _ = pair(lambda name: nvme_cfg(tmp_path / name, state=state))
    assert on["speculated"] == SPECULATED


def test_bf16_master_with_int8_moments_speculated_is_bit_identical(tmp_path: Path) -> None:
    """The bf16 master is the param: a speculated update writes the param the next forward
    gathers, and an undo must bring the old one back (its stochastic rounding is seeded by
    the step, so the exact update after the undo rounds as the deferred one does)."""
    from test_engine_bf16_master import configure

    on, _ = pair(lambda name: configure("nvme", tmp_path / name, state="int8", clip=1.0))
    assert any(on["speculated"]) and on["stats"]["undone_steps"] >= 1


def test_fp16_overflow_on_a_speculated_step_is_skipped_exactly(tmp_path: Path) -> None:
    """fp16 loss scaling: step 3's loss overflows while its update is speculated; the undo
    and the skip leave the same scales, skip and bits as the deferred run."""
    scales = (0.5, 0.5, 0.5, 1e9, 0.5, 0.5)
    on, _ = pair(lambda name: nvme_cfg(tmp_path / name, fp16=True), scales)
    assert on["speculated"][3] and on["skipped"] == 1
    assert on["coefs"][3] is None and on["updates"][3] is None  # skipped: no update
    assert on["stats"]["undone_steps"] == 1


def test_forward_and_checkpoint_between_backward_and_step_undo_it(tmp_path: Path) -> None:
    """A forward (an evaluation) reads the params and a checkpoint the state: each undoes
    the speculated update first, the step() after runs the exact one; the checkpoint holds
    the state from before the step, as the deferred run's does."""
    saved: dict[str, Path] = {}

    def between(eng: ZeroEngine, i: int) -> None:
        name = eng.config.offload.optimizer.speculate_step
        if i == 2:
            with torch.no_grad():
                ids, tg = make_batches(1, seed=9)[0]
                eng(ids, tg)
        if i == 6:
            saved[str(name)] = tmp_path / f"ckpt-{name}"
            eng.save_checkpoint(saved[str(name)], tag="mid")

    on, _ = pair(lambda name: nvme_cfg(tmp_path / name), between=between)
    assert on["speculated"] == SPECULATED
    assert on["stats"]["undone_steps"] == 3  # the forward's, the clip's, the save's
    from test_deferred_stream import same_checkpoints

    same_checkpoints(saved["True"] / "mid", saved["False"] / "mid")


def test_late_gradient_on_a_speculated_group_undoes_it(tmp_path: Path) -> None:
    """The root's reentrant segment fires its embedding's gradient after the root's group
    was handed over (the forward does not announce it): the speculated update of that
    group used part of its gradient, so step() undoes the speculation and the exact update
    runs. The first step is speculated here (the policy starts calm) to meet it."""
    def run(on: bool) -> tuple[list[float], dict[str, torch.Tensor], int]:
        (tmp_path / str(on)).mkdir()
        cfg = with_speculation(shared_config(clip=0.5, offload="nvme", path=tmp_path / str(on),
                                             overlap_step=True), on)
        torch.manual_seed(0)  # before the model: both runs start from the same weights
        model = RootSegmentLM(4)
        eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
        driver = driver_of(eng)
        driver.policy.calm = driver.policy.calm_needed  # speculate from the first step
        losses = []
        try:
            for ids, tg in make_batches(3):
                loss = eng(ids, tg)
                eng.backward(loss)
                eng.step()
                losses.append(float(loss.detach()))
            return losses, full_params(eng, model), driver.policy.undone
        finally:
            eng.close()

    l_on, p_on, undone = run(True)
    l_off, p_off, _ = run(False)
    assert undone >= 1 and l_on == l_off
    assert all(torch.equal(p_on[k], v) for k, v in p_off.items())


def test_failed_backward_undoes_the_speculated_update(tmp_path: Path) -> None:
    """Backward fails after the speculation has updated groups: they are undone, and the
    step() that follows runs the exact update from the gradients reduced so far (as the
    measuring step does), the same bits as with speculation off."""
    def run(on: bool) -> dict[str, torch.Tensor]:
        model = make_model()
        eng, driver, batches = two_calm_steps(with_speculation(nvme_cfg(tmp_path / str(on)),
                                                               on), model, 4)
        try:
            blocks = [m for m in model.modules() if m.__class__.__name__ == "Block"]

            def boom(*_: Any) -> None:
                raise RuntimeError("injected backward failure")

            # the first block's backward runs last: the later blocks were updated by then
            handle = blocks[0].register_full_backward_hook(boom)
            ids, tg = batches[2]
            loss = eng(ids, tg) * 0.5
            with pytest.raises(RuntimeError, match="injected"):
                eng.backward(loss)
            handle.remove()
            assert driver.state is not StepState.SPECULATING
            if on:
                assert driver.policy.speculated == 2 and driver.policy.undone == 1
            eng.step()
            ids, tg = batches[3]
            eng.backward(eng(ids, tg) * 0.5)
            eng.step()
            return full_params(eng, model)
        finally:
            eng.close()

    on, off = run(True), run(False)
    assert all(torch.equal(on[k], v) for k, v in off.items())


def _ranks(rank: int, path: str) -> dict[str, Any]:
    out = {}
    for on in (True, False):
        run = train(with_speculation(nvme_cfg(Path(path) / f"{on}{rank}"), on), SCALES,
                    seed=1 + rank)
        out[str(on)] = {k: run[k] for k in ("speculated", "params", "losses", "coefs")}
    return out


@pytest.mark.multiproc
def test_two_ranks_speculate_alike_and_match_the_deferred_step(tmp_path: Path) -> None:
    """Each rank speculates and undoes on the same steps (the all-reduced norm decides),
    with the same bits as speculation off; the ranks' params agree."""
    (tmp_path / "swap").mkdir()
    r0, r1 = (r["r"] for r in run_two_ranks(
        tmp_path, {"r": functools.partial(_ranks, path=str(tmp_path / "swap"))}))
    for rank in (r0, r1):
        assert_same(rank["True"], rank["False"])
        assert not any(rank["False"]["speculated"])
    assert r0["True"]["speculated"] == r1["True"]["speculated"]
    assert sum(r0["True"]["speculated"]) >= 3
    bad = [k for k, v in r0["True"]["params"].items()
           if not torch.equal(v, r1["True"]["params"][k])]
    assert not bad, bad


def test_layer_major_accumulation_speculated_is_bit_identical(tmp_path: Path) -> None:
    """Two micro-batches per step through train_batch (layer-major): the boundary's
    backward speculates the update; clipping at 100 never fires, so every step after
    the first commits; the same bits as speculation off."""
    batches = make_batches(8)
    out = {}
    for on in (True, False):
        cfg = with_speculation(nvme_cfg(tmp_path / str(on), clip=100.0), on)
        cfg = dataclasses.replace(cfg, batch=dataclasses.replace(
            cfg.batch, gradient_accumulation_steps=2))
        eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
        try:
            assert eng.schedule == "layer_major"
            losses, updates = [], []
            for s in range(4):
                got = eng.train_batch(batches[2 * s:2 * s + 2], lambda mb, e=eng: e(*mb))
                losses += [float(x) for x in got]
                updates.append(driver_of(eng).last_update)
            out[on] = (losses, full_params(eng, eng.module), updates)
        finally:
            eng.close()
    assert out[True][2] == ["deferred"] + ["speculated"] * 3
    assert out[False][2] == ["deferred"] * 4
    assert out[True][0] == out[False][0]
    assert all(torch.equal(out[True][1][k], v) for k, v in out[False][1].items())


@pytest.mark.parametrize("fault", [3, 40, "last"])
def test_a_failed_write_of_the_speculated_update_is_undone_or_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: int | str) -> None:
    """One swap write of the third step fails (EIO) while its speculated update writes
    the groups. `fault`: blocks written before the failure (the first group, groups
    later), or all but the step's last (a write nothing waits for before step() commits:
    the update's last writes overlap the next forward).

    - Seen before the commit (the update waits for room its writes hold, and for writes
      it finds landed): backward or step() raises it, naming the file; every group holds
      its state from before the step (the undo restores what was written, the failed
      write left the old region: a checkpoint after it equals one before the step),
      nothing stays kept, and training goes on.
    - Seen after: the step stands, and the failed shard is not read again ([Note: a lost
      write] in offload/core.py): a checkpoint after it is refused, naming the failure,
      unless the write went through a host cache that still holds it (then the checkpoint
      equals the same run's without the failure). The checkpoint from before loads, and
      training goes on from it.

    Which of the two happens for a given `fault` depends on the timing; each is checked
    whenever it happens. A failure is raised once, to whoever waits for it or settles it
    first: one that nobody waited for (its data kept by a host cache) may be told late,
    by a later step."""
    from swap_helpers import faulty_swaps

    ios = faulty_swaps(monkeypatch)
    model = make_model()
    cfg = nvme_cfg(tmp_path / "swap")
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    driver = driver_of(eng)
    batches = make_batches(5)
    try:
        for i, (ids, tg) in enumerate(batches[:2]):  # the second step is speculated
            loss = eng(ids, tg) * 0.5
            calls = ios[-1].calls["pwrite"]
            eng.backward(loss)
            eng.step()
            per_step = ios[-1].calls["pwrite"] - calls
            assert driver.last_update == ("deferred" if i == 0 else "speculated")
        driver.flush()  # the second step's writes have landed: the fault hits the third's
        before = full_params(eng, model)
        eng.save_checkpoint(tmp_path / "ck", tag="before")
        ids, tg = batches[2]
        loss = eng(ids, tg) * 0.5
        ios[-1].arm("pwrite", 5, after=per_step - 1 if fault == "last" else int(fault))
        raised: Exception | None = None
        micro = eng.micro_steps
        try:
            eng.backward(loss)
            eng.step()
        except Exception as exc:  # seen before the commit
            raised = exc
        late: list[Exception] = []

        def told_late_once(fn: Any) -> Any:
            """fn(), again after the injected failure told late, once, to the call that
            settled it (nobody waited for the write; its data was kept by a host cache)."""
            try:
                return fn()
            except Exception as exc:
                assert not late and raised is None and "errno 5 (EIO" in str(exc), exc
                late.append(exc)
                return fn()

        if raised is not None and driver.last_update != "speculated":
            assert "errno 5 (EIO" in str(raised) and "scratch.swp" in str(raised), raised
            # the failed step's gradients are dropped; a step() that failed before it
            # decided left the speculation to the next use, which undoes it
            eng.zero_grad()
            assert driver.state is not StepState.SPECULATING
            swap = eng.store.manager._mover.swap  # type: ignore[union-attr]
            assert swap.stats().kept_regions == 0
            got = full_params(eng, model)
            assert all(torch.equal(got[k], v) for k, v in before.items())
            eng.save_checkpoint(tmp_path / "ck", tag="after")
            from test_deferred_stream import same_checkpoints

            # a backward that ran through counts its micro-step, also where step() failed
            same_checkpoints(tmp_path / "ck" / "before", tmp_path / "ck" / "after",
                             micro_steps=eng.micro_steps - micro)
        else:  # the step stands (raised, if at all, once it had committed)
            assert driver.last_update == "speculated"
            _refused_or_exact(eng, tmp_path, batches)
            told_late_once(lambda: eng.load_checkpoint(tmp_path / "ck", tag="before"))
            got = full_params(eng, model)
            assert all(torch.equal(got[k], v) for k, v in before.items())

        def one_step(ids: torch.Tensor, tg: torch.Tensor) -> None:
            eng.zero_grad()
            eng.backward(eng(ids, tg) * 0.5)
            eng.step()

        for ids, tg in batches[3:]:  # training goes on
            told_late_once(functools.partial(one_step, ids, tg))
        assert driver.last_update in ("deferred", "speculated")
    finally:
        eng.close()


def _refused_or_exact(eng: ZeroEngine, tmp_path: Path, batches: list[Any]) -> None:
    """A checkpoint after a write that failed once step() had committed: refused, naming
    the failure, or (the write's data kept by a host cache) the no-fault run's."""
    from test_deferred_stream import same_checkpoints

    try:
        eng.save_checkpoint(tmp_path / "ck", tag="after")
    except Exception as exc:
        text = str(exc)
        assert "last write of this shard failed" in text or "errno 5 (EIO" in text, text
        return
    ref, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=nvme_cfg(tmp_path / "swap_ref"))
    try:
        for ids, tg in batches[:3]:
            ref.backward(ref(ids, tg) * 0.5)
            ref.step()
        ref.save_checkpoint(tmp_path / "ck_ref", tag="after")
    finally:
        ref.close()
    same_checkpoints(tmp_path / "ck_ref" / "after", tmp_path / "ck" / "after")


def test_background_save_read_while_later_steps_speculate_and_undo(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A background save after step 2 has its writer held until the run's end, while the
    steps after it speculate, commit, and undo one (clipping fires on step 4): the saved
    state is step 2's, the same bytes as with speculation off, and no region stays kept
    once it is written ([Note: shard snapshots] beside [Note: speculated shards])."""
    import threading

    from test_deferred_stream import same_checkpoints

    from tierzero.engine.checkpoint import save as save_mod

    gate = threading.Event()
    original = save_mod.write_snapshot_entry

    def gated(w: Any, name: str, ref: Any, snapshot: Any, pacer: Any) -> None:
        while not gate.wait(0.02) and not pacer.cancel.is_set():
            pass
        original(w, name, ref, snapshot, pacer)

    monkeypatch.setattr(save_mod, "write_snapshot_entry", gated)

    def run(on: bool) -> tuple[dict[str, torch.Tensor], list[str | None]]:
        gate.clear()
        model = make_model()
        eng, _, _, _ = engine.initialize(device="cpu", model=model, config=with_speculation(
            nvme_cfg(tmp_path / f"swap{on}"), on))
        driver = driver_of(eng)
        updates = []
        try:
            pending = None
            for i, ((ids, tg), scale) in enumerate(zip(make_batches(len(SCALES)), SCALES,
                                                       strict=True)):
                eng.backward(eng(ids, tg) * scale)
                eng.step()
                updates.append(driver.last_update)
                if i == 1:
                    pending = eng.save_checkpoint(tmp_path / f"ck{on}", tag="s",
                                                  background=True)
            gate.set()
            assert isinstance(pending, engine.PendingSave)
            pending.wait()
            swap = eng.store.manager._mover.swap  # type: ignore[union-attr]
            assert swap.stats().kept_regions == 0
            return full_params(eng, model), updates
        finally:
            gate.set()
            eng.close()

    p_on, u_on = run(True)
    p_off, _ = run(False)
    assert u_on == ["deferred", "speculated", "speculated", "undone", "deferred",
                    "deferred", "speculated", "speculated"]
    same_checkpoints(tmp_path / "ckTrue" / "s", tmp_path / "ckFalse" / "s")
    assert all(torch.equal(p_on[k], v) for k, v in p_off.items())


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_a_param_the_engine_holds_gathered_is_copied_not_read_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clip: float) -> None:
    """A bf16 master in pieces ([Note: a param held in host memory] in
    offload/shard_inputs.py): the update run during backward (speculated under clipping,
    the early step without) copies the param of a group whose unit is still gathered
    (the root, gathered from forward into backward) instead of reading it back: the same
    bits and updates as reading every param back, and fewer param bytes read from NVMe.
    With the pool as configured (copying gathers): the sixth buffer gathers that view the
    pool add keeps the root's param cached, with nothing left to read back."""
    from test_engine_bf16_master import configure

    copying_gathers(monkeypatch)
    real = ZeroEngine._held_param
    copied: list[int] = []

    def spy(self: ZeroEngine, key: str) -> torch.Tensor | None:
        held = real(self, key)
        if held is not None:
            copied.append(held.numel() * held.element_size())
        return held

    monkeypatch.setattr(ZeroEngine, "_held_param", spy)
    held = train(configure("nvme", tmp_path / "held", state="int8", clip=clip,
                                     chunk=512), SCALES)
    monkeypatch.setattr(ZeroEngine, "_held_param", lambda self, key: None)
    read = train(configure("nvme", tmp_path / "read", state="int8", clip=clip,
                                     chunk=512), SCALES)
    assert held["updates"] == read["updates"]
    assert ("speculated" in held["updates"]) if clip else set(held["updates"]) == {"backward"}
    assert_same(held, read)
    assert copied, "no update found its param held gathered"
    # each copy replaced a read, from NVMe unless the param was still cached in the pool
    assert 0 < read["param_read"] - held["param_read"] <= sum(copied)


def test_a_held_param_is_offered_only_while_it_is_the_shard_as_it_is(tmp_path: Path) -> None:
    """held_shard checks the store's version: once the shard changes after the gather (a
    write of the param), the gathered copy is not offered; gathered again, it is."""
    from test_engine_bf16_master import configure

    from tierzero.engine.shards.flat import held_shard

    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                     config=configure("nvme", tmp_path, state="int8", chunk=512))
    try:
        root = eng.root
        group = next(g for g in root.groups if g.trainable)
        assert eng._held_param(group.key) is None  # released: nothing held
        eng.scheduler.ensure_gathered(root)
        held = eng._held_param(group.key)
        assert held is not None
        with eng.store.use(group.key, "param") as shard:
            assert torch.equal(held, shard.to(held.device))
        assert held_shard(group, 0, None) is None  # a store that keeps no versions
        with eng.store.use(group.key, "param", writable=True) as shard:
            shard.add_(1.0)  # the shard moves past the copy
        assert eng._held_param(group.key) is None
        root.mark_stale()
        eng.scheduler.refresh()
        again = eng._held_param(group.key)
        assert again is not None
        with eng.store.use(group.key, "param") as shard:
            assert torch.equal(again, shard.to(again.device))
        eng.scheduler.release(root)
        assert eng._held_param(group.key) is None
    finally:
        eng.close()


def _ranks_held(rank: int, path: str) -> dict[str, Any]:
    from test_engine_bf16_master import configure

    out = {}
    real = ZeroEngine._held_param
    for held in (True, False):
        if not held:
            ZeroEngine._held_param = lambda self, key: None  # type: ignore[method-assign]
        try:
            run = train(configure("nvme", Path(path) / f"{held}{rank}", state="int8",
                                            clip=1.0, chunk=512), SCALES)
        finally:
            ZeroEngine._held_param = real  # type: ignore[method-assign]
        out[str(held)] = run
    return out


@pytest.mark.multiproc
def test_two_ranks_copy_their_own_shard_of_a_held_param(tmp_path: Path) -> None:
    """At world size 2 ([Note: a param held in host memory] in offload/shard_inputs.py)
    each rank copies its own shard out of the gathered buffer (at its rank's offset):
    the same bits as reading every param back, on both ranks, and fewer param bytes
    read."""
    (tmp_path / "swap").mkdir()
    r0, r1 = (r["r"] for r in run_two_ranks(
        tmp_path, {"r": functools.partial(_ranks_held, path=str(tmp_path / "swap"))}))
    for rank in (r0, r1):
        assert_same(rank["True"], rank["False"])
        assert rank["True"]["updates"] == rank["False"]["updates"]
        assert "speculated" in rank["True"]["updates"]
        assert rank["True"]["param_read"] < rank["False"]["param_read"]
    bad = [k for k, v in r0["True"]["params"].items()
           if not torch.equal(v, r1["True"]["params"][k])]
    assert not bad, bad
