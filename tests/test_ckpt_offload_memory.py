"""Saving and loading NVMe-offloaded state streams one shard at a time: the process's
resident memory (psutil RSS, sampled every millisecond by a thread) grows by about one
shard, never by the offloaded state.

Model: 8 units of one 2048x2048 Linear (4.2M fp32 elements each, 16.8 MB per shard kind),
master + exp_avg + exp_avg_sq on NVMe: 403 MB of state written, then read back. Bound:
3 shards (the shard in hand, the CRC pass's 16 MB read buffer, allocator slack) + 32 MB
for Python and safetensors header objects = 82 MB, a fifth of the state. Page cache is not
RSS, so the file writes themselves do not count.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import torch
from engine_helpers import make_config

from tierzero import engine
from tierzero.engine.config.schema import OffloadConfig, OptimizerOffloadConfig, ParamOffloadConfig

UNITS, DIM = 8, 2048
SHARD_BYTES = DIM * DIM * 4


class PeakRss:
    """Highest RSS seen while the block runs, minus the RSS at entry."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self.base = 0
        self.peak = 0
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.001)

    def __enter__(self) -> PeakRss:
        self.base = self.peak = self._proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _engine(swap: Path) -> engine.ZeroEngine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(DIM, DIM, bias=False) for _ in range(UNITS)))
    cfg = make_config(units=("Linear",))
    swap.mkdir()
    cfg = replace(cfg, offload=OffloadConfig(
        params=ParamOffloadConfig(device="cpu"),
        optimizer=OptimizerOffloadConfig(device="nvme", path=str(swap))))
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    x = torch.randn(4, DIM)
    eng.backward(eng(x).square().mean())
    eng.step()  # every buffer the step uses exists now: the baseline holds them
    return eng


def test_nvme_state_save_and_load_hold_one_shard_at_a_time(tmp_path: Path) -> None:
    state_bytes = 3 * UNITS * SHARD_BYTES
    bound = 3 * SHARD_BYTES + (32 << 20)
    eng = _engine(tmp_path / "swap")
    try:
        with PeakRss() as save:
            path = eng.save_checkpoint(tmp_path / "ck")
        assert isinstance(path, Path)
        assert (path / "rank00000.safetensors").stat().st_size > state_bytes
        with PeakRss() as load:
            eng.load_checkpoint(tmp_path / "ck")
    finally:
        eng.close()
    assert save.growth < bound, (save.growth, bound, state_bytes)
    assert load.growth < bound, (load.growth, bound, state_bytes)
