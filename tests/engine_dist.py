"""Two-process gloo runs for the engine tests: spawn once, run several scenarios per spawn."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Scenario = Callable[[int], Any]  # rank -> picklable result


def _worker(rank: int, world: int, init_file: str, out_dir: str,
            scenarios: dict[str, Scenario]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        results = {name: fn(rank) for name, fn in scenarios.items()}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # both ranks are past their last collective
    finally:
        dist.destroy_process_group()
    # Results are on disk: leave without interpreter finalization. Gloo's worker threads
    # can still hold finished work objects whose tensors need the GIL to be freed; freeing
    # them while the interpreter tears down aborts the process ("terminate called without
    # an active exception", about 1 run in 20 under load, pytorch/pytorch#179291). A
    # failing scenario raises above and exits through mp.spawn's normal error path.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_two_ranks(tmp: Path, scenarios: dict[str, Scenario]) -> list[dict[str, Any]]:
    """Run every scenario on two gloo ranks; returns each rank's {name: result}."""
    mp.spawn(_worker, args=(2, str(tmp / "pg_init"), str(tmp), scenarios), nprocs=2,
             join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]
