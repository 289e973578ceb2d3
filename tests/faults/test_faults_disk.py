"""Disk space (issue 21): a swap file system with 1.5x the need is accepted and trains to the
end, a too small one is refused naming path, free space and need, and a file system that
fills mid-run ends in one line with the last checkpoint loadable.

Size-limited file systems are tmpfs mounts of an exact size (needs mount rights: root, or
CAP_SYS_ADMIN; skipped with the reason otherwise). The swap file's ENOSPC on write goes
through the FileIO seam (swap/fileio.py)."""

from __future__ import annotations

import errno
import math
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tierzero import engine
from tierzero.engine.cli import main
from tierzero.engine.config import load_config
from tierzero.engine.train.model_source import build_model
from tierzero.swap.fileio import FileIO

pytestmark = pytest.mark.faults

Mount = Callable[[int], Path]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Mount]:
    """mount(size_bytes) -> a fresh directory on a tmpfs of exactly that size."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        size = math.ceil(size / 4096) * 4096
        got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                              str(where)], check=False, capture_output=True, text=True)
        if got.returncode != 0:
            pytest.skip(f"cannot mount a {size}-byte tmpfs here ({got.stderr.strip()}); "
                        "needs root or CAP_SYS_ADMIN")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def _settings(swap: Path, **train: Any) -> dict[str, Any]:
    return {
        "seed": 2, "precision": "fp32", "gradient_clipping": 1.0,
        "optimizer": {"type": "adamw", "lr": 3.0e-3},
        "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
        "logging": {"level": "warning"},
        "offload": {"device": "nvme", "path": str(swap)},
        "train": {"model": "builtin:tiny", "seq_len": 32, **train},
    }


def _write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _need(tmp_path: Path) -> int:
    """What the planner says the swap file grows to for the test's run."""
    where = tmp_path / "plan"
    where.mkdir()
    cfg = load_config(_settings(where))
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=build_model("builtin:tiny", 32), config=cfg)
    try:
        need: int = eng.store.manager.plan.swap_file_bytes()  # type: ignore[union-attr]
    finally:
        eng.close()
    assert need > 0
    return need


def test_disk_with_one_and_a_half_times_the_need_trains_to_the_end(
        tmp_path: Path, small_fs: Mount) -> None:
    swap = small_fs(int(1.5 * _need(tmp_path)))
    cfg = _write(tmp_path, _settings(swap, steps=4, out_dir=str(tmp_path / "runs")))
    assert main(["train", str(cfg), "--no-progress"]) == 0
    assert not list(swap.rglob("*.swp"))


def test_too_small_disk_is_refused_naming_path_free_space_and_need(
        tmp_path: Path, small_fs: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    need = _need(tmp_path)
    swap = small_fs(need // 2)
    cfg = _write(tmp_path, _settings(swap, steps=2, out_dir=str(tmp_path / "runs")))
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"not enough disk space for the swap file in {swap}" in err, err
    assert f"grows to {need} bytes" in err and "bytes free" in err
    assert "offload.budgets.nvme_reserve_fraction" in err


def test_disk_filling_mid_run_is_one_line_and_the_last_checkpoint_loads(
        tmp_path: Path, small_fs: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    need = _need(tmp_path)
    n_params = sum(p.numel() for p in build_model("builtin:tiny", 32).parameters())
    per_checkpoint = 3 * 4 * n_params  # master, exp_avg, exp_avg_sq in fp32
    fs = small_fs(int(1.5 * need + 2.5 * per_checkpoint))
    swap, ck = fs / "swap", fs / "ck"
    swap.mkdir()
    cfg = _write(tmp_path, _settings(swap, steps=50, checkpoint_interval=1,
                                     checkpoint_dir=str(ck), out_dir=str(tmp_path / "runs")))
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"the file system at {fs} " in err and "is full" in err and "Nothing was lost" in err
    latest = (ck / "latest").read_text()
    assert f"the last good checkpoint is {ck / latest}" in err, err
    state = engine.consolidate(ck)  # latest loads, every CRC checked
    assert state and all(torch.isfinite(t).all() for t in state.values())
    assert not [p for p in ck.iterdir() if p.name.endswith(".partial")]
    assert not list(swap.rglob("*.swp"))


class FullOnWrite(FileIO):
    """Every pwrite after the first `allowed` fails with ENOSPC."""

    def __init__(self, allowed: int) -> None:
        self.left = allowed

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        self.left -= 1
        if self.left < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().pwrite(fd, buf, offset)


def test_swap_write_enospc_mid_run_is_one_line(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from tierzero.swap import store as store_mod

    real_init = store_mod.SwapStore.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["fileio"] = FullOnWrite(allowed=200)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(store_mod.SwapStore, "__init__", init)
    swap = tmp_path / "swap"
    swap.mkdir()
    ck = tmp_path / "ck"
    cfg = _write(tmp_path, _settings(swap, steps=200, checkpoint_interval=2,
                                     checkpoint_dir=str(ck), out_dir=str(tmp_path / "runs")))
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    lines = [ln for ln in err.splitlines() if ln.startswith("tierzero train:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "is full: the swap file could not be written (ENOSPC)" in err, err
    assert ".scratch.swp" in err and "Nothing was lost" in err
    assert not list(swap.rglob("*.swp"))


@pytest.mark.parametrize("where", ["settle", "close"])
def test_close_raises_a_failed_deferred_update_after_removing_the_swap_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A write that failed in the optimizer's update (as one into a full swap file does),
    raised where the engine settles the update or where it closes the update's stream, is
    raised by eng.close() only once the threads are stopped and the swap files removed:
    `tierzero train` exits with its one line and leaves no scratch file behind. Before,
    close() raised from either and never closed the store."""
    from engine_helpers import make_batches, make_config, make_model, offload_config, train_steps

    eng, _, _, _ = engine.initialize(
        model=make_model(), config=offload_config(make_config(clip=1.0), "nvme", tmp_path),
        device="cpu")
    train_steps(eng, make_batches(2))
    assert list(tmp_path.rglob("*.scratch.swp"))
    driver = eng.step_driver
    real = getattr(driver, where)

    def failing(**kwargs: Any) -> None:
        real(**kwargs)
        raise RuntimeError("the deferred update failed: ENOSPC")

    monkeypatch.setattr(driver, where, failing)
    with pytest.raises(RuntimeError, match="deferred update failed"):
        eng.close()
    assert not list(tmp_path.rglob("*.scratch.swp"))
    eng.close()  # closed: idempotent, nothing raised again
    with pytest.raises(RuntimeError, match="engine is closed"):
        eng.step()
