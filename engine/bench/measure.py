"""What `tierzero bench` measures: memory copy bandwidth, NVMe write/read through
swap.SwapStore at the configured path, CPU Adam speed (offload.CPUAdam, and the offloaded
step's kernel per optimizer state layout) and, with CUDA, pinned host <-> device copy
bandwidth.

Each figure is the median of `repeats` timed runs after one untimed warm-up.
NVMe reads use the store's O_DIRECT path where the file system supports it
(recorded as `direct`), so they measure the drive, not the page cache.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tierzero.offload import AdamHyper, AdamThreads, CPUAdam, adam_update
from tierzero.offload import state_codec as sc
from tierzero.offload.bf16_master import MASTER_PRECISIONS, master_key
from tierzero.swap import SwapStore, aligned_empty

MiB = 1 << 20


@dataclass(frozen=True)
class BenchSizes:
    memory_bytes: int = 256 * MiB
    nvme_bytes: int = 1024 * MiB
    nvme_chunk_bytes: int = 64 * MiB
    adam_params: int = 1 << 24
    repeats: int = 3


QUICK = BenchSizes(memory_bytes=64 * MiB, nvme_bytes=128 * MiB, nvme_chunk_bytes=32 * MiB,
                   adam_params=1 << 22, repeats=3)


@dataclass(frozen=True)
class BenchResult:
    memory_copy_gbps: float  # (read + write bytes) / s of a large tensor copy
    nvme_write_gbps: float
    nvme_read_gbps: float
    nvme_path: str
    nvme_direct: bool  # O_DIRECT in use (reads came from the drive, not the page cache)
    adam_params_per_s: float  # fp32 AdamW elements updated per second (offload.CPUAdam)
    # the offloaded step's kernel per state layout (adam_state_key): elements per second
    adam_params_per_s_by_state: dict[str, float]
    h2d_gbps: float | None  # pinned host -> CUDA device copies; None without CUDA
    d2h_gbps: float | None
    adam_threads: int
    sizes: dict[str, int]
    machine: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults, file growth, kernel compilation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth(nbytes: int, repeats: int) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src), repeats) / 1e9


def nvme_bandwidth(path: str, sizes: BenchSizes, *, block_size: int, threads: int,
                   queue_depth: int) -> tuple[float, float, bool]:
    """(write GB/s, read GB/s, direct) through a SwapStore in a scratch dir under `path`."""
    chunks = max(1, sizes.nvme_bytes // sizes.nvme_chunk_bytes)
    bufs = [aligned_empty(sizes.nvme_chunk_bytes) for _ in range(chunks)]
    for i, b in enumerate(bufs):
        b.fill_(i % 251)
    total = chunks * sizes.nvme_chunk_bytes
    with SwapStore(path, block_size=block_size, threads=threads, queue_depth=queue_depth,
                   reserve_bytes=total) as store:

        def write() -> None:
            for f in [store.write(f"bench/{i}", b) for i, b in enumerate(bufs)]:
                f.wait()

        def read() -> None:
            for f in [store.read(f"bench/{i}", out=b) for i, b in enumerate(bufs)]:
                f.wait()

        t_write = _median_time(write, sizes.repeats)
        t_read = _median_time(read, sizes.repeats)
        direct = bool(store.direct)
    return total / t_write / 1e9, total / t_read / 1e9, direct


def device_copy_bandwidth(nbytes: int, repeats: int) -> tuple[float | None, float | None]:
    """(host->device, device->host) GB/s with a pinned host buffer; (None, None) without CUDA."""
    if not torch.cuda.is_available():
        return None, None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    def d2h() -> None:
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()

    return nbytes / _median_time(h2d, repeats) / 1e9, nbytes / _median_time(d2h, repeats) / 1e9


def adam_speed(n: int, repeats: int) -> tuple[float, int]:
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = CPUAdam([param], lr=1e-3, weight_decay=0.01)
    t = _median_time(opt.step, repeats)
    return n / t, torch.get_num_threads()


def adam_state_key(state_precision: str, master_precision: str) -> str:
    """The name of a state layout's rate in `adam_params_per_s_by_state`: "int8",
    "int8+bf16master", ..."""
    return state_precision + ("+bf16master" if master_precision == "bf16" else "")


def adam_speeds_by_state(n: int, repeats: int) -> dict[str, float]:
    """Elements per second of the offloaded step's update (offload.adam_update on a bf16
    gradient, on all the CPUs as the engine runs it) for each
    offload.optimizer.state_precision and master_precision: the moments' decoding and
    encoding and the bf16 master's rounding cost the CPU time, and `tierzero plan` times
    the run's own layout by its rate."""
    g = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    out: dict[str, float] = {}
    with AdamThreads() as threads:
        for master in MASTER_PRECISIONS:
            for prec in sc.STATE_PRECISIONS:
                update = _update_of(n, g, prec, master == "bf16", threads)
                out[adam_state_key(prec, master)] = n / _median_time(update, repeats)
    return out


def _update_of(n: int, g: torch.Tensor, prec: str, bf16_master: bool,
               threads: AdamThreads) -> Callable[[], None]:
    """One update of n elements with moments stored as `prec`, the next step each call."""
    hyper = AdamHyper(lr=1e-4, weight_decay=0.01)
    param = torch.randn(n).to(torch.bfloat16) if bf16_master else torch.randn(n)
    shadow = None if bf16_master else torch.empty(n, dtype=torch.bfloat16)
    if prec == "fp32":
        m, v = torch.zeros(n), torch.zeros(n)
    else:
        m = torch.zeros(sc.moment_nbytes(n, prec), dtype=torch.uint8)
        v = torch.zeros_like(m)
    steps = iter(range(1, 1 << 30))

    def update() -> None:
        step = next(steps)
        adam_update(param, m, v, g, hyper=hyper, step=step, shadow=shadow, threads=threads,
                    state=prec, master_key=master_key(step, 1) if bf16_master else None)

    return update


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version()}


def run_bench(path: str, sizes: BenchSizes, *, block_size: int, threads: int,
              queue_depth: int) -> BenchResult:
    mem = memory_bandwidth(sizes.memory_bytes, sizes.repeats)
    write, read, direct = nvme_bandwidth(path, sizes, block_size=block_size, threads=threads,
                                         queue_depth=queue_depth)
    adam, adam_threads = adam_speed(sizes.adam_params, sizes.repeats)
    by_state = adam_speeds_by_state(sizes.adam_params, sizes.repeats)
    h2d, d2h = device_copy_bandwidth(sizes.memory_bytes, sizes.repeats)
    return BenchResult(memory_copy_gbps=mem, nvme_write_gbps=write, nvme_read_gbps=read,
                       nvme_path=path, nvme_direct=direct, adam_params_per_s=adam,
                       adam_params_per_s_by_state=by_state,
                       adam_threads=adam_threads, h2d_gbps=h2d, d2h_gbps=d2h,
                       sizes=asdict(sizes), machine=machine())
