"""`tierzero bench`: measure this machine, print the figures, save them for `tierzero plan`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tierzero.engine.bench.measure import QUICK, BenchSizes, run_bench
from tierzero.engine.config import ConfigError, load_config
from tierzero.engine.config.checks import check_swap_dir
from tierzero.swap.safe_files import make_output_dir, output_modes, write_atomic

Subparsers = Any  # argparse's _SubParsersAction is private


def results_path() -> str:
    """Where `bench` saves and `plan` looks: $TIERZERO_CACHE_DIR or ~/.cache/tierzero."""
    base = os.environ.get("TIERZERO_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tierzero")
    return os.path.join(base, "bench.json")


def add_bench(sub: Subparsers) -> None:
    bench = sub.add_parser(
        "bench", help="measure memory and NVMe bandwidth and CPU Adam speed; save for plan",
        description="Measure this machine's memory copy bandwidth, NVMe write/read bandwidth "
        "at the configured swap path (through swap.SwapStore, O_DIRECT where supported) and "
        "CPU Adam speed. Prints them and saves JSON for `tierzero plan` "
        f"({results_path()}; $TIERZERO_CACHE_DIR moves it).",
    )
    bench.add_argument("config", nargs="?", metavar="CONFIG",
                       help="config whose offload path and nvme settings to use; omit for the "
                       "embedded default")
    bench.add_argument("--path", help="swap directory to measure (overrides the config's)")
    bench.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    bench.add_argument("--nvme-mib", type=int, metavar="N", help="MiB written and read per repeat")
    bench.add_argument("--out", help=f"also write the JSON here (always saved to {results_path()})")
    bench.set_defaults(run=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        path = args.path or config.offload.optimizer.path or config.offload.params.path
        if path is None:
            raise ConfigError("offload.path", "no swap directory configured; pass --path DIR or "
                              "set offload.path in the config")
        check_swap_dir(path, "--path" if args.path else "offload.path")
        sizes = QUICK if args.quick else BenchSizes()
        if args.nvme_mib is not None:
            if args.nvme_mib < 1:
                raise ConfigError("--nvme-mib", f"{args.nvme_mib} is not allowed; allowed: >= 1")
            chunk = min(sizes.nvme_chunk_bytes, args.nvme_mib << 20)
            sizes = BenchSizes(sizes.memory_bytes, args.nvme_mib << 20, chunk,
                               sizes.adam_params, sizes.repeats)
    except ConfigError as exc:
        sys.stderr.write(f"tierzero bench: error: {exc}\n")
        return 1
    nvme = config.nvme
    result = run_bench(path, sizes, block_size=nvme.block_size, threads=nvme.threads,
                       queue_depth=nvme.queue_depth)
    doc = result.as_json()
    rows = [
        ("memory copy (read + write)", f"{result.memory_copy_gbps:.2f} GB/s"),
        (f"NVMe write ({path}, direct={result.nvme_direct})", f"{result.nvme_write_gbps:.2f} GB/s"),
        (f"NVMe read ({path}, direct={result.nvme_direct})", f"{result.nvme_read_gbps:.2f} GB/s"),
        (f"CPU Adam ({result.adam_threads} threads)",
         f"{result.adam_params_per_s / 1e6:.0f} M params/s"),
        *((f"CPU Adam, offloaded step, state {key}", f"{rate / 1e6:.0f} M params/s")
          for key, rate in result.adam_params_per_s_by_state.items()),
    ]
    if result.h2d_gbps is not None and result.d2h_gbps is not None:
        rows.append(("host -> device (pinned)", f"{result.h2d_gbps:.2f} GB/s"))
        rows.append(("device -> host (pinned)", f"{result.d2h_gbps:.2f} GB/s"))
    width = max(len(r[0]) for r in rows)
    out = [f"{name:<{width}}  {value}" for name, value in rows]
    modes = output_modes(config.outputs.permissions)
    for target in [results_path()] + ([args.out] if args.out else []):
        parent = os.path.dirname(target)
        if parent:
            make_output_dir(parent, modes)
        write_atomic(target, json.dumps(doc, indent=2).encode(), modes.file)
        out.append(f"saved: {target}")
    sys.stdout.write("\n".join(out) + "\n")
    return 0
