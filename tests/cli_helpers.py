"""Helpers shared by the tierzero train tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def write_config(tmp_path: Path, **train: Any) -> Path:
    """fp32, no offload, the tiny model: small enough for a unit test, exact enough to compare."""
    cfg = {
        "seed": 3,
        "precision": "fp32",
        "optimizer": {"type": "adamw", "lr": 3.0e-3, "weight_decay": 0.01},
        "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
        "logging": {"steps_per_print": 1},
        "train": {"model": "builtin:tiny", "steps": 6, "seq_len": 32,
                  "out_dir": str(tmp_path / "runs"), **train},
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def read_metrics(tmp_path: Path) -> list[dict[str, Any]]:
    (path,) = (tmp_path / "runs").glob("*/metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]
