"""The NVMe part of adam_bench.py: the engine's streamed CPU Adam (offload.AdamStream) over
a TierManager whose optimizer state lives in swap files.

Three methods, interleaved, on the same shards:
  adam_only   the Adam kernel over every shard, state already in host tensors;
  disk_only   the same bytes with no compute: each shard's state read from its swap
              files into host buffers and written back with a param, a few shards in
              flight;
  streamed    AdamStream.step + its writes drained (wait_idle): read, update, write
              overlapped, as the engine's step runs when nothing else is going on.
Target: streamed <= 1.15 x max(adam_only, disk_only).
Per parameter the disk moves 12 B in (fp32 master, m, v; the fp32 gradient is in host
memory) and 14 B out (the same + the new bf16 param).
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
    AdamStream,
    AdamThreads,
    Budgets,
    PoolSettings,
    ShardSpec,
    TierManager,
    TierSettings,
    TierTransfer,
    adam_update,
)
from tierzero.offload.settings import STATE_CLASSES as STATE
from tierzero.swap import SwapStore, aligned_empty

DTYPES = {"master": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32,
          "grad": torch.float32, "param": torch.bfloat16}
HOMES = {"master": "nvme", "exp_avg": "nvme", "exp_avg_sq": "nvme", "grad": "cpu",
         "param": "nvme"}
DISK_BYTES_PER_PARAM = 12 + 14


def _disk_only(mgr: TierManager, keys: list[dict[str, str]], numels: tuple[int, ...],
               bufs: list[dict[str, torch.Tensor]]) -> None:
    """Read every shard's state into one of the buffer sets and write it back with a
    param, up to len(bufs) - 1 shards ahead of the write in progress."""
    pending: deque[tuple[int, list[TierTransfer]]] = deque()
    writes: deque[list[TierTransfer]] = deque()
    for i, n in enumerate(numels):
        if len(writes) >= len(bufs) - 1:
            for w in writes.popleft():
                w.wait()
        b = bufs[i % len(bufs)]
        pending.append((i, [mgr.read_into(keys[i][c], b[c][:n]) for c in STATE]))
        j, reads = pending.popleft()
        for r in reads:
            r.wait()
        src = bufs[j % len(bufs)]
        writes.append([mgr.write_from(keys[j][c], src[c][:numels[j]])
                       for c in (*STATE, "param")])
    for ws in writes:
        for w in ws:
            w.wait()


def nvme_section(directory: Path, *, n: int, shards: int, threads: int, repeats: int,
                 hyper: AdamHyper) -> dict[str, Any]:
    numels = tuple(n // shards + (1 if i < n % shards else 0) for i in range(shards))
    directory.mkdir(parents=True, exist_ok=True)
    print(f"\n== NVMe stream: {n:,} params in {shards} shards under {directory}, "
          f"{threads} Adam thread(s)")
    keys = [{c: f"{c}/{i}" for c in DTYPES} for i in range(shards)]
    specs = [ShardSpec(k[c], c, m, DTYPES[c])  # type: ignore[arg-type]
             for k, m in zip(keys, numels, strict=True) for c in DTYPES]
    big = max(numels)
    settings = TierSettings(homes=HOMES,  # type: ignore[arg-type]
                            budgets=Budgets(device=4 * big, host=16 * 4 * n, nvme=1 << 40),
                            pool=PoolSettings())
    with AdamThreads(threads) as pool, SwapStore(directory) as ss:
        mgr = TierManager(specs, settings, swap=ss)
        # Host copies of every shard for adam_only: the same bytes the stream moves.
        host = []
        for i, m in enumerate(numels):
            h = {"master": torch.randn(m) * 0.1, "exp_avg": torch.zeros(m),
                 "exp_avg_sq": torch.zeros(m), "grad": torch.randn(m) * 1e-3,
                 "param": torch.zeros(m, dtype=torch.bfloat16)}
            for c in DTYPES:
                mgr.place(keys[i][c], h[c]).wait()
            host.append(h)
        bufs = [{c: aligned_empty(big, DTYPES[c]) for c in (*STATE, "param")}
                for _ in range(3)]
        stream = AdamStream(mgr, keys, numels, buffer_bytes=3 * 12 * big,
                            shadow=torch.bfloat16, threads=pool)
        step = [0]

        def adam_only() -> None:
            step[0] += 1
            for h in host:
                adam_update(h["master"], h["exp_avg"], h["exp_avg_sq"], h["grad"],
                            hyper=hyper, step=step[0], shadow=h["param"], threads=pool)

        def disk_only() -> None:
            stream.wait_idle()
            _disk_only(mgr, keys, numels, bufs)

        def streamed() -> None:
            step[0] += 1
            stats_log.append(stream.step(hyper, step[0]))
            stream.wait_idle()

        stats_log: list[Any] = []
        methods = {"adam_only": adam_only, "disk_only": disk_only, "streamed": streamed}
        try:
            for fn in methods.values():
                fn()  # warm-up: first write of every region, page faults
            times: dict[str, list[float]] = {k: [] for k in methods}
            names = list(methods)
            for r in range(repeats):
                for name in names[r % 3:] + names[:r % 3]:
                    t = time.perf_counter()
                    methods[name]()
                    times[name].append(time.perf_counter() - t)
        finally:
            stream.close()
            mgr.close()
        direct = ss.direct
    med = {k: statistics.median(v) for k, v in times.items()}
    bound = max(med["adam_only"], med["disk_only"])
    result = {
        "params": n, "shards": shards, "threads": threads, "o_direct": direct,
        "median_s": med, "all_s": times,
        "disk_gb_s": DISK_BYTES_PER_PARAM * n / med["disk_only"] / 1e9,
        "ratio_to_max_adam_disk": med["streamed"] / bound,
        "last_step_stats": vars(stats_log[-1]) if stats_log else None,
    }
    print(f"   O_DIRECT={direct}  adam_only {med['adam_only']:.3f} s   disk_only "
          f"{med['disk_only']:.3f} s ({result['disk_gb_s']:.2f} GB/s)   streamed "
          f"{med['streamed']:.3f} s   -> {result['ratio_to_max_adam_disk']:.2f} x "
          "max(adam, disk) (target <= 1.15)")
    return result
