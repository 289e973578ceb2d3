"""Memory: a ~100M-parameter model built under engine.Init with params on NVMe never holds
its parameter slices in host memory, and the whole build + initialize + one step stays
under host and device budgets well below its state. Values equal a plain build (bitwise).

Model: 100.7M parameters (tests/engine_memory_child.py's MLP, 24 blocks of width 724).
Its param (bf16) + master + moments = 14 B/param = 1.41 GB, on NVMe; host budget 800 MiB
(fp32 gradient shards, 403 MB, live in host memory; NVMe staging pool; the CPU Adam's
pipeline buffers), device budget 64 MiB (the CPU stand-in tier).

Bounds on peak RSS growth over the child's RSS before the build, once the first torch
optimizer's own imports are paid (torch._dynamo and sympy, the same whatever the model;
`base_rss` in the child):
  * Init (construction): zero.init_live_bytes (32 MiB of live fp32 parameters) + the
    staging writes in flight (engine.init_staging.INFLIGHT_BYTES, 64 MiB) + 64 MiB of
    interpreter and allocator slack = 160 MiB. Keeping the fp32 slices in host memory, as
    Init did before, would be 384 MiB on its own. Measured: 93 MiB.
  * initialize + one step: the budgets + 64 MiB overhead (gathered units, activations,
    bounce blocks, thread stacks; 128 MiB when it held the optimizer's imports too).
    Measured: 436 / 514 MiB.

MALLOC_MMAP_THRESHOLD_ = 1 MiB for the reason given in test_engine_offload_memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from memory_child import MiB, run_memory_child

HOST_BUDGET = 800 * MiB
DEVICE_BUDGET = 64 * MiB
INIT_BOUND = (32 + 64 + 64) * MiB
OVERHEAD = 64 * MiB
BLOCKS, DIM = 24, 724


@pytest.mark.slow
def test_init_onto_nvme_peak_rss(tmp_path: Path) -> None:
    r = run_memory_child("ckpt_init_memory_child.py", tmp_path, BLOCKS, DIM, HOST_BUDGET,
                         DEVICE_BUDGET)
    n = r["n_params"]
    assert 95e6 < n < 105e6
    state = n * (2 + 4 + 8)  # param + master + moments
    assert state > 1.5 * (HOST_BUDGET + DEVICE_BUDGET)
    assert r["init_nvme_bytes"] >= 4 * n  # every fp32 slice went to NVMe
    grow = {k: r[k] - r["base_rss"] for k in ("init_peak", "setup_peak", "step_peak")}
    assert grow["init_peak"] < INIT_BOUND < 4 * n, grow
    for k in ("setup_peak", "step_peak"):
        assert grow[k] < HOST_BUDGET + DEVICE_BUDGET + OVERHEAD, (k, grow)
    assert r["unequal"] == []  # every parameter as a plain build with the same seed
    assert r["tiers"]["current"]["nvme"] >= state


# No settings at all (no budgets, every zero.* bound at its default; issue 32): the
# issue's bound is 0.12 of the 16 B/param state for a model built under Init in bf16, over
# the RSS once the first torch optimizer's imports are paid (base_rss; the NVMe pool, the
# CPU Adam's ring, the CPU stand-in device tier of [Note: CPU compute defaults], the
# gathered unit and its gradients; RESULTS.md has the split). A host gradient home alone
# would be 0.25. Measured with the defaults: bf16 0.091 (the build 0.059; it was 0.205
# with zero.init_live_bytes' old 256 MiB default), fp32 0.137. fp32 compute keeps the
# param shards in the staging pool and the device tier, the gathered unit and its
# gradients at 4 B instead of 2 (host tier 84 MB against 42, device tier 34 against 17):
# no zero.* knob brings it to 0.12 (the tuned knobs of the test above measure the same),
# so it is bounded at 0.16 (docs/engine.md, "Host memory with no settings").
INIT_NO_SETTINGS_BOUND = {"bf16": 0.12, "fp32": 0.16}
# the same runs measured from the RSS after the imports, the optimizer's included
# (measured: bf16 0.137, fp32 0.183)
INIT_NO_SETTINGS_IMPORTED_BOUND = {"bf16": 0.15, "fp32": 0.2}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_init_onto_nvme_with_no_settings(tmp_path: Path, precision: str) -> None:
    r = run_memory_child("ckpt_init_memory_child.py", tmp_path, BLOCKS, DIM, "none", "none",
                         "defaults", precision)
    n = r["n_params"]
    peak = max(r[k] for k in ("init_peak", "setup_peak", "step_peak"))
    grow = peak - r["base_rss"]
    assert grow <= INIT_NO_SETTINGS_BOUND[precision] * 16 * n, (grow / MiB, r["tiers"])
    assert peak - r["imported_rss"] <= INIT_NO_SETTINGS_IMPORTED_BOUND[precision] * 16 * n
    # the CPU stand-in device tier's default budget: two param shards of a block (each
    # 2 x 724 x 2896 weights + biases, in the compute dtype) ([Note: CPU compute defaults])
    size = 2 if precision == "bf16" else 4
    assert r["tiers"]["peak"]["device"] <= 2 * size * (2 * DIM * 4 * DIM + 5 * DIM) + 2 * 4096
    assert r["tiers"]["grad_home"] == "nvme"
    assert r["unequal"] == []
