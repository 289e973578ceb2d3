"""Child of test_host_heap: build 40 Linear(1536, 1536) (377 MB of fp32 parameters, each
9.4 MB: below glibc's dynamic mmap threshold once it has risen) under engine.Init with
params on NVMe and zero.init_live_bytes 32 MiB; print the RSS growth after the build.

    python tests/host_heap_child.py SWAP_DIR
"""

from __future__ import annotations

import json
import sys

import psutil
import torch

from tierzero import engine


def main() -> None:
    torch.set_num_threads(2)
    cfg = engine.load_config({"zero": {"stage": 3, "init_live_bytes": 32 << 20},
                              "offload": {"params": {"device": "nvme", "path": sys.argv[1]}}})
    torch.nn.Linear(8, 8)  # torch's first-use allocations are not the build's
    base = psutil.Process().memory_info().rss
    with engine.Init(config=cfg):
        model = torch.nn.Sequential(*[torch.nn.Linear(1536, 1536) for _ in range(40)])
    growth = psutil.Process().memory_info().rss - base
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"growth": growth, "model_bytes": 4 * n}))


if __name__ == "__main__":
    main()
