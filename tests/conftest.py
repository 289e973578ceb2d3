"""Shared pytest fixtures and the CUDA skip rule."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from fault_helpers import Server


def pytest_configure(config: pytest.Config) -> None:
    """torch's intra-op threads (OpenMP) wait for work spinning, not sleeping, by default.
    The suite's xdist workers (`make unit`, one per core) each run such a pool of one
    thread per core, and the processes tests start run their own: on a 2-core machine
    the spinning took about half the suite's CPU time. OMP_WAIT_POLICY=PASSIVE lets a
    waiting thread sleep; it changes no result (thread counts, and with them every
    reduction's order, stay torch's defaults). Set here, in the process that starts the
    workers, before any of them loads OpenMP; the environment's own setting wins."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none (CPU-only torch)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fault_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Forks `tierzero` processes from one interpreter that imported tierzero (the faults
    tests' real runs: tests/fault_server.py)."""
    s = Server(tmp_path_factory.mktemp("fault_server"))
    yield s
    s.close()
