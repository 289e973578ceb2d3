"""Child process of test_ckpt_offload_memory: train one step with the optimizer state on
NVMe, then save and load a checkpoint; report the peak RSS growth of each as JSON.

    python tests/ckpt_offload_memory_child.py TMP_DIR UNITS DIM
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import torch
from engine_helpers import make_config

from tierzero import engine
from tierzero.engine.config.schema import OffloadConfig, OptimizerOffloadConfig, ParamOffloadConfig


class PeakRss:
    """Highest RSS seen while the block runs, minus the RSS at entry (sampled every ms)."""

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
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.base


def main() -> None:
    tmp, units, dim = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(dim, dim, bias=False) for _ in range(units)))
    cfg = make_config(units=("Linear",))
    swap = tmp / "swap"
    swap.mkdir()
    cfg = replace(cfg, offload=OffloadConfig(
        params=ParamOffloadConfig(device="cpu"),
        optimizer=OptimizerOffloadConfig(device="nvme", path=str(swap))))
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    try:
        x = torch.randn(4, dim)
        eng.backward(eng(x).square().mean())
        eng.step()  # every buffer the step uses exists now: the baseline holds them
        with PeakRss() as save:
            path = eng.save_checkpoint(tmp / "ck")
        assert isinstance(path, Path)
        size = (path / "rank00000.safetensors").stat().st_size
        with PeakRss() as load:
            eng.load_checkpoint(tmp / "ck")
    finally:
        eng.close()
    print(json.dumps({"save": save.growth, "load": load.growth, "file_bytes": size}))


if __name__ == "__main__":
    main()
