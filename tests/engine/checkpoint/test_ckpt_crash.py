"""kill -9 of a saving process at random points never damages the last good checkpoint.

Each child trains a 1M-parameter model and saves after every step (t0, t1, ...); the
parent kills each with SIGKILL after a random delay (several children, started together).
Afterwards `latest` must name a complete checkpoint whose every file matches its manifest
(size and CRC-32) and which loads. At least one run must have been killed inside a save
(a .partial directory left behind), or the test did not exercise what it claims.
"""

from __future__ import annotations

import random
import signal
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
import torch
from ckpt_helpers import crash_child, crash_config
from engine_dist import start_fresh

from tierzero import engine
from tierzero.engine.checkpoint.layout import LATEST, load_manifest, resolve, verify_files

RUNS = 4


def _crash_child(ckpt: str, ready: str, offload: str, where: str | None,
                 background: bool) -> None:
    torch.set_num_threads(1)
    crash_child(ckpt, ready, offload, where, background)


def _start_child(ckpt: Path, ready: Path, offload: str = "none",
                 swap: Path | None = None, background: bool = False) -> BaseProcess:
    """crash_child in a new process forked from engine_dist's fork server (it starts in a
    fraction of a second instead of importing torch); its stderr is this process's."""
    where = str(swap) if swap is not None else None
    return start_fresh(_crash_child, str(ckpt), str(ready), offload, where, background)


def _wait_ready(proc: BaseProcess, ready: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if not proc.is_alive():
            raise RuntimeError(f"child exited with {proc.exitcode} before its first save "
                               "(its traceback is in the captured stderr)")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("child did not save its first checkpoint in time")
        time.sleep(0.02)  # waiting on another process's file: no event to block on


def _check_survivor(ckpt: Path) -> tuple[int, bool]:
    """Returns (latest step, whether a partial save was left behind)."""
    path = resolve(ckpt, None)
    manifest = load_manifest(path)
    verify_files(path, manifest)
    complete = sorted(int(p.name[1:]) for p in ckpt.iterdir()
                      if p.name.startswith("t") and (p / "manifest.json").is_file())
    latest = int(path.name[1:])
    # killed between publishing a checkpoint and updating `latest`: latest is one behind
    assert latest in complete[-2:], (latest, complete)
    for step in complete:
        tag_path = ckpt / f"t{step}"
        verify_files(tag_path, load_manifest(tag_path))
    partial = any(p.name.endswith(".partial") for p in ckpt.iterdir())
    return latest, partial


@pytest.mark.multiproc
@pytest.mark.parametrize(("offload", "background"),
                         [("none", False), ("nvme", False), ("nvme", True)])
def test_kill9_during_save_keeps_last_good_checkpoint(tmp_path: Path, offload: str,
                                                      background: bool) -> None:
    """offload nvme: the save streams shards out of the tier manager (and the kill may land
    inside a swap read): the same guarantees. background: the kill lands while a
    background writer copies kept swap regions out as the next step runs."""
    rng = random.Random(1234)
    dirs = [(tmp_path / f"run{r}", tmp_path / f"ready{r}") for r in range(RUNS)]
    swaps = [tmp_path / f"swap{r}" for r in range(RUNS)]
    for s in swaps:
        s.mkdir()
    procs = [_start_child(ckpt, ready, offload, swap, background)  # start-up overlaps
             for (ckpt, ready), swap in zip(dirs, swaps, strict=True)]
    partial_seen = 0
    for proc, (ckpt, ready) in zip(procs, dirs, strict=True):
        _wait_ready(proc, ready)
        time.sleep(rng.uniform(0.05, 0.6))
        proc.kill()  # SIGKILL
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        assert (ckpt / LATEST).is_file()
        _, partial = _check_survivor(ckpt)
        partial_seen += partial
    assert partial_seen > 0, "no kill landed inside a save; the test proved nothing"

    # the survivor of the last run loads into a fresh engine
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4)))
    (tmp_path / "swap-load").mkdir()
    eng, _, _, _ = engine.initialize(model=model, device="cpu", config=crash_config(
        offload, str(tmp_path / "swap-load")))
    path, _ = eng.load_checkpoint(tmp_path / f"run{RUNS - 1}")
    assert eng.global_steps == int(path.name[1:]) + 1
    eng.close()
