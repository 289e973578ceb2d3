"""One run per checkpoint directory and metrics file, saves that fail or are killed, resume
after a kill between publishing a checkpoint and moving `latest`, non-finite losses and
gradient norms (issue 21)."""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from engine_helpers import make_batches, make_config, make_model, train_steps
from fault_helpers import Server

from tierzero import engine
from tierzero.engine.checkpoint import io as checkpoint_io
from tierzero.engine.cli import main
from tierzero.engine.train import evaluation, run_lock
from tierzero.engine.train.run_lock import LockError, RunLock

pytestmark = pytest.mark.faults


def _config(tmp_path: Path, name: str, **train: Any) -> Path:
    cfg = {
        "seed": 4, "precision": "fp32", "gradient_clipping": 1.0,
        "optimizer": {"type": "adamw", "lr": 3.0e-3},
        "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
        "logging": {"level": "warning"},
        "train": {"model": "builtin:tiny", "seq_len": 32, "out_dir": str(tmp_path / name),
                  **train},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config: Path) -> int:
    return main(["train", str(config), "--no-progress"])


def _losses(out_dir: Path) -> dict[int, float]:
    (f,) = out_dir.glob("*/metrics.jsonl")
    return {r["step"]: r["loss"] for r in map(json.loads, f.read_text().splitlines())
            if r["event"] == "step"}


# -- locks ----------------------------------------------------------------------------

def test_second_run_on_a_checkpoint_dir_is_refused_and_the_first_saves_intact(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], fault_server: Server) -> None:
    ck = tmp_path / "ck"
    first = _config(tmp_path, "first", steps=40, checkpoint_interval=10, checkpoint_dir=str(ck))
    pid, _, err_file = fault_server.start(["train", str(first), "--no-progress"])
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "first").glob("*/metrics.jsonl")):  # it holds the lock
            assert time.monotonic() < deadline, f"first run not started: {err_file.read_text()}"
            time.sleep(0.02)
        second = _config(tmp_path, "second", steps=4, checkpoint_interval=2,
                         checkpoint_dir=str(ck), resume=True)
        capsys.readouterr()
        assert _train(second) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"train.checkpoint_dir '{ck}' is in use by another tierzero run (pid " \
            f"{pid} on host" in err, err
        assert not (tmp_path / "second").exists()  # refused before any work
    finally:
        code = fault_server.wait(pid)
    assert code == 0, err_file.read_text()
    tags = sorted(p.name for p in ck.iterdir() if p.name.startswith("step"))
    assert tags == ["step10", "step20", "step30", "step40"]
    for tag in tags:  # every checkpoint of the first run loads, CRCs checked
        state = engine.consolidate(ck, tag)
        assert state and all(torch.isfinite(t).all() for t in state.values())


def test_lock_of_a_dead_run_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".lock").write_text(json.dumps({"pid": dead.pid, "host": "h", "started": "x"}))
    assert _train(_config(tmp_path, "run", steps=2, checkpoint_interval=2,
                          checkpoint_dir=str(ck))) == 0
    assert (ck / "step2" / "manifest.json").is_file()
    assert (ck / ".lock").read_text() == ""  # released: no owner named


def test_shared_metrics_path_is_refused(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    metrics = tmp_path / "m.jsonl"
    config = _config(tmp_path, "run", steps=1, metrics_path=str(metrics))
    with RunLock(tmp_path / ".m.jsonl.lock", "another run"):  # held as a running run holds it
        capsys.readouterr()
        assert _train(config) == 1
        err = capsys.readouterr().err
        assert f"train.metrics_path '{metrics}' is in use by another tierzero run (pid " \
            f"{os.getpid()}" in err, err
    assert not metrics.exists()
    assert _train(config) == 0  # once the other run is gone
    assert metrics.is_file()


@pytest.mark.parametrize("owner", ["live", "dead"])
def test_lock_without_flock_trusts_a_live_owner_only(tmp_path: Path, owner: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    if owner == "live":
        pid = os.getppid()
    else:
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        pid = proc.pid
    lock = tmp_path / ".lock"
    lock.write_text(json.dumps({"pid": pid, "host": run_lock.socket.gethostname()}))
    if owner == "live":
        with pytest.raises(LockError, match=rf"pid {pid} on host .*no flock"):
            RunLock(lock, "dir").acquire()
    else:
        with RunLock(lock, "dir"):
            assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_lock_file_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / ".lock").symlink_to(target)
    with pytest.raises(LockError, match="cannot open the lock file"):
        RunLock(tmp_path / ".lock", "dir").acquire()
    assert target.read_text() == "keep"


# -- saves and resume -----------------------------------------------------------------

def test_kill_between_publish_and_latest_then_resume(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    assert _train(_config(tmp_path, "full", steps=8)) == 0
    assert _train(_config(tmp_path, "first", steps=6, checkpoint_interval=2,
                          checkpoint_dir=str(ck))) == 0
    # what a kill after step6 was renamed into place, before `latest` moved, leaves
    (ck / "latest").write_text("step4")
    (ck / ".latest.partial").write_text("step6")
    (ck / ".step8.partial").mkdir()
    (ck / ".step8.partial" / "rank00000.safetensors").write_bytes(b"\0" * 100)
    foreign = ck / ".mine.partial"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint file")
    assert _train(_config(tmp_path, "rest", steps=8, checkpoint_interval=2,
                          checkpoint_dir=str(ck), resume=True)) == 0
    full, rest = _losses(tmp_path / "full"), _losses(tmp_path / "rest")
    assert rest == {7: full[7], 8: full[8]}  # resumed at step 6, not 4; then saved step8
    assert (ck / "latest").read_text() == "step8"
    assert not (ck / ".step8.partial").exists() and not (ck / ".latest.partial").exists()
    assert (foreign / "notes.txt").is_file()  # not ours: left alone


def test_failed_save_leaves_nothing_that_blocks_the_next(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    eng, _, _, _ = engine.initialize(model=make_model(), config=make_config(), device="cpu")
    try:
        train_steps(eng, make_batches(1))
        real = checkpoint_io.SafetensorsWriter.write

        def full_disk(self: Any, name: str, tensor: torch.Tensor) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(checkpoint_io.SafetensorsWriter, "write", full_disk)
        with pytest.raises(engine.CheckpointError, match=r"No space left"):
            eng.save_checkpoint(tmp_path, tag="t")
        assert sorted(p.name for p in tmp_path.iterdir()) == []  # no .t.partial left
        monkeypatch.setattr(checkpoint_io.SafetensorsWriter, "write", real)
        eng.save_checkpoint(tmp_path, tag="t")
        assert (tmp_path / "latest").read_text() == "t"
    finally:
        eng.close()


# -- non-finite values ----------------------------------------------------------------

def test_nonfinite_loss_stops_naming_the_step_and_last_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = evaluation.F.cross_entropy
    calls = {"n": 0}

    def loss_nan_at_step_3(logits: torch.Tensor, target: torch.Tensor,
                           **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        out = real(logits, target, **kwargs)
        return out * math.nan if calls["n"] == 3 else out

    monkeypatch.setattr(evaluation.F, "cross_entropy", loss_nan_at_step_3)
    ck = tmp_path / "ck"
    capsys.readouterr()
    assert _train(_config(tmp_path, "run", steps=6, checkpoint_interval=2,
                          checkpoint_dir=str(ck))) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "step 3: the loss is nan" in err and f"last good checkpoint is {ck / 'step2'}" in err
    assert sorted(_losses(tmp_path / "run")) == [1, 2]


def test_nonfinite_grad_norm_skips_the_step_then_stops(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine.ZeroEngine._clip

    def nan_norm_from_step_2(self: engine.ZeroEngine, unscale: float, *stats: Any) -> float:
        coef = real(self, unscale, *stats)
        if self.global_steps + self.skipped_steps >= 1:
            self.last_grad_norm = math.nan
        return coef

    monkeypatch.setattr(engine.ZeroEngine, "_clip", nan_norm_from_step_2)
    capsys.readouterr()
    assert _train(_config(tmp_path, "run", steps=8, max_nonfinite_steps=2)) == 1
    err = capsys.readouterr().err
    assert "step 3: the gradient norm was not finite in 2 optimizer steps in a row" in err
    assert "no checkpoint was saved" in err


def test_engine_skips_a_step_with_a_nonfinite_grad_norm() -> None:
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=make_config(clip=1.0), device="cpu")
    try:
        batches = make_batches(2)
        train_steps(eng, batches[:1])
        handle = model.blocks[0].up.weight.register_hook(lambda g: g * math.inf)
        with engine.GatheredParameters(list(model.parameters())):
            params = {k: v.detach().clone() for k, v in model.named_parameters()}
        train_steps(eng, batches[1:])
        handle.remove()
        assert eng.nonfinite_steps_in_row == 1 and eng.skipped_steps == 1
        assert eng.global_steps == 1 and eng.last_grad_norm is not None
        with engine.GatheredParameters(list(model.parameters())):
            after = {k: v.detach().clone() for k, v in model.named_parameters()}
        assert all(torch.equal(params[k], after[k]) for k in params)  # nothing applied
        train_steps(eng, batches[:1])
        assert eng.nonfinite_steps_in_row == 0 and eng.global_steps == 2
    finally:
        eng.close()
