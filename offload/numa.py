"""NUMA placement for host buffers and CPU worker threads, through py-libnuma.

On a machine with one NUMA node, or where libnuma cannot be loaded, every call
here is a no-op that logs its reason once: there is nothing to place. On a
multi-node machine, host buffers for a GPU should live on the GPU's node
(`cuda_device_node`) and the threads that fill or update them should run there
(`bind_current_thread`), so that pinned copies and CPU Adam read local DRAM.

Memory placement uses first touch: inside `local_to(node)` the calling thread
runs on the node's CPUs with the node as its preferred memory node, so pages
that thread touches first (allocation + zero fill) land on that node.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

__all__ = [
    "bind_current_thread",
    "cpus_of_node",
    "cuda_device_node",
    "local_to",
    "node_count",
]


@functools.lru_cache(maxsize=1)
def _libnuma() -> ModuleType | None:
    """The py-libnuma module when libnuma is usable here, else None (reason logged once)."""
    try:
        import numa  # py-libnuma; loads libnuma.so at import
    except Exception as exc:  # OSError/AttributeError when libnuma.so is absent
        log.info("NUMA placement off: py-libnuma/libnuma not usable (%s)", exc)
        return None
    if not numa.info.numa_available():
        log.info("NUMA placement off: the kernel reports NUMA unavailable")
        return None
    module: ModuleType = numa
    return module


@functools.lru_cache(maxsize=1)
def node_count() -> int:
    """Configured NUMA nodes on this machine (1 when libnuma is unusable)."""
    lib = _libnuma()
    return int(lib.info.get_num_configured_nodes()) if lib is not None else 1


@functools.lru_cache(maxsize=1)
def _single_node_reason() -> str:
    reason = "one NUMA node" if _libnuma() is not None else "libnuma unavailable"
    log.info("NUMA binding is a no-op here (%s)", reason)
    return reason


def cpus_of_node(node: int) -> list[int]:
    """CPU ids of `node`; on a one-node machine, the CPUs this process may use."""
    _check_node(node)
    lib = _libnuma()
    if lib is None or node_count() == 1:
        return sorted(os.sched_getaffinity(0))
    return [int(c) for c in lib.info.node_to_cpus(node)]


def bind_current_thread(node: int) -> bool:
    """Run the calling thread on `node`'s CPUs and prefer its memory.

    Returns False (a logged no-op) on a one-node machine or without libnuma.
    """
    _check_node(node)
    lib = _libnuma()
    if lib is None or node_count() == 1:
        _single_node_reason()
        return False
    lib.schedule.run_on_nodes(node)
    lib.schedule.set_preferred_node(node)
    return True


@contextmanager
def local_to(node: int | None) -> Iterator[bool]:
    """Allocate on `node` by first touch inside the block; yields whether binding applied.

    The thread's CPU affinity and memory policy are restored on exit. `None`
    (no known node, e.g. a CPU-only run) is a no-op.
    """
    if node is None:
        yield False
        return
    previous = os.sched_getaffinity(0)
    bound = bind_current_thread(node)
    try:
        yield bound
    finally:
        if bound:
            lib = _libnuma()
            if lib is not None:
                lib.memory.set_local_alloc()
            os.sched_setaffinity(0, previous)


def cuda_device_node(index: int) -> int | None:
    """NUMA node the CUDA device `index` is attached to, or None when unknown.

    Read from sysfs (`/sys/bus/pci/devices/<bus id>/numa_node`); the kernel
    reports -1 on machines without NUMA topology.
    """
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    props = torch.cuda.get_device_properties(index)
    # pci_* fields exist on CUDA builds of torch >= 2.5; older builds cannot tell.
    fields = [getattr(props, f"pci_{n}_id", None) for n in ("domain", "bus", "device")]
    ids = [f for f in fields if isinstance(f, int)]
    if len(ids) != 3:
        return None
    bus_id = f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0"
    path = Path("/sys/bus/pci/devices") / bus_id / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _check_node(node: int) -> None:
    count = node_count()
    if not 0 <= node < count:
        raise ValueError(f"NUMA node {node} does not exist; this machine has nodes 0..{count - 1}")
