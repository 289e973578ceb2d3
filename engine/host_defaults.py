"""Defaults of device-memory bounds when the compute device is the CPU (host memory).

[Note: CPU compute defaults] Three bounds are sized for an accelerator's memory: the
gathered parameter bytes kept between a unit's forward and its backward
(zero.max_live_bytes, zero.max_reuse_distance_bytes: 2 GB each, DeepSpeed's 1e9 elements
x 2 B) and the device tier's budget (offload.budgets.device_bytes: detected free device
memory). On a CPU compute device every one of them is host memory beside the tier
manager's host budget, so defaults that are harmless on a GPU become gigabytes of RSS that
grow with the model (benchmarks/RESULTS.md has the 2.07B runs before and after). When the
user leaves them unset (null) and the device is not CUDA, they are sized to what the
schedule needs instead:

  zero.max_live_bytes           the bytes that stay gathered through forward anyway (the
                                root unit and the persistent units) + the largest other
                                unit: one unit may stay gathered for its backward.
  zero.max_reuse_distance_bytes the largest unit's gathered bytes: a unit is kept only when
                                at most half a unit is gathered between its forward and its
                                backward ([Note: reuse distance] in reuse.py counts both
                                directions), which is the last unit of forward, the first
                                of backward: the one FSDP2 also keeps (it does not reshard
                                the root, and its last block's backward follows at once).
                                Every other unit is read again in backward: its NVMe bytes
                                once more per step, read ahead by the prefetch window.
  offload.budgets.device_bytes  the device-homed shards (offload.*.device none), at least
                                the cache room placement reserves (one of the largest
                                param or gradient shard homed below). A param homed below
                                is gathered from its host copy, not fetched to the device
                                first ([Note: params gathered from host memory] in
                                shards/tiered.py): a device cache on a CPU would only copy
                                a host cache. (A dry run on meta planning a CUDA machine
                                fetches params to the device: two of the largest, the one
                                being gathered and the next.) With an `auto` home the
                                planner fills the device tier from its budget, so there
                                it stays the available memory.

With CUDA the GPU-sized defaults stay (2 GB; free device memory). A value the user sets,
including through DeepSpeed's stage3_max_live_parameters / stage3_max_reuse_distance,
always wins. `tierzero plan` applies the same rule to its dry run when it plans a machine
without CUDA (engine/plan/dry_run.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tierzero.engine.config.schema import ZeroConfig

if TYPE_CHECKING:  # schedule.py imports the shard store, which imports this module
    from tierzero.engine.unit import Unit

# Default gather bounds with CUDA: DeepSpeed's 1e9 elements of a 2-byte compute dtype.
GPU_GATHER_BYTES = 2_000_000_000


def engine_device(device: torch.device | None) -> torch.device:
    """`device`, a CUDA device given without an index made the current one (threads that
    make it theirs, as layer-major's, need the index); None: the current CUDA device, else
    the CPU."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_is_host(device: torch.device) -> bool:
    """The compute device's memory is host memory: no CUDA (a CPU run, or a dry run on meta
    planning one)."""
    return device.type != "cuda"


def gather_bounds(z: ZeroConfig, device: torch.device, units: Sequence[Unit]
                  ) -> tuple[int, int]:
    """(max_live_bytes, max_reuse_distance_bytes) for the scheduler of `units` on `device`
    ([Note: CPU compute defaults]): the zero section's values where set."""
    full = {u.index: sum(g.padded_numel * g.full.element_size() for g in u.groups)
            for u in units}
    always = sum(full[u.index] for u in units if u.is_root or u.persistent)
    largest = max((full[u.index] for u in units if not (u.is_root or u.persistent)),
                  default=0)
    host = device_is_host(device)
    live = always + largest if host else GPU_GATHER_BYTES
    reuse = largest if host else GPU_GATHER_BYTES
    return (live if z.max_live_bytes is None else z.max_live_bytes,
            reuse if z.max_reuse_distance_bytes is None else z.max_reuse_distance_bytes)


def cpu_device_budget(*, homed: int, fetched: Sequence[int], reserve: int) -> int:
    """The CPU stand-in device tier's default budget ([Note: CPU compute defaults]):
    `homed` bytes of shards homed on the device + two of the largest of the `fetched`
    shards, and at least the placement's cache reserve (`reserve`: the largest shard it
    may cache there, offload/placement.py); at least one byte, a budget must be positive."""
    return max(1, homed + max(2 * max(fetched, default=0), reserve))
