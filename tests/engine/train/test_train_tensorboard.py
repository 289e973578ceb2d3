"""train.report_to: tensorboard: the metrics a Trainer user looks for, under its names."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import read_metrics, write_config

from tierzero.engine.cli import main
from tierzero.engine.train import tensorboard as tb_mod


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the event files under `log_dir`: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_match_the_metrics_file(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="train.report_to: tensorboard (in dev)")
    config = write_config(tmp_path, steps=4, eval_fraction=0.1, eval_interval=2,
                          report_to="tensorboard")
    assert main(["train", str(config), "--no-progress"]) == 0
    rows = read_metrics(tmp_path)
    (run_dir,) = (tmp_path / "runs").iterdir()
    got = scalars(run_dir / "tensorboard")
    assert {"train/loss", "train/grad_norm", "train/learning_rate", "train/clip_coef",
            "eval/loss", "tierzero/step_s", "tierzero/peak_host_bytes",
            "tierzero/cpu_cores"} <= set(got)
    steps = [r for r in rows if r["event"] == "step"]
    for tag, field in (("train/loss", "loss"), ("train/grad_norm", "grad_norm"),
                       ("train/learning_rate", "lr")):
        # (TensorBoard keeps float32)
        assert got[tag] == [(r["step"], pytest.approx(r[field], rel=1e-6)) for r in steps]
    evals = [(r["step"], pytest.approx(r["eval_loss"], rel=1e-6))
             for r in rows if r["event"] == "eval"]
    assert got["eval/loss"] == evals and len(evals) == 3  # before, at 2, after the last


def test_report_to_tensorboard_without_the_package_is_one_line_before_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "tensorboard" else real(name, *args)

    monkeypatch.setattr(tb_mod.importlib.util, "find_spec", find_spec)
    config = write_config(tmp_path, steps=1, report_to="tensorboard")
    assert main(["train", str(config), "--no-progress"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.report_to" in err[0]
    assert "pip install 'tierzero[tensorboard]'" in err[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_report_to_rejects_an_unknown_value(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, steps=1, report_to="wandb")
    assert main(["train", str(config), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert "train.report_to" in err and "tensorboard" in err
