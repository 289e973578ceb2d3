"""step_bench's DeepSpeed rows: which ds_* configurations (benchmarks/ds_runner.py) run
beside the tierzero ones, and each one's ratio to tierzero's row with the same placement.

Pairs (DS_TWIN): none, cpu, opt_nvme with their ds_* twins; all_nvme (params on NVMe) with
ds_all_nvme_nocache (`max_in_cpu: 0`); all_nvme_cache (params homed in host memory,
offload.params.max_in_cpu_bytes) with ds_all_nvme (DeepSpeed's default max_in_cpu, 1e9
elements, keeps them in host memory). Both all-NVMe DeepSpeed rows run whenever either
tierzero all-NVMe row does, so the table always shows both; a row whose twin did not run is
compared with the other all-NVMe row and marked DIFFERENT placement.

Variants: a tierzero row with `:clip` has a DeepSpeed twin with `:clip` (ds_runner sets
`gradient_clipping` to the same --clip); `:noover`, `:bf16m` and `:int8m` have no DeepSpeed
counterpart, so such rows bring no DeepSpeed row of their own and each DeepSpeed row is
compared with its twin without them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

# DeepSpeed's configuration with the same placement as each tierzero one (ds_runner.py)
DS_TWIN = {"none": "ds_none", "cpu": "ds_cpu", "opt_nvme": "ds_opt_nvme",
           "all_nvme": "ds_all_nvme_nocache", "all_nvme_cache": "ds_all_nvme"}
DS_HOWTO = ("DeepSpeed rows skipped: `deepspeed` is not importable here and no "
            "--deepspeed-python was given. To add them: benchmarks/install_deepspeed.sh "
            "/work/ds-venv, then rerun with --deepspeed-python /work/ds-venv/bin/python "
            "(ZeRO-3, gloo, world size 1; see benchmarks/ds_runner.py).")


def deepspeed_configs(ns: argparse.Namespace, configs: list[str]) -> list[str]:
    """The ds_* twins of `configs` if a python with `deepspeed` is at hand, else [].

    Sets ns.deepspeed_python to that interpreter (this one when it imports deepspeed).
    """
    if ns.deepspeed_python is None:
        try:
            import deepspeed  # noqa: F401
            ns.deepspeed_python = sys.executable
        except ImportError:
            sys.stdout.write(DS_HOWTO + "\n")
            return []
    code = "import deepspeed; print(deepspeed.__version__)"
    try:
        probe = subprocess.run([ns.deepspeed_python, "-c", code], capture_output=True,
                               text=True, check=False, env=dict(os.environ, DS_ACCELERATOR="cpu"))
        why = probe.stderr.strip().splitlines()[-1:] if probe.returncode else None
    except OSError as e:
        why = [str(e)]
    if why is not None:
        raise SystemExit(f"--deepspeed-python {ns.deepspeed_python!r} cannot import deepspeed "
                         f"({why}); build one with benchmarks/install_deepspeed.sh")
    sys.stdout.write(f"deepspeed {probe.stdout.strip()} at {ns.deepspeed_python}\n")
    return ds_twins(configs)


def ds_twins(configs: list[str]) -> list[str]:
    """The ds_* configurations to run beside tierzero's `configs`, in their order."""
    ds: list[str] = []
    for c in configs:
        base, flags = _split(c)
        if base not in DS_TWIN:
            continue
        clip = ":clip" if "clip" in flags else ""
        twins = ([f"{d}{clip}" for d in ("ds_all_nvme", "ds_all_nvme_nocache")]
                 if base in ("all_nvme", "all_nvme_cache")  # both DeepSpeed variants, always
                 else [DS_TWIN[base] + clip])
        ds += [d for d in twins if d not in ds]
    return ds


def _split(config: str) -> tuple[str, set[str]]:
    """"cpu:clip" -> ("cpu", {"clip"})."""
    base, *flags = config.split(":")
    return base, set(flags)


def _twin_of(ds_config: str, med: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    """(tierzero config, how it relates) for a ds_* row: its same-placement twin when that
    ran, else (for the two all-NVMe variants) the other all-NVMe row, marked."""
    ds_base, flags = _split(ds_config)
    clip = ":clip" if "clip" in flags else ""
    same = next((c for c, d in DS_TWIN.items() if d == ds_base), None)
    if same is None:
        return None
    if same + clip in med:
        return same + clip, "same placement"
    other = {"all_nvme": "all_nvme_cache", "all_nvme_cache": "all_nvme"}.get(same)
    if other is not None and other + clip in med:
        return other + clip, ("DIFFERENT placement: DeepSpeed keeps parameters in host memory"
                              if same == "all_nvme_cache" else
                              "DIFFERENT placement: tierzero keeps parameters in host memory")
    return None


def report_deepspeed(model: str, med: dict[str, dict[str, Any]]) -> None:
    """Adds to each ds_* row its step time and peak RSS over tierzero's same config's (a
    row without a measurement, as a failed child's, gets none and is named)."""
    for c, m in med.items():
        twin = _twin_of(c, med) if c.startswith("ds_") else None
        if twin is None:
            continue
        name, how = twin
        tz = med[name]
        if not all(isinstance(r.get(k), int | float) and r[k] > 0
                   for r in (m, tz) for k in ("step_s", "peak_rss_train")):
            sys.stdout.write(f"{model:4s} {c}: no ratio to tierzero {name}: a row has no "
                             "measurement (failed child)\n")
            continue
        m["vs_tierzero"] = m["step_s"] / tz["step_s"]
        m["rss_vs_tierzero"] = m["peak_rss_train"] / tz["peak_rss_train"]
        m["tierzero_twin"], m["twin_placement"] = name, how
        sys.stdout.write(f"{model:4s} {c}: DeepSpeed step / tierzero {name} step = "
                         f"{m['vs_tierzero']:.2f} (target >= 2; {how}), peak RSS ratio "
                         f"{m['rss_vs_tierzero']:.2f}\n")
