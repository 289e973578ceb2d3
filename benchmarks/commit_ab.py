"""step_bench at two git revisions, in interleaved rounds: a change's before and after.

Each revision is exported once (`git archive`) into its own directory; every round runs
step_bench there for each revision in turn (A, B, A, B, ...), so load drift hits both
alike. Reported per configuration: the median step time of each revision over the rounds,
B's ratio to A, and the NVMe bytes per step by direction and tensor class of each (the tier
manager's moved_by_class, from the last round: the bytes do not depend on the load).

    python benchmarks/commit_ab.py --a 078f892 --b HEAD --configs cpu,cpu:clip,all_nvme
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine

REPO = Path(__file__).resolve().parent.parent


def export(rev: str, into: Path) -> str:
    """`rev`'s tree under `into`; returns its full commit id."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", rev], check=True,
                            capture_output=True, text=True).stdout.strip()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True,
                             capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return commit


def run_round(tree: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One step_bench run in `tree` (its own package first on the path)."""
    cmd = [sys.executable, str(tree / "benchmarks" / "step_bench.py"), "--configs",
           args.configs, "--models", args.model, "--repeats", "1", "--steps", str(args.steps),
           "--swap", args.swap, "--out", str(out)]
    if args.quick:
        cmd.append("--quick")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"step_bench in {tree} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return dict(json.loads(out.read_text()))


def gb_by_class(row: dict[str, Any]) -> str:
    if "moved_by_class_per_step" not in row:
        return "bytes by class not reported by this revision's step_bench"
    by = row["moved_by_class_per_step"] or {}
    parts = []
    for direction in ("nvme_to_host", "host_to_nvme"):
        cls = {c: n for c, n in by.get(direction, {}).items() if n}
        if cls:
            parts.append(direction + " " + ", ".join(f"{c} {n / 1e6:.1f}"
                                                     for c, n in sorted(cls.items())))
    return "; ".join(parts) + (" (MB/step)" if parts else "no NVMe traffic")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="the baseline revision (before)")
    ap.add_argument("--b", default="HEAD", help="the revision measured against it (after)")
    ap.add_argument("--configs", default="cpu,cpu:clip,all_nvme,all_nvme:clip")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="step_bench --quick (smaller model)")
    ap.add_argument("--swap", default=tempfile.gettempdir(), help="NVMe directory")
    ap.add_argument("--out", default="bench_out/commit_ab.json")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1:
        raise SystemExit("commit_ab: --rounds and --steps must be >= 1")
    with tempfile.TemporaryDirectory(prefix="commit_ab-") as tmp:
        trees = {k: Path(tmp) / k for k in ("a", "b")}
        commits = {k: export(getattr(args, k), trees[k]) for k in trees}
        load = os.getloadavg()
        rows: dict[str, dict[str, list[dict[str, Any]]]] = {"a": {}, "b": {}}
        for r in range(args.rounds):
            for k in ("a", "b"):
                res = run_round(trees[k], args, Path(tmp) / f"{k}{r}.json")
                for row in res["rows"]:
                    if row["config"].startswith("ds_") or "failed" in row:
                        continue
                    rows[k].setdefault(row["config"], []).append(row)
        load_after = os.getloadavg()
    info = machine.describe(args.swap)
    result: dict[str, Any] = {"machine": info, "commits": commits, "args": vars(args),
                              "load_before_after": [load, load_after], "configs": {}}
    sys.stdout.write(f"machine: {json.dumps(info)}\nA {commits['a'][:10]}  B "
                     f"{commits['b'][:10]}  load {load[0]:.2f} -> {load_after[0]:.2f}\n")
    for config in rows["a"]:
        a_steps = [r["step_s"] for r in rows["a"][config]]
        b_steps = [r["step_s"] for r in rows["b"].get(config, [])]
        if not b_steps:
            continue
        ma, mb = statistics.median(a_steps), statistics.median(b_steps)
        last_a, last_b = rows["a"][config][-1], rows["b"][config][-1]
        result["configs"][config] = {
            "a_step_s": a_steps, "b_step_s": b_steps, "a_median": ma, "b_median": mb,
            "ratio": mb / ma, "a_moved_by_class": last_a.get("moved_by_class_per_step"),
            "b_moved_by_class": last_b.get("moved_by_class_per_step")}
        sys.stdout.write(f"{config:>16}: A {ma:.3f} s  B {mb:.3f} s  B/A {mb / ma:.3f}  "
                         f"(rounds A {[round(x, 3) for x in a_steps]}, "
                         f"B {[round(x, 3) for x in b_steps]})\n"
                         f"{'':>18}A {gb_by_class(last_a)}\n{'':>18}B {gb_by_class(last_b)}\n")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    sys.stdout.write(f"wrote {out}\n")


if __name__ == "__main__":
    main()
