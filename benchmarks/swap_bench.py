"""SwapStore write/read bandwidth against baselines, interleaved in one run.

    .venv/bin/python benchmarks/swap_bench.py            # 4 GiB per direction, 5 repeats
    .venv/bin/python benchmarks/swap_bench.py --quick    # 512 MiB, finishes in seconds

Each repeat runs every method once (in a new random order) on the same file
system: each writes --size bytes, then reads them back. One untimed warm-up
repeat first, so every method then overwrites blocks it has written before
(writing into never-written extents is slower on ext4; all methods pay it
equally in the warm-up). Reported: median GB/s per direction, ratio to the
best baseline, CPU seconds per GB moved (process + children).

Methods:
  swapstore  tierzero's SwapStore: --tensor-mib tensors under distinct keys, all
             writes submitted then waited; reads in a sliding window of 4
             tensors (a prefetch window), from/to page-aligned buffers.
  swapstore_verify  the same with verify=True (checksums written and checked).
  pool       the ceiling of plain Python here: O_DIRECT os.pwrite/os.preadv from
             --pool-threads threads, --pool-request-mib requests, aligned buffer.
  dd         coreutils dd, oflag=direct / iflag=direct, one request in flight
             (input /dev/zero: a floor, not a ceiling).
  fio        fio with libaio, direct=1, iodepth 8 (skipped if not installed:
             apt-get install -y fio).
  aiofiles   aiofiles (buffered writes + fsync, page cache dropped with
             posix_fadvise before reading).
  deepspeed  DeepSpeed's AsyncIOBuilder aio_handle with locked buffers (skipped
             unless installed: pip install deepspeed && apt-get install libaio-dev).

Files live under --dir (default: a temporary directory on /work's file
system) and are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiofiles
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import describe

from tierzero.swap import SwapStore, aligned_empty

MiB = 1 << 20
Run = Callable[[str], float]  # direction -> seconds


def cpu_seconds() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime



class SwapStoreMethod:
    verify = False

    def __init__(self, d: Path, size: int, a: argparse.Namespace) -> None:
        self.store = SwapStore(d, block_size=a.block_kib * 1024, queue_depth=a.queue_depth,
                               threads=a.threads, verify=self.verify,
                               # room for the copy-on-write of queue_depth writes in flight,
                               # so timed runs never grow the file (as a planned reserve would)
                               reserve_bytes=size + a.queue_depth * (a.tensor_mib * MiB + 8192))
        self.tensor = a.tensor_mib * MiB
        self.n = size // self.tensor
        self.src = aligned_empty(self.tensor, torch.uint8).random_(0, 256)
        self.outs = [aligned_empty(self.tensor, torch.uint8) for _ in range(4)]

    def __call__(self, direction: str) -> float:
        t0 = time.perf_counter()
        if direction == "write":
            futs = [self.store.write(f"t{i}", self.src) for i in range(self.n)]
            for f in futs:
                f.wait()
        else:
            window = []
            for i in range(self.n):
                if len(window) == len(self.outs):
                    window.pop(0).wait()
                window.append(self.store.read(f"t{i}", out=self.outs[i % len(self.outs)]))
            for f in window:
                f.wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.store.close()


class SwapStoreVerifyMethod(SwapStoreMethod):
    verify = True  # CRC-32 of every block on write and read (the cost of verify mode)


class PoolMethod:
    def __init__(self, d: Path, size: int, a: argparse.Namespace) -> None:
        self.path = d / "pool.bin"
        self.size = size
        self.req = a.pool_request_mib * MiB
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(self.fd, 0, size)
        self.threads = a.pool_threads
        self.buf = aligned_empty(self.req * self.threads, torch.uint8).random_(0, 256)
        self.views = [self.buf[i * self.req:(i + 1) * self.req].numpy().data
                      for i in range(self.threads)]
        self.ex = ThreadPoolExecutor(self.threads)  # the baseline's own I/O threads

    def __call__(self, direction: str) -> float:
        def one(i: int) -> None:
            view = self.views[i % self.threads]
            if direction == "write":
                os.pwrite(self.fd, view, i * self.req)
            else:
                os.preadv(self.fd, [view], i * self.req)

        t0 = time.perf_counter()
        list(self.ex.map(one, range(self.size // self.req)))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.ex.shutdown()
        os.close(self.fd)


class DdMethod:
    def __init__(self, d: Path, size: int, a: argparse.Namespace) -> None:
        self.path = d / "dd.bin"
        self.count = size // (8 * MiB)

    def __call__(self, direction: str) -> float:
        if direction == "write":
            cmd = ["dd", "if=/dev/zero", f"of={self.path}", "bs=8M", f"count={self.count}",
                   "oflag=direct", "conv=notrunc", "status=none"]
        else:
            cmd = ["dd", f"if={self.path}", "of=/dev/null", "bs=8M", f"count={self.count}",
                   "iflag=direct", "status=none"]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        return time.perf_counter() - t0

    def close(self) -> None:
        pass


class FioMethod:
    def __init__(self, d: Path, size: int, a: argparse.Namespace) -> None:
        if shutil.which("fio") is None:
            raise RuntimeError("fio is not installed (apt-get install -y fio)")
        self.path = d / "fio.bin"
        self.size = size

    def __call__(self, direction: str) -> float:
        cmd = ["fio", "--name=swap", f"--filename={self.path}", f"--size={self.size}",
               "--bs=8M", "--direct=1", "--ioengine=libaio", "--iodepth=8",
               f"--rw={direction}", "--output-format=json", "--fallocate=native"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        job = json.loads(out[out.index("{"):])["jobs"][0][direction]
        return float(job["io_bytes"]) / (float(job["bw_bytes"]) or 1.0)

    def close(self) -> None:
        pass


class AiofilesMethod:
    def __init__(self, d: Path, size: int, a: argparse.Namespace) -> None:
        self.path = d / "aiofiles.bin"
        self.size = size
        self.chunk = 8 * MiB
        self.data = aligned_empty(self.chunk, torch.uint8).random_(0, 256).numpy().tobytes()

    def __call__(self, direction: str) -> float:
        async def go() -> None:
            if direction == "write":
                async with aiofiles.open(self.path, "r+b" if self.path.exists() else "wb") as f:
                    for _ in range(self.size // self.chunk):
                        await f.write(self.data)
                    await f.flush()
                    os.fsync(f.fileno())
            else:
                async with aiofiles.open(self.path, "rb") as f:
                    while await f.read(self.chunk):
                        pass

        if direction == "read":  # make it come from the disk, not the page cache
            fd = os.open(self.path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        t0 = time.perf_counter()
        asyncio.run(go())
        return time.perf_counter() - t0

    def close(self) -> None:
        pass


class DeepSpeedMethod:
    def __init__(self, d: Path, size: int, a: argparse.Namespace) -> None:
        try:
            from deepspeed.ops.op_builder import (  # type: ignore[import-not-found]
                AsyncIOBuilder,
            )
        except ImportError as exc:
            raise RuntimeError("deepspeed is not installed (pip install deepspeed; "
                               "apt-get install libaio-dev for its async_io op)") from exc
        if not AsyncIOBuilder().is_compatible():
            raise RuntimeError("DeepSpeed async_io op cannot build here "
                               "(apt-get install libaio-dev)")
        self.handle = AsyncIOBuilder().load().aio_handle(1 * MiB, 8, False, True, a.threads)
        self.req = 8 * MiB
        self.n = size // self.req
        self.paths = [str(d / f"ds{i}.bin") for i in range(self.n)]
        example = torch.empty(0, dtype=torch.uint8)
        self.bufs = [self.handle.new_cpu_locked_tensor(self.req, example) for _ in range(4)]

    def __call__(self, direction: str) -> float:
        t0 = time.perf_counter()
        for i, path in enumerate(self.paths):
            buf = self.bufs[i % len(self.bufs)]
            if direction == "write":
                self.handle.async_pwrite(buf, path)
            else:
                self.handle.async_pread(buf, path)
        self.handle.wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        for b in self.bufs:
            self.handle.free_cpu_locked_tensor(b)


def bench_aligned(out: Path) -> None:
    """aligned_empty (over-allocate and slice) against an anonymous mmap + torch.frombuffer
    and plain torch.empty: allocate 256 MiB and touch every page, interleaved, median of 5."""
    import mmap

    n = 256 * MiB

    def sliced() -> torch.Tensor:
        return aligned_empty(n, torch.uint8)

    def mapped() -> torch.Tensor:
        return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)

    def plain() -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8)

    ways: dict[str, Callable[[], torch.Tensor]] = {
        "aligned_empty": sliced, "mmap_frombuffer": mapped, "torch_empty": plain}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(5):
        for name, make in ways.items():
            t0 = time.perf_counter()
            t = make()
            t.fill_(1)
            times[name].append(time.perf_counter() - t0)
            del t
    rows = {k: statistics.median(v) for k, v in times.items()}
    for k, v in rows.items():
        print(f"{k:<16} {v * 1e3:8.1f} ms per 256 MiB allocate+touch ({n / v / 1e9:.2f} GB/s)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"allocate_touch_256MiB_seconds": rows}, indent=1))
    print(f"wrote {out}")


METHODS: dict[str, Callable[[Path, int, argparse.Namespace], Run]] = {
    "swapstore": SwapStoreMethod, "swapstore_verify": SwapStoreVerifyMethod,
    "pool": PoolMethod, "dd": DdMethod, "fio": FioMethod, "aiofiles": AiofilesMethod,
    "deepspeed": DeepSpeedMethod,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="512 MiB, 3 repeats: a few seconds")
    p.add_argument("--size-gib", type=float, default=4.0, help="bytes per direction per method")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (--quick: 3)")
    p.add_argument("--dir", type=Path, default=None, help="where the files go (deleted after)")
    p.add_argument("--out", type=Path, default=Path("bench_out/swap_bench.json"))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--block-kib", type=int, default=8192,
                   help="SwapStore block_size; default 8 MiB = the pool baseline's request size, "
                   "so the ratio compares equal I/O patterns (the config default is 1 MiB)")
    p.add_argument("--queue-depth", type=int, default=8)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--tensor-mib", type=int, default=64, help="SwapStore tensor size")
    p.add_argument("--pool-threads", type=int, default=4)
    p.add_argument("--pool-request-mib", type=int, default=8)
    p.add_argument("--aligned", action="store_true",
                   help="only measure aligned_empty against mmap/torch.empty allocation")
    a = p.parse_args()
    if a.quick:
        a.repeats = min(a.repeats, 3)
    if a.aligned:
        bench_aligned(a.out.with_name("swap_bench_aligned.json"))
        return
    size = int((0.5 if a.quick else a.size_gib) * 2**30) // (64 * MiB) * 64 * MiB
    a.tensor_mib = min(a.tensor_mib, size // MiB)
    root = a.dir if a.dir is not None else Path(tempfile.mkdtemp(prefix="swap-bench-",
                                                                 dir="/work"))
    own_root = a.dir is None
    work = Path(tempfile.mkdtemp(prefix="swap-bench-", dir=root)) if not own_root else root
    info = describe(work)
    print("machine:", json.dumps(info, indent=1))
    print(f"size {size / 2**30:.2f} GiB per direction, {a.repeats} repeats (+1 warm-up)")
    methods: dict[str, Run] = {}
    skipped: dict[str, str] = {}
    try:
        for name in a.methods.split(","):
            try:
                methods[name] = METHODS[name](work, size, a)
            except (RuntimeError, ImportError, OSError) as exc:
                skipped[name] = str(exc)
                print(f"skip {name}: {exc}")
        times: dict[str, dict[str, list[float]]] = {m: {"write": [], "read": []} for m in methods}
        cpu: dict[str, dict[str, list[float]]] = {m: {"write": [], "read": []} for m in methods}
        order = list(methods)
        shuffler = random.Random(0)
        for rep in range(a.repeats + 1):
            # A fresh random order per repeat: a fixed rotation keeps each method behind the
            # same predecessor, whose leftover write-back (aiofiles!) then biases it.
            shuffler.shuffle(order)
            for name in order:
                for direction in ("write", "read"):
                    os.sync()  # untimed: flush what the previous method left dirty
                    c0 = cpu_seconds()
                    dt = methods[name](direction)
                    if rep > 0:  # rep 0 is the warm-up
                        times[name][direction].append(dt)
                        cpu[name][direction].append(cpu_seconds() - c0)
            if rep:
                print(f"repeat {rep} (order {','.join(order)}): " + "  ".join(
                    f"{m} w {size / times[m]['write'][-1] / 1e9:.2f} "
                    f"r {size / times[m]['read'][-1] / 1e9:.2f}" for m in order))
    finally:
        for m in methods.values():
            m.close()  # type: ignore[attr-defined]
        shutil.rmtree(work, ignore_errors=True)  # the temporary directory we made
    result: dict[str, object] = {"machine": info, "size_bytes": size, "repeats": a.repeats,
                                 "args": {k: str(v) for k, v in vars(a).items()},
                                 "skipped": skipped, "methods": {}}
    print(f"\n{'method':<16} {'write GB/s':>10} {'read GB/s':>10} {'w CPU s/GB':>11} "
          f"{'r CPU s/GB':>11}")
    rows: dict[str, dict[str, float]] = {}
    for m in methods:
        row = {}
        for d in ("write", "read"):
            row[f"{d}_gbps"] = size / statistics.median(times[m][d]) / 1e9
            row[f"{d}_cpu_s_per_gb"] = statistics.median(cpu[m][d]) / (size / 1e9)
            row[f"{d}_gbps_all"] = [size / t / 1e9 for t in times[m][d]]  # type: ignore[assignment]
        rows[m] = row
        print(f"{m:<16} {row['write_gbps']:>10.2f} {row['read_gbps']:>10.2f} "
              f"{row['write_cpu_s_per_gb']:>11.3f} {row['read_cpu_s_per_gb']:>11.3f}")
    result["methods"] = rows
    if "swapstore" in rows and len(rows) > 1:
        for d in ("write", "read"):
            baselines = [m for m in rows if not m.startswith("swapstore")]
            if not baselines:
                break
            best = max(baselines, key=lambda m: rows[m][f"{d}_gbps"])
            ratio = rows["swapstore"][f"{d}_gbps"] / rows[best][f"{d}_gbps"]
            result[f"{d}_ratio_to_best"] = {"best": best, "ratio": ratio}
            print(f"{d}: swapstore / best baseline ({best}) = {ratio:.3f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
