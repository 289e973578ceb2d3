"""`tierzero config check`: output, round trip, exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tierzero import engine
from tierzero.engine.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_check_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# tierzero config resolved from the embedded default")
    tree = yaml.safe_load(out)
    assert tree["offload"]["params"]["device"] == "nvme"
    assert tree["zero"]["prefetch_bytes"] == 100_000_000  # defaults are filled in
    assert tree["nvme"]["queue_depth"] == 8


@pytest.mark.parametrize("name", ["zero3_cpu.yaml", "deepspeed/zero2_cpu.json"])
def test_output_loads_back_to_the_same_config(name: str, capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    assert main(["config", "check", str(ROOT / "configs" / name)]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    original = engine.load_config(ROOT / "configs" / name)
    again = engine.load_config(printed)
    assert again.source == "native"
    for section in ("precision", "zero", "offload", "nvme", "optimizer", "scheduler", "batch",
                    "logging", "seed", "gradient_clipping"):
        assert getattr(again, section) == getattr(original, section)


def test_ignored_deepspeed_keys_listed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", str(ROOT / "configs/deepspeed/zero2_cpu.json")]) == 0
    out = capsys.readouterr().out
    assert "# DeepSpeed keys accepted but not acted on:" in out
    assert "#   tensorboard (monitoring backend)" in out
    assert "#   zero_optimization.contiguous_gradients (" in out


def test_auto_values_option(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_micro_batch_size_per_gpu": "auto", '
                   '"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}')
    assert main(["config", "check", str(cfg), "--auto", "learning_rate=3e-4",
                 "--auto", "per_device_train_batch_size=2"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["optimizer"]["lr"] == 3e-4
    assert tree["batch"]["micro_batch_size"] == 2
    assert main(["config", "check", str(cfg), "--auto", "oops"]) == 1
    assert "--auto: 'oops' is not allowed; allowed: NAME=VALUE" in capsys.readouterr().err


def test_auto_run_length_is_listed_as_waiting(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupDecayLR",'
                   ' "params": {"warmup_num_steps": 0, "total_num_steps": "auto"}}}')
    assert main(["config", "check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "# 'auto' waiting for the run length (tierzero train: train.steps; or --auto " \
           "max_steps=N): scheduler.params.total_num_steps" in out
    assert main(["config", "check", str(cfg), "--auto", "max_steps=30"]) == 0
    out = capsys.readouterr().out
    assert "total_steps: 30" in out and "waiting" not in out


def test_bad_file_exits_1_with_the_error(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero: {stage: 4}\noffload: {device: disk}\n")
    assert main(["config", "check", str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"tierzero config check: error: {bad}: ")
    assert "is out of range" in captured.err or "'disk' is not allowed" in captured.err


def test_missing_file_exits_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["config", "check", str(tmp_path / "none.yaml")]) == 1
    assert "cannot read config file" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["config"], ["nonsense"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
    assert "usage: tierzero" in capsys.readouterr().err


def test_module_entry_point_runs() -> None:
    done = subprocess.run([sys.executable, "-m", "tierzero", "config", "check",
                           "configs/deepspeed/zero2_cpu.json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "device: cpu" in done.stdout
    assert done.stdout.count("tensorboard") == 1
    assert done.stderr == ""  # ignored keys are listed on stdout, not logged a second time
