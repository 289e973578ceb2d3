"""`tierzero train` with train.checkpoint_interval and train.resume, on the embedded default
config (bf16, params and optimizer state on NVMe, clipping, warm-up schedule) shrunk to the
tiny model: a run stopped by its step limit and resumed ends with the same losses, bit for
bit, as one uninterrupted run (same kernels, same bytes: no tolerance)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tierzero.engine.cli import main

DEFAULT = Path(__file__).resolve().parents[3] / "configs" / "default.yaml"


def _config(tmp: Path, name: str, **train: Any) -> Path:
    cfg = yaml.safe_load(DEFAULT.read_text())
    cfg["offload"]["path"] = str(tmp / f"swap-{name}")
    (tmp / f"swap-{name}").mkdir()
    cfg["logging"] = {"steps_per_print": 1}
    cfg["train"] = {"model": "builtin:tiny", "seq_len": 32, "out_dir": str(tmp / f"runs-{name}"),
                    **train}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(tmp: Path, name: str) -> tuple[dict[str, Any], dict[int, float]]:
    (path,) = (tmp / f"runs-{name}").glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return rows[0], {r["step"]: r["loss"] for r in rows if r["event"] == "step"}


def _train(config: Path) -> None:
    assert main(["train", str(config), "--no-progress"]) == 0


def test_interrupted_run_resumes_to_the_same_losses(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    ck = str(tmp_path / "ck")
    _train(_config(tmp_path, "full", steps=6))
    _train(_config(tmp_path, "first", steps=4, checkpoint_interval=2, checkpoint_dir=ck))
    # (.lock: the run lock, engine/train/run_lock.py)
    assert sorted(p.name for p in Path(ck).iterdir() if p.name != ".lock") == [
        "latest", "step2", "step4"]
    _train(_config(tmp_path, "rest", steps=6, checkpoint_interval=2, checkpoint_dir=ck,
                   resume=True))
    _train(_config(tmp_path, "tag", steps=3, resume=f"{ck}/step2"))  # one checkpoint by path
    _, full = _losses(tmp_path, "full")
    _, first = _losses(tmp_path, "first")
    head, rest = _losses(tmp_path, "rest")
    _, tag = _losses(tmp_path, "tag")
    assert head["start_step"] == 4 and sorted(rest) == [5, 6]
    assert first == {s: full[s] for s in range(1, 5)}
    assert rest == {5: full[5], 6: full[6]}  # step count, lr schedule, data position resumed
    assert tag == {3: full[3]}
    # the first run saved in the background (the default): metrics say when each save
    # started and finished, and what it cost the steps it overlapped
    (metrics,) = (tmp_path / "runs-first").glob("*/metrics.jsonl")
    saves = [json.loads(line) for line in metrics.read_text().splitlines()]
    saves = [(r["phase"], r["tag"]) for r in saves if r["event"] == "checkpoint"]
    assert saves == [("started", "step2"), ("finished", "step2"), ("started", "step4"),
                     ("finished", "step4")]
    assert (Path(ck) / "latest").read_text() == "step6"
    assert head["config"]["offload"]["optimizer"]["device"] == "nvme"
    # resuming at step 2 with saves every 2 steps would save step4 again: refused up front
    config = _config(tmp_path, "clash", steps=6, checkpoint_interval=2, checkpoint_dir=ck,
                     resume=f"{ck}/step2")
    capsys.readouterr()
    assert main(["train", str(config), "--no-progress"]) == 1
    assert "resuming at step 2 would save step4" in capsys.readouterr().err
    assert not (tmp_path / "runs-clash").exists()


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "latest").write_text("step2")
    assert main(["train", str(_config(tmp_path, "again", steps=2, checkpoint_interval=1,
                                        checkpoint_dir=str(ck))), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "already holds checkpoints (latest: step2)" in err and "train.resume: true" in err
