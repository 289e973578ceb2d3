"""Memory: a ~100M-parameter model with params and optimizer state on NVMe trains under host
and device budgets well below its model state, and the process's peak RSS growth stays
under those budgets plus a stated overhead.

Model state: 100.7M params x (2 bf16 param + 4 master + 4 grad + 8 moments) = 1.81 GB.
Budgets: host 800 MiB (fp32 grad shards 403 MB, NVMe staging pool, the CPU Adam's three
pipeline buffer sets), device 64 MiB (the CPU stand-in tier's param caches).

Overhead allowed beyond the budgets: 128 MiB for what the tier manager does not own —
gathered units (bf16 full buffers, 8.4 MB each, two or three live) and their `.grad`,
activations (batch 8), the swap I/O threads' bounce blocks (8 x 4 MiB of address space,
touched only for unaligned data), thread stacks.
Measured here: 58 MiB.

The child runs with MALLOC_MMAP_THRESHOLD_ = 1 MiB. glibc's default *dynamic* mmap
threshold rises to the largest block freed (up to 32 MiB), after which freed shard-sized
blocks stay in the heap and count in RSS though unused: ~300 MB more here. Setting it is
what we recommend to users with tight host budgets (docs/engine.md).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from memory_child import MiB, run_memory_child

HOST_BUDGET = 800 * MiB
DEVICE_BUDGET = 64 * MiB
OVERHEAD = 128 * MiB
BLOCKS, DIM = 24, 724  # 24 x (2 x 724 x 2896 + biases) + head = 100.7M parameters


@pytest.mark.multiproc
def test_nvme_offload_peak_rss_within_budgets(tmp_path: Path) -> None:
    r = run_memory_child("engine_memory_child.py", tmp_path, BLOCKS, DIM, HOST_BUDGET,
                         DEVICE_BUDGET)
    n = r["n_params"]
    assert 95e6 < n < 105e6
    model_state = n * (2 + 4 + 4 + 8)
    assert model_state > 2 * (HOST_BUDGET + DEVICE_BUDGET)  # budgets well below the state
    growth = r["train_peak_rss"] - r["base_rss"]
    assert growth <= HOST_BUDGET + DEVICE_BUDGET + OVERHEAD, (
        f"peak RSS grew {growth / MiB:.0f} MiB; budgets {(HOST_BUDGET + DEVICE_BUDGET) / MiB:.0f}"
        f" MiB + overhead {OVERHEAD / MiB:.0f} MiB", r)
    tiers = r["tiers"]
    # the state really lives on NVMe and moved through it every step
    assert tiers["current"]["nvme"] >= n * (2 + 4 + 8)
    assert tiers["moved"]["nvme_to_host"] >= 3 * n * (4 + 8)
    for t in ("host", "device"):
        assert tiers["peak"][t] <= tiers["budget"][t]
    assert all(math.isfinite(x) for x in r["losses"])  # training ran


# With no budget set (the shortest config a user writes) host memory must not follow the
# model: the gradient shards go to NVMe ([Note: gradient home]), the CPU Adam streams state in
# pieces of offload.optimizer.chunk_numel ([Note: optimizer state in chunks]) and the pool
# holds a few param shards. Bound (issue 15): peak RSS growth at most 0.35 of the 16 B/param
# state when the model is built normally (its fp32 parameters, 0.25 of it, are freed once
# partitioned). Measured here: 0.20 (313 MiB: pool 40 MB, CPU stand-in device tier 34 MB,
# Adam ring + param assembly 57 MB, the rest gathered units and their .grad, activations,
# I/O threads); 0.50 before (host gradients 403 MB, a ring of 4 whole shards 226 MB).
NO_BUDGET_BOUND = 0.35


@pytest.mark.multiproc
def test_nvme_offload_without_budgets_is_bounded_by_the_buffers(tmp_path: Path) -> None:
    r = run_memory_child("engine_memory_child.py", tmp_path, BLOCKS, DIM, "none", "none")
    n = r["n_params"]
    growth = r["train_peak_rss"] - r["base_rss"]
    assert growth <= NO_BUDGET_BOUND * 16 * n, (growth / MiB, r["tiers"])
    tiers = r["tiers"]
    assert tiers["grad_home"] == "nvme"  # clipping on: the gradients outlive backward
    # the stream's buffers are counted by the tier manager and set by four pieces or one
    # unit's streamed state ([Note: the ring's floor]), not four whole shards (4 x 59 MB)
    assert 0 < tiers["outside"]["adam_ring"] <= 4 * 3 * 4 * (1 << 20) + 3 * 4096 * 4
    assert all(math.isfinite(x) for x in r["losses"])
