"""Child process of test_ckpt_offload_memory: train one step with the optimizer state on
NVMe, then save and load a checkpoint; report the peak RSS growth of each as JSON.

    python tests/ckpt_offload_memory_child.py TMP_DIR UNITS DIM
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import psutil
import torch
from engine_helpers import make_config
from engine_memory_child import PeakSampler

from tierzero import engine
from tierzero.engine.config.schema import OffloadConfig, OptimizerOffloadConfig, ParamOffloadConfig


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
        rss = psutil.Process().memory_info
        base_save = rss().rss
        with PeakSampler() as save:
            path = eng.save_checkpoint(tmp / "ck")
        assert isinstance(path, Path)
        size = (path / "rank00000.safetensors").stat().st_size
        base_load = rss().rss
        with PeakSampler() as load:
            eng.load_checkpoint(tmp / "ck")
    finally:
        eng.close()
    print(json.dumps({"save": save.peak - base_save, "load": load.peak - base_load,
                      "file_bytes": size}))


if __name__ == "__main__":
    main()
