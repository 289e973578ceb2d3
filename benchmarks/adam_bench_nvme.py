"""The NVMe part of adam_bench.py: pipelined_step over a swap.SwapStore.

Three methods, interleaved, on the same shards and the same three buffer sets:
  adam_only   the Adam kernel over every shard, state already in host buffers;
  disk_only   the same fetch/store schedule (fetch i+1, store i-1) with no compute;
  pipelined   offload.pipelined_step: fetch, update and store overlapped.
Target: pipelined <= 1.15 x max(adam_only, disk_only).
Per parameter the disk moves 14 B in (fp32 master, m, v + bf16 grad) and
14 B out (fp32 master, m, v + bf16 param).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from tierzero.offload import (
    AdamHyper,
    AdamThreads,
    ShardBuffers,
    ShardLayout,
    SwapShardStore,
    Transfer,
    adam_update,
    pipelined_step,
)
from tierzero.swap import SwapStore

DISK_BYTES_PER_PARAM = 28


def _disk_only(store: SwapShardStore, sets: list[ShardBuffers]) -> None:
    numels = store.layout.numels
    free = deque(sets)
    fetches: deque[tuple[ShardBuffers, Transfer]] = deque()
    stores: deque[tuple[ShardBuffers, Transfer]] = deque()
    nxt = 0
    for pos in range(len(numels)):
        while nxt < len(numels) and nxt <= pos + len(sets) - 2:
            if not free:
                full, tr = stores.popleft()
                tr.wait()
                free.append(full)
            full = free.popleft()
            fetches.append((full, store.fetch(nxt, full.view(numels[nxt]))))
            nxt += 1
        full, tr = fetches.popleft()
        stores.append((full, store.store(pos, tr.wait())))
    for _, tr in stores:
        tr.wait()


def nvme_section(directory: Path, *, n: int, shards: int, threads: int, repeats: int,
                 hyper: AdamHyper) -> dict[str, Any]:
    numels = tuple(n // shards + (1 if i < n % shards else 0) for i in range(shards))
    layout = ShardLayout(numels, grad_dtype=torch.bfloat16, param16_dtype=torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    print(f"\n== NVMe pipeline: {n:,} params in {shards} shards under {directory}, "
          f"{threads} Adam thread(s)")
    with AdamThreads(threads) as pool, SwapStore(directory) as ss:
        store = SwapShardStore(ss, layout)
        # Host copies of every shard for adam_only: the same bytes the pipeline streams.
        host = [ShardBuffers.allocate(store, k) for k in numels]
        for i, (k, h) in enumerate(zip(numels, host, strict=True)):
            h.master.copy_(torch.randn(k) * 0.1)
            h.exp_avg.zero_()
            h.exp_avg_sq.zero_()
            h.grad.copy_(torch.randn(k) * 1e-3)
            futs = [store.put(i, name, getattr(h, name))
                    for name in ("master", "exp_avg", "exp_avg_sq", "grad")]
            for f in futs:
                f.result()
        sets = [ShardBuffers.allocate(store, max(numels)) for _ in range(3)]
        for s in sets:
            pool.first_touch(s.master)
            pool.first_touch(s.exp_avg)
            pool.first_touch(s.exp_avg_sq)
            s.grad.zero_()
        step = [0]

        def adam_only() -> None:
            step[0] += 1
            for b in host:
                adam_update(b.master, b.exp_avg, b.exp_avg_sq, b.grad, hyper=hyper,
                            step=step[0], shadow=b.param16, threads=pool)

        def disk_only() -> None:
            _disk_only(store, sets)

        def pipelined() -> None:
            step[0] += 1
            stats = pipelined_step(store, hyper=hyper, step=step[0], threads=pool,
                                   buffer_sets=sets)
            stats_log.append(stats)

        stats_log: list[Any] = []
        methods = {"adam_only": adam_only, "disk_only": disk_only, "pipelined": pipelined}
        for fn in methods.values():
            fn()  # warm-up: first write of every region, page faults
        times: dict[str, list[float]] = {k: [] for k in methods}
        names = list(methods)
        for r in range(repeats):
            for name in names[r % 3:] + names[:r % 3]:
                t = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - t)
        direct = ss.direct
    med = {k: statistics.median(v) for k, v in times.items()}
    bound = max(med["adam_only"], med["disk_only"])
    result = {
        "params": n, "shards": shards, "threads": threads, "o_direct": direct,
        "median_s": med, "all_s": times,
        "disk_gb_s": DISK_BYTES_PER_PARAM * n / med["disk_only"] / 1e9,
        "ratio_to_max_adam_disk": med["pipelined"] / bound,
        "last_pipeline_stats": vars(stats_log[-1]) if stats_log else None,
    }
    print(f"   O_DIRECT={direct}  adam_only {med['adam_only']:.3f} s   disk_only "
          f"{med['disk_only']:.3f} s ({result['disk_gb_s']:.2f} GB/s)   pipelined "
          f"{med['pipelined']:.3f} s   -> {result['ratio_to_max_adam_disk']:.2f} x "
          "max(adam, disk) (target <= 1.15)")
    return result
