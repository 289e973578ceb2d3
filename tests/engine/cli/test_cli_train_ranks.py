"""`torchrun -m tierzero train` with two gloo ranks: one metrics file, losses over both ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import read_metrics, write_config

ROOT = Path(__file__).resolve().parents[3]


def torchrun_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a torchrun child: this checkout importable, one thread per rank,
    and TMPDIR in the test's folder, where torchrun makes its log folder (it leaves it
    behind, in /tmp otherwise)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}


@pytest.mark.multiproc
def test_two_ranks_with_torchrun(tmp_path: Path) -> None:
    config = write_config(tmp_path, steps=3)
    env = torchrun_env(tmp_path)
    # --standalone: torchrun binds its own free port (a port probed here first could be
    # taken by another process before torchrun binds it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "tierzero", "train", str(config), "--no-progress"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(tmp_path)  # exactly one run directory: rank 0 writes, rank 1 does not
    assert rows[0]["world_size"] == 2
    steps = [r for r in rows if r["event"] == "step"]
    assert len(steps) == 3
    assert all(r["tokens"] == 2 * 2 * 32 for r in steps)  # 2 ranks x micro batch 2 x 32 tokens
    assert json.dumps(rows[-1]).startswith('{"event": "end"')


@pytest.mark.multiproc
def test_two_ranks_split_examples_and_sum_the_eval(tmp_path: Path) -> None:
    """Packed examples with an evaluation set on two ranks: each rank trains and evaluates
    its own rows, and the eval loss is over both ranks' target tokens."""
    from data_helpers import write_jsonl

    from tierzero import engine
    from tierzero.engine.train import IGNORE, load_data

    data = write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": f"Q{i}: what comes after {i}?", "completion": f" {i + 1}."}
        for i in range(40)])
    config = write_config(tmp_path, steps=2, dataset=str(data), eval_fraction=0.25)
    env = torchrun_env(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "tierzero", "train", str(config), "--no-progress"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert rows[0]["world_size"] == 2 and rows[0]["data_mode"] == "pack"
    evals = [r for r in rows if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2]
    tc = engine.load_config(str(config)).train
    targets = 0
    for rank in range(2):  # what each rank evaluates: its own rows of the held-out split
        part = load_data(tc, micro=2, accum=1, seed=3, rank=rank, world=2)
        targets += sum(int((y != IGNORE).sum()) for _, y in part.eval)
    assert evals[0]["eval_tokens"] == evals[1]["eval_tokens"] == targets > 0
