"""Shared pytest fixtures and the CUDA skip rule."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from fault_helpers import Server


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
