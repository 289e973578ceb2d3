"""After a non-editable install the embedded default config resolves from package data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import engine, sys
from engine.cli import main
assert engine.__file__.startswith(sys.argv[1]), engine.__file__
config = engine.load_config()
assert config.offload.params.device == "nvme", config
sys.exit(main(["config", "check"]))
"""


def test_wheel_ships_configs_and_default_loads(tmp_path: Path) -> None:
    # Build from a copy so the build leaves nothing in the worktree.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("engine", "offload", "swap", "configs"):
        shutil.copytree(ROOT / package, src / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(dist), str(src)],
        capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stderr
    (wheel,) = dist.glob("tierzero-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("configs/default.yaml", "configs/zero3_nvme.yaml",
                    "configs/deepspeed/zero3_offload.json", "engine/config/schema.py"):
        assert shipped in names
    # A pure-Python wheel installs by unpacking; import it from there, not the checkout.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", PROBE, str(site)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert "from the embedded default" in run.stdout
    assert "path: /var/tmp" in run.stdout
