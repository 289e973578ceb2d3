"""Background saves ([Note: background save] in engine/checkpoint/background.py): the
checkpoint holds exactly the state at the call although the following steps change it
before it is written (the writer is held until they are done), for every offload config;
resume is bit-exact; kept swap regions are released; a save without swap room falls back
to a synchronous one; an abandoned save leaves the previous checkpoint; two ranks. A step
whose optimizer update is still deferred is saved without waiting for it."""

from __future__ import annotations

import logging
import re
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from ckpt_bg_helpers import (
    DeferredHold,
    bg_config,
    bg_run,
    gate_writer,
    many_saves,
    saved_tensors,
)
from engine_dist import run_two_ranks
from engine_helpers import make_batches, make_model

from tierzero import engine
from tierzero.engine.checkpoint.layout import LATEST, CheckpointError, load_manifest
from tierzero.swap import SwapError, SwapStore

OFFLOADS = ["none", "cpu", "nvme", "params_nvme"]


def _same_checkpoints(a: Path, b: Path, ranks: int = 1) -> None:
    ma, mb = load_manifest(a), load_manifest(b)
    assert ma["engine"] == mb["engine"] and ma["groups"] == mb["groups"]
    for r in range(ranks):
        ta, tb = saved_tensors(a, r), saved_tensors(b, r)
        assert ta.keys() == tb.keys()
        bad = [k for k in ta if not torch.equal(ta[k], tb[k])]
        assert not bad, f"rank {r}: {bad}"


@pytest.mark.parametrize("offload", OFFLOADS)
def test_background_save_equals_sync_save_and_resumes_exactly(tmp_path: Path,
                                                              offload: str) -> None:
    """Saved at step 3 in the background, its writer held until steps 4-6 have changed
    every shard: the files equal a synchronous save at step 3, and a run resumed from it
    ends bit for bit where the uninterrupted run did."""
    n, m = 3, 3
    bg = bg_run(0, offload=offload, ckpt=str(tmp_path / "bg"), swap=str(tmp_path / "s1"),
                n=n, m=m, background=True, gate=True)
    bg_run(0, offload=offload, ckpt=str(tmp_path / "sync"), swap=str(tmp_path / "s2"),
           n=n, m=m, background=False)
    assert bg["fallback"] is None
    _same_checkpoints(tmp_path / "bg" / "s", tmp_path / "sync" / "s")
    resumed = bg_run(0, offload=offload, ckpt=str(tmp_path / "bg"), swap=str(tmp_path / "s3"),
                     n=n, m=m, background=False, load=True)
    bad = [k for k in bg["params"] if not torch.equal(bg["params"][k], resumed["params"][k])]
    assert not bad, bad
    if offload == "params_nvme":  # the saved state (master, moments) is on the device: copied
        assert bg["swap_during"].kept_regions == 0
    if offload == "nvme":  # the steps replaced kept regions; all released after the save
        # (kept once the update of step n, deferred into the next forward, has landed:
        # [Note: shard snapshots] in offload/snapshot.py)
        assert bg["swap_gated"].kept_regions > 0
        assert bg["swap_after"].kept_regions == 0
        assert bg["swap_after"].kept_retired_bytes == 0
    if offload == "cpu":  # host state changed before it was written: copied, then dropped
        assert bg["stats"].snapshot["copies"] > 0
    if offload != "none":
        assert bg["outside"].get("snapshot", 0) == 0
        assert bg["outside"].get("checkpoint_read", 0) == 0


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_background_save_mid_accumulation(tmp_path: Path, offload: str) -> None:
    """2 micro-steps per step, saved after micro-step 3: the half-accumulated gradient is
    saved as it was, though the next micro-step adds to it before it is written."""
    common = {"offload": offload, "n": 3, "m": 3, "gas": 2}
    bg = bg_run(0, ckpt=str(tmp_path / "bg"), swap=str(tmp_path / "s1"), background=True,
                gate=True, **common)
    bg_run(0, ckpt=str(tmp_path / "sync"), swap=str(tmp_path / "s2"), background=False,
           **common)
    _same_checkpoints(tmp_path / "bg" / "s", tmp_path / "sync" / "s")
    assert any(k.endswith("::grad") for k in saved_tensors(tmp_path / "bg" / "s", 0))
    resumed = bg_run(0, ckpt=str(tmp_path / "bg"), swap=str(tmp_path / "s3"),
                     background=False, load=True, **common)
    assert all(torch.equal(bg["params"][k], resumed["params"][k]) for k in bg["params"])


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_writers_wait_past_copy_limit_and_pacing(tmp_path: Path, offload: str) -> None:
    """background_save_copy_bytes 0 (one copy at a time: the steps wait for the writer)
    and a slow writer (share 0.2): still the state at the call."""
    kw = {"background_save_copy_bytes": 0, "background_save_share": 0.2}
    bg = bg_run(0, offload=offload, ckpt=str(tmp_path / "bg"), swap=str(tmp_path / "s1"),
                n=2, m=3, background=True, **kw)
    bg_run(0, offload=offload, ckpt=str(tmp_path / "sync"), swap=str(tmp_path / "s2"),
           n=2, m=3, background=False)
    _same_checkpoints(tmp_path / "bg" / "s", tmp_path / "sync" / "s")
    assert bg["stats"].paused_s > 0 and bg["stats"].read_bytes > 0


def test_kept_regions_do_not_grow_the_swap_file(tmp_path: Path) -> None:
    """A background save after every step for 10 steps: each completed save leaves no kept
    region, and the swap file does not grow with the number of saves. Each save keeps
    about three quarters of the file's state while it runs: regions not reused after it
    would add that much per save, about 7x the file over 10 saves. Where freed regions
    are fragmented the file may still grow by some pages, by how the saves and the steps'
    writes interleave, so the bound is half a file, well below one leaked save."""
    got = many_saves(str(tmp_path / "ck"), str(tmp_path / "swap"), 10)
    assert got["kept"] == [0] * 10 and got["retired"] == [0] * 10
    sizes = got["sizes"]
    assert max(sizes) <= 1.5 * sizes[0], sizes


def test_no_swap_room_falls_back_to_a_synchronous_save(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    def no_room(self: SwapStore, nbytes: int) -> None:
        raise SwapError("cannot grow the swap file", path=self.path, errno=28)

    monkeypatch.setattr(SwapStore, "reserve_free", no_room)
    with caplog.at_level(logging.WARNING):
        out = bg_run(0, offload="nvme", ckpt=str(tmp_path / "ck"), swap=str(tmp_path / "s"),
                     n=2, m=1, background=True)
    assert out["fallback"] is not None and "cannot grow the swap file" in out["fallback"]
    assert "written synchronously instead" in caplog.text
    assert out["swap_after"].kept_regions == 0
    assert (tmp_path / "ck" / LATEST).read_text() == "s"


def test_abandoned_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """abandon() (a second SIGINT while the engine closes) stops the writer: its partial
    directory is removed, `latest` names the previous checkpoint, nothing stays kept."""
    (tmp_path / "swap").mkdir()
    from ckpt_bg_helpers import swap_stats
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, device="cpu",
                                     config=bg_config("nvme", str(tmp_path / "swap")))
    (ids, tg), = make_batches(1)
    eng.backward(eng(ids, tg))
    eng.step()
    first = eng.save_checkpoint(tmp_path / "ck", tag="first", background=True)
    assert isinstance(first, engine.PendingSave)
    first.wait()
    never = threading.Event()
    gate_writer(never)  # the second save's writer waits forever, unless abandoned
    try:
        eng.backward(eng(ids, tg))
        eng.step()
        eng.save_checkpoint(tmp_path / "ck", tag="second", background=True)
        eng._saver.abandon()
    finally:
        never.set()
    assert (tmp_path / "ck" / LATEST).read_text() == "first"
    assert not (tmp_path / "ck" / ".second.partial").exists()
    assert not (tmp_path / "ck" / "second").exists()
    assert swap_stats(eng).kept_regions == 0
    eng.close()


@pytest.mark.multiproc
def test_world2_background_save_resumes_exactly(tmp_path: Path) -> None:
    """Two gloo ranks, NVMe offload: the writers exchange digests over their own group
    while training goes on; a resume on two fresh ranks is bit-exact."""
    common = {"offload": "nvme", "ckpt": str(tmp_path / "ck"), "n": 3, "m": 3}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    full = run_two_ranks(tmp_path / "a", {"run": partial(
        bg_run, swap=str(tmp_path / "s1"), background=True, gate=True, **common)})
    resumed = run_two_ranks(tmp_path / "b", {"run": partial(
        bg_run, swap=str(tmp_path / "s2"), background=False, load=True, **common)})
    for r in range(2):
        want, got = full[r]["run"]["params"], resumed[r]["run"]["params"]
        assert all(torch.equal(want[k], got[k]) for k in want), r
        assert full[r]["run"]["swap_after"].kept_regions == 0


# -- a step whose optimizer update is still deferred ([Note: saving a deferred step] in
# engine/checkpoint/deferred.py): cpu offload, clipping and overlap_step (the default) leave
# step()'s update on the in-place CPU Adam's worker, to run during the next forward.

def test_background_save_returns_while_the_deferred_update_is_held(tmp_path: Path) -> None:
    """The deferred update is held on its worker in its first group: save_checkpoint(
    background=True) returns meanwhile (one that waited for the update would wait for the
    release) and its writer cannot finish before the update has landed. Released, the
    checkpoint equals a synchronous save taken right after it, at the same step."""
    eng, _, _, _ = engine.initialize(model=make_model(), config=bg_config("cpu", None),
                                     device="cpu")
    hold = DeferredHold(eng)
    try:
        (ids, tg), = make_batches(1)
        eng.backward(eng(ids, tg))
        hold.holding.set()
        eng.step()
        pending = eng.save_checkpoint(tmp_path / "ck", tag="bg", background=True)
        assert isinstance(pending, engine.PendingSave) and pending.background
        assert hold.ended == [] and hold.step.deferred  # no group's update had run
        assert not pending.done()  # the writer reads each group after its update
        hold.stop()
        pending.wait()
        eng.save_checkpoint(tmp_path / "ck", tag="sync")
    finally:
        hold.stop()
        eng.close()
    _same_checkpoints(tmp_path / "ck" / "bg", tmp_path / "ck" / "sync")


@pytest.mark.parametrize("gate", [True, False])
def test_save_of_a_held_deferred_update_equals_sync_save_and_resumes(tmp_path: Path,
                                                                     gate: bool) -> None:
    """Saved at step 3 with its deferred update held until the call returned, then steps
    4-6 run while the save is written (`gate`: its writer waits until they are done, so
    they change every group first; else it reads each group as its update lands): the
    files equal a synchronous save at step 3, and a resume ends bit for bit where the
    uninterrupted run did."""
    common = {"offload": "cpu", "n": 3, "m": 3}
    bg = bg_run(0, ckpt=str(tmp_path / "bg"), swap=None, background=True, gate=gate,
                hold=True, **common)
    assert bg["fallback"] is None
    assert bg["held_ended"] == [] and bg["held_pending"]
    bg_run(0, ckpt=str(tmp_path / "sync"), swap=None, background=False, **common)
    _same_checkpoints(tmp_path / "bg" / "s", tmp_path / "sync" / "s")
    resumed = bg_run(0, ckpt=str(tmp_path / "bg"), swap=None, background=False, load=True,
                     **common)
    bad = [k for k in bg["params"] if not torch.equal(bg["params"][k], resumed["params"][k])]
    assert not bad, bad
    if gate:  # the next steps changed host state the writer had not read: copied first
        assert bg["stats"].snapshot["copies"] > 0
    assert bg["outside"].get("snapshot", 0) == 0


@pytest.mark.parametrize("when", ["during", "before"])
def test_failed_deferred_update_fails_the_background_save(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          when: str) -> None:
    """The deferred update fails on one group, while the save is written (`during`: held
    until the call returned) or before the call (the failure not raised yet): the save
    fails naming the group, leaves nothing behind, and the next forward raises the
    failure as without a save. Once raised, saves are refused (a partial step: [Note: a
    partial step] in engine/step/offloaded.py); with allow_partial_step a background save
    writes the state as it is, as a synchronous save does."""
    eng, _, _, _ = engine.initialize(model=make_model(), config=bg_config("cpu", None),
                                     device="cpu")
    hold = DeferredHold(eng)
    step = hold.step
    bad = eng._train_keys[1]
    held = step.update
    failing = threading.Event()

    def fail(key: str, *args: object) -> float:
        if key == bad and failing.is_set():
            raise OSError("injected kernel failure")
        return held(key, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(step, "update", fail)
    ck = tmp_path / "ck"
    try:
        (ids, tg), = make_batches(1)
        eng.backward(eng(ids, tg))
        failing.set()
        hold.holding.set()
        if when == "before":
            hold.release.set()
        eng.step()
        if when == "before":  # every queued update has run (the last ones skipped)
            while not all(job.done() for job in step._deferred.values()):
                time.sleep(0.005)
        pending = eng.save_checkpoint(ck, tag="bg", background=True)
        assert isinstance(pending, engine.PendingSave) and pending.background
        hold.stop()
        with pytest.raises(CheckpointError, match=f"shard group '{re.escape(bad)}'.*"
                                                  "injected kernel failure"):
            pending.wait()
        assert not (ck / LATEST).exists() and not (ck / ".bg.partial").exists()
        with pytest.raises(RuntimeError, match=f"shard group '{re.escape(bad)}'"):
            eng(ids, tg)
        failing.clear()
        for background in (True, False):  # a partial step is not saved by mistake
            with pytest.raises(CheckpointError, match="save_checkpoint refused: optimizer "
                               "step 1's update failed partway"):
                eng.save_checkpoint(ck, tag="refused", background=background)
        later = eng.save_checkpoint(ck, tag="after", background=True, allow_partial_step=True)
        assert isinstance(later, engine.PendingSave)
        later.wait()
        eng.save_checkpoint(ck, tag="after_sync", allow_partial_step=True)
        _same_checkpoints(ck / "after", ck / "after_sync")
        for seed in (2, 3):  # training goes on
            (ids, tg), = make_batches(1, seed=seed)
            eng.backward(eng(ids, tg))
            eng.step()
    finally:
        hold.stop()
        eng.close()


@pytest.mark.multiproc
def test_world2_background_save_of_a_held_deferred_update(tmp_path: Path) -> None:
    """Two gloo ranks, cpu offload with the deferred update held on each rank until its
    save call returned: the calls agree over the ranks without waiting for the updates,
    and a resume on two fresh ranks is bit-exact."""
    common = {"offload": "cpu", "ckpt": str(tmp_path / "ck"), "n": 3, "m": 3, "swap": None}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    full = run_two_ranks(tmp_path / "a", {"run": partial(
        bg_run, background=True, hold=True, **common)})
    resumed = run_two_ranks(tmp_path / "b", {"run": partial(
        bg_run, background=False, load=True, **common)})
    for r in range(2):
        run = full[r]["run"]
        assert run["fallback"] is None and run["held_ended"] == [] and run["held_pending"]
        want, got = run["params"], resumed[r]["run"]["params"]
        assert all(torch.equal(want[k], got[k]) for k in want), r
