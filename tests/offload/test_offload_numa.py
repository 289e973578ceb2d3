"""offload.numa: a logged no-op on one node, real binding on several."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import torch

from tierzero.offload import numa


@pytest.fixture
def fresh_caches() -> Iterator[None]:
    caches = (numa._libnuma, numa.node_count, numa._single_node_reason)
    for fn in caches:
        fn.cache_clear()
    yield
    for fn in caches:
        fn.cache_clear()


def test_node_zero_has_this_process_cpus() -> None:
    assert numa.node_count() >= 1
    cpus = numa.cpus_of_node(0)
    assert cpus
    if numa.node_count() == 1:
        assert set(cpus) == os.sched_getaffinity(0)


def test_unknown_node_is_refused_with_range() -> None:
    expected = r"NUMA node 99 does not exist; this machine has nodes 0\.\."
    with pytest.raises(ValueError, match=expected):
        numa.bind_current_thread(99)


def test_local_to_restores_affinity() -> None:
    before = os.sched_getaffinity(0)
    with numa.local_to(0) as bound:
        torch.zeros(1 << 16).add_(1)
    assert bound == (numa.node_count() > 1)
    assert os.sched_getaffinity(0) == before
    with numa.local_to(None) as bound_none:
        assert bound_none is False


def test_single_node_binding_is_logged_noop(
    fresh_caches: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(numa, "_libnuma", lambda: None)
    with caplog.at_level(logging.INFO, logger="tierzero.offload.numa"):
        assert numa.node_count() == 1
        assert numa.bind_current_thread(0) is False
        assert numa.bind_current_thread(0) is False
    notes = [r.getMessage() for r in caplog.records if "no-op" in r.getMessage()]
    assert notes == ["NUMA binding is a no-op here (libnuma unavailable)"]


def test_cuda_device_node_without_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("covered by the cuda test on GPU machines")
    assert numa.cuda_device_node(0) is None


@pytest.mark.cuda
def test_cuda_device_node_on_gpu() -> None:
    node = numa.cuda_device_node(0)
    assert node is None or 0 <= node < max(numa.node_count(), 1) + 64
