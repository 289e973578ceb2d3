"""Shared pytest fixtures and the CUDA skip rule."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none (CPU-only torch)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
