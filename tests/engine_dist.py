"""Two-process gloo runs for the engine tests: spawn once, run several scenarios per spawn.

The ranks are forked from a fork server (multiprocessing's "forkserver", started once per
pytest session) that imported torch, torch._dynamo and tierzero and computed nothing: a
rank starts in a fraction of a second where a fresh interpreter spends ~5 s of a 2-core
machine on those imports (torch.optim imports torch._dynamo on first use, see
tests/fault_server.py). Each rank is still a new process that ran nothing before its
scenarios: it gets the parent's environment, working directory and sys.path as of the
run (checked: the tierzero it runs is the parent's), and writes to the parent's stdout and
stderr.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tierzero

Scenario = Callable[[int], Any]  # rank -> picklable result

# imported once in the fork server; all of them start no thread (fault_server.py checks the
# same imports before every fork)
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "tierzero", "tierzero.engine.cli"]


def start_fork_server() -> None:
    """Starts the fork server (once) with this process's sys.path as its PYTHONPATH, so its
    preloaded tierzero is the one this process imports (not an installed copy)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _parent() -> tuple[int, dict[str, str], str | None]:
    return os.getpid(), dict(os.environ), tierzero.__file__


def as_parent(parent: tuple[int, dict[str, str], str | None], fn: Callable[..., Any],
              *args: Any) -> Any:
    """A forked process's entry: the parent's environment as of the start (the server's is
    the one it started with) and its stdout and stderr as they are now (pytest's capture
    of the running test, as a spawned child would inherit them), then fn(*args)."""
    pid, env, tierzero_file = parent
    os.environ.clear()
    os.environ.update(env)
    for fd in (1, 2):
        try:
            new = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue  # the server's own stdout/stderr then
        os.dup2(new, fd)
        os.close(new)
    assert tierzero.__file__ == tierzero_file, (tierzero.__file__, tierzero_file)
    return fn(*args)


def _forked(rank: int, parent: tuple[int, dict[str, str], str | None],
            fn: Callable[..., None], *args: Any) -> None:
    as_parent(parent, fn, rank, *args)


def start_fresh(fn: Callable[..., None], *args: Any) -> multiprocessing.process.BaseProcess:
    """fn(*args) in a new process forked from the fork server (it ran nothing before),
    started and not waited for."""
    start_fork_server()
    proc = mp.get_context("forkserver").Process(target=as_parent, args=(_parent(), fn, *args))
    proc.start()
    return proc


def fresh_process(fn: Callable[..., None], *args: Any) -> int:
    """fn(*args) in a new process forked from the fork server; returns its exit code."""
    proc = start_fresh(fn, *args)
    proc.join()
    assert proc.exitcode is not None
    return proc.exitcode


def spawn_two(fn: Callable[..., None], *args: Any) -> None:
    """mp.spawn(fn, args, nprocs=2, join=True) with ranks forked from the fork server."""
    start_fork_server()
    mp.start_processes(_forked, args=(_parent(), fn, *args),
                       nprocs=2, join=True, start_method="forkserver")


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
    spawn_two(_worker, 2, str(tmp / "pg_init"), str(tmp), scenarios)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]
