"""`tierzero train` builds a stage-3 model under engine.Init (engine/train/loop.py): a
model from a Hugging Face config.json is made straight into per-rank shards (on NVMe with
params offloaded) instead of whole in fp32 host memory first, and trains exactly as the
same model built whole: the losses are bitwise those of a run with Init turned off."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest
import yaml
from hf_helpers import llama_config

from tierzero import engine
from tierzero.engine.cli import main

pytest.importorskip("transformers")


def _run(tmp: Path, name: str, tie: bool) -> list[float]:
    base = tmp / "model"
    base.mkdir(exist_ok=True)
    llama_config(tie=tie).to_json_file(base / "config.json")  # fresh weights: no files
    swap = tmp / "swap"
    swap.mkdir(exist_ok=True)
    cfg = {"seed": 5, "precision": "fp32", "optimizer": {"lr": 1e-2},
           "offload": {"device": "nvme", "path": str(swap)},
           "batch": {"micro_batch_size": 2},
           "train": {"model": str(base), "steps": 3, "seq_len": 16,
                     "out_dir": str(tmp / name)}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--no-progress"]) == 0
    (metrics,) = (tmp / name).glob("*/metrics.jsonl")
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()
            if json.loads(line)["event"] == "step"]


@pytest.mark.parametrize("tie", [False, True])
def test_config_json_model_is_built_under_init(tmp_path: Path, tie: bool,
                                               caplog: pytest.LogCaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with caplog.at_level(logging.INFO, logger="tierzero.engine.init.context"):
        under_init = _run(tmp_path, "init", tie)
    assert "Init: parameters partitioned" in caplog.text
    caplog.clear()
    monkeypatch.setattr(engine, "Init", functools.partial(engine.Init, enabled=False))
    with caplog.at_level(logging.INFO, logger="tierzero.engine.init.context"):
        whole = _run(tmp_path, "whole", tie)
    assert "Init: parameters partitioned" not in caplog.text
    assert under_init == whole
    assert under_init[-1] < under_init[0]
