"""`tierzero train`'s default run with torch's OpenMP threads spinning while they wait
(libgomp's default) and sleeping (OMP_WAIT_POLICY=PASSIVE).

The wait policy is read once, when a process loads OpenMP, so each row is its own
`python -m tierzero train --steps N` process (the embedded default: builtin:small, bf16,
params and optimizer state on NVMe, clipping 1.0, the update deferred into the next
forward on a worker thread); the policies alternate, the first one alternating too, so
drift of a shared machine falls on both. Per run: the median `step_s` of steps 2..N from
its metrics.jsonl, and the CPU seconds the process used (user + system, from wait4) per
step. Medians over --repeats; the ratio is PASSIVE / default.

    python benchmarks/omp_wait_bench.py --steps 20 --repeats 3 --out bench_out/omp_wait.json
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

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("default", "PASSIVE")


def one_run(policy: str, steps: int) -> dict[str, float]:
    """One `tierzero train` process under `policy`; its median step and CPU s a step."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    with tempfile.TemporaryDirectory(prefix="omp_wait_") as cwd:
        proc = subprocess.Popen([sys.executable, "-m", "tierzero", "train", "--steps",
                                 str(steps), "--no-progress"], cwd=cwd, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"tierzero train ({policy}) failed: {err[-2000:]}")
        metrics = next(Path(cwd).glob("runs/*/metrics.jsonl"))
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    step_s = [r["step_s"] for r in rows if r.get("event") == "step" and r["step"] >= 2]
    return {"step_s": statistics.median(step_s),
            "cpu_s_per_step": (usage.ru_utime + usage.ru_stime) / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench_out/omp_wait.json")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    for i in range(args.repeats):
        for policy in (POLICIES if i % 2 == 0 else POLICIES[::-1]):
            runs[policy].append(one_run(policy, args.steps))
            print(policy, runs[policy][-1], flush=True)
    out: dict[str, Any] = {"machine": machine.describe(), "steps": args.steps,
                           "repeats": args.repeats, "runs": runs}
    for policy in POLICIES:
        out[policy] = {k: statistics.median(r[k] for r in runs[policy])
                       for k in ("step_s", "cpu_s_per_step")}
    out["ratio"] = {k: out["PASSIVE"][k] / out["default"][k]
                    for k in ("step_s", "cpu_s_per_step")}
    print(json.dumps({p: out[p] for p in (*POLICIES, "ratio")}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
