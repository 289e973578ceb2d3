"""How much of this machine's CPU its hypervisor takes while the disk has requests in flight.

On a VM, time a vCPU wanted to run but the host ran something else is counted as `steal`
in /proc/stat. A host that serves the VM's disk on the same physical cores it lends the
VM (an emulated or polled virtio queue) takes that time whenever a request is in flight,
and the guest sees its cores slow down without any of its own threads doing more work.
scale_bench's rows then show a step above the CPU's bound with nothing in the step to
account for it; this script measures the effect alone.

Each case runs one busy loop pinned to each core of this process's affinity (a child
process spinning in Python, so every core always has work and any steal is counted), and
beside them, for cases with I/O, `--threads` threads issuing O_DIRECT requests of
`--request` bytes to a file of `--file-bytes` in `--dir` (reads, or writes), back to back
for `--seconds`. Per case and core: the seconds of steal and of user time per second of
wall time (bench_report.steal_seconds and /proc/stat's user column), and the I/O's GB/s.
The cases alternate within each of `--repeats` rounds, so a host that drifts falls on all
of them; each number is the median over the rounds.

    .venv/bin/python benchmarks/io_steal_bench.py --dir /var/tmp --out bench_out/io_steal.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import steal_seconds

SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"
CASES = ("no I/O", "read x1", "read xN", "write x1", "write xN")


def cpu_columns(cpus: list[int]) -> dict[int, tuple[float, float]]:
    """(user seconds, steal seconds) since boot of each CPU in `cpus`: the first and the
    eighth number of its /proc/stat line (main() checked that the steal column is there)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[float, float]] = {}
    with open("/proc/stat") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0].startswith("cpu") and fields[0][3:].isdigit() \
                    and int(fields[0][3:]) in cpus:
                out[int(fields[0][3:])] = (int(fields[1]) / tick, int(fields[8]) / tick)
    return out


def per_second(before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]],
               wall: float) -> dict[str, dict[str, float]]:
    """Each CPU's user and steal seconds per second of `wall` between two readings."""
    return {f"cpu{c}": {"user": (after[c][0] - before[c][0]) / wall,
                        "steal": (after[c][1] - before[c][1]) / wall} for c in sorted(before)}


def run_io(path: str, kind: str, *, threads: int, request: int, file_bytes: int,
           seconds: float) -> int:
    """Bytes moved by `threads` threads issuing O_DIRECT `kind` requests back to back:
    thread i takes requests i, i + threads, ... of the file, wrapping around."""
    moved = [0] * threads
    stop = time.perf_counter() + seconds
    errors: list[BaseException] = []

    def one(i: int) -> None:
        flags = (os.O_RDONLY if kind == "read" else os.O_WRONLY) | os.O_DIRECT
        fd = os.open(path, flags)
        buf = mmap.mmap(-1, request)  # page-aligned, as O_DIRECT needs
        slots = file_bytes // request
        k = i
        try:
            while time.perf_counter() < stop:
                off = (k % slots) * request
                moved[i] += (os.preadv(fd, [buf], off) if kind == "read"
                             else os.pwritev(fd, [buf], off))
                k += threads
        except BaseException as e:  # reported by the caller, not lost in a thread
            errors.append(e)
        finally:
            os.close(fd)
            buf.close()

    pool = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
    return sum(moved)


def make_file(directory: str, file_bytes: int, request: int) -> str:
    """A file of `file_bytes` written through O_DIRECT in a private directory; on a
    failure (a file system without O_DIRECT, a full disk) neither is left behind."""
    path = os.path.join(tempfile.mkdtemp(prefix="io_steal_", dir=directory), "data")
    buf = mmap.mmap(-1, request)
    buf.write(os.urandom(request))
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT, 0o600)
        try:
            for off in range(0, file_bytes, request):
                os.pwritev(fd, [buf], off)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        remove_file(path)
        raise
    finally:
        buf.close()
    return path


def remove_file(path: str) -> None:
    """`path` (if it was made) and the private directory make_file made for it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.rmdir(os.path.dirname(path))


def one_case(case: str, path: str, cpus: list[int], args: argparse.Namespace) -> dict[str, Any]:
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN, str(c)]) for c in cpus]
    try:
        time.sleep(0.3)  # the spinners running on every core
        before, t0 = cpu_columns(cpus), time.perf_counter()
        if case == "no I/O":
            time.sleep(args.seconds)
            moved = 0
        else:
            kind, _, depth = case.partition(" x")
            moved = run_io(path, kind, threads=1 if depth == "1" else args.threads,
                           request=args.request, file_bytes=args.file_bytes,
                           seconds=args.seconds)
        wall = time.perf_counter() - t0
        after = cpu_columns(cpus)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    cores = per_second(before, after, wall)
    return {"case": case, "wall_s": wall, "gbps": moved / wall / 1e9, "cores": cores,
            "steal_cores": sum(c["steal"] for c in cores.values()),
            "user_cores": sum(c["user"] for c in cores.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="a directory on the drive to measure")
    ap.add_argument("--seconds", type=float, default=5.0, help="wall seconds per case")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8, help="I/O threads of the xN cases")
    ap.add_argument("--request", type=int, default=4 << 20, help="bytes per request")
    ap.add_argument("--file-bytes", type=int, default=1 << 30)
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args()
    if not os.path.isdir(args.dir) or not os.access(args.dir, os.W_OK):
        ap.error(f"--dir {args.dir}: not a writable directory")
    if args.request <= 0 or args.request % mmap.PAGESIZE:
        ap.error(f"--request {args.request}: must be a positive multiple of {mmap.PAGESIZE}")
    if args.file_bytes < args.request * max(1, args.threads):
        ap.error(f"--file-bytes {args.file_bytes}: must hold at least --threads requests")
    if args.seconds <= 0 or args.repeats < 1 or args.threads < 1:
        ap.error("--seconds, --repeats and --threads must be positive")
    cpus = sorted(os.sched_getaffinity(0))
    if steal_seconds(cpus) is None:
        ap.error("/proc/stat has no per-CPU steal column here: nothing to measure")
    try:
        path = make_file(args.dir, args.file_bytes, args.request)
    except OSError as e:
        ap.error(f"--dir {args.dir}: cannot write a file with O_DIRECT there ({e})")
    rounds: list[list[dict[str, Any]]] = []
    try:
        for r in range(args.repeats):
            order = CASES if r % 2 == 0 else CASES[::-1]
            rounds.append([one_case(c, path, cpus, args) for c in order])
    finally:
        remove_file(path)
    med: dict[str, dict[str, float]] = {}
    for case in CASES:
        runs = [x for rnd in rounds for x in rnd if x["case"] == case]
        med[case] = {k: statistics.median(x[k] for x in runs)
                     for k in ("steal_cores", "user_cores", "gbps")}
    n = args.threads
    print(f"{len(cpus)} cores busy; median of {args.repeats}; {args.request >> 10} KiB requests")
    print("| case | steal (cores) | user (cores) | GB/s |")
    print("| --- | ---: | ---: | ---: |")
    for case, m in med.items():
        print(f"| {case.replace('xN', f'x{n}')} | {m['steal_cores']:.2f} | "
              f"{m['user_cores']:.2f} | {m['gbps']:.2f} |")
    if args.out:
        import machine  # torch's version in the record: imported only when one is written

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(
            {"machine": machine.describe(args.dir), "args": vars(args), "median": med,
             "rounds": rounds}, indent=1) + "\n")


if __name__ == "__main__":
    main()
