"""Saving and loading NVMe-offloaded state streams one shard at a time: the process's
resident memory (psutil RSS, sampled every millisecond by a thread) grows by a few
shards, never by the offloaded state.

Model: 8 units of one 2048x2048 Linear (4.2M fp32 elements each, 16.8 MB per shard kind),
master + exp_avg + exp_avg_sq on NVMe: 403 MB of state written, then read back. Bound:
5 shards + 32 MB for Python and safetensors header objects = 116 MB, under the 134 MB of
one kind's eight shards and the state's 403 MB. Measured: 3 to 5 shards (50-84 MB over
seven runs on this AMD EPYC, the 84.3 MB one inside a full suite run, where the earlier
bound of 3 shards failed): the shard in hand, the CRC pass's 16 MB read buffer and the store's
staging buffers, of which timing decides how many are held at the peak. Page cache is not
RSS, so the file writes themselves do not count. Measured in a child process
(tests/ckpt_offload_memory_child.py) with MALLOC_MMAP_THRESHOLD_ = 1 MiB, for the reason
given in test_engine_offload_memory: glibc's dynamic threshold otherwise keeps freed
shard-sized buffers in its heap and RSS measures the allocator, not the engine.
"""

from __future__ import annotations

from pathlib import Path

from memory_child import run_memory_child

UNITS, DIM = 8, 2048
SHARD_BYTES = DIM * DIM * 4


def test_nvme_state_save_and_load_hold_one_shard_at_a_time(tmp_path: Path) -> None:
    state_bytes = 3 * UNITS * SHARD_BYTES
    bound = 5 * SHARD_BYTES + (32 << 20)
    assert bound < UNITS * SHARD_BYTES  # one kind held whole would fail
    r = run_memory_child("ckpt_offload_memory_child.py", tmp_path, UNITS, DIM)
    assert r["file_bytes"] > state_bytes
    assert r["save"] < bound, (r, bound, state_bytes)
    assert r["load"] < bound, (r, bound, state_bytes)
