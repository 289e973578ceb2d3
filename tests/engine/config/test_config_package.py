"""The wheel installs everything under `tierzero.*`: built, installed into a fresh venv,
it runs `tierzero train` and imports from a directory holding the user's own `engine.py`
and `configs/` package (names a top-level package of ours would have collided with)."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LAYERS = ("engine", "offload", "swap", "configs")

PROBE = """
import sys
import engine, configs                      # the user's own modules, from the cwd
assert engine.USER and configs.USER
import tierzero
from tierzero.engine.cli import main
assert tierzero.__file__.startswith(sys.argv[1]), tierzero.__file__
config = tierzero.load_config()
assert config.offload.params.device == "nvme", config
sys.exit(main(["config", "check"]))
"""

TRAIN = """\
train: {model: "builtin:tiny", steps: 2, seq_len: 16, metrics_path: metrics.jsonl}
logging: {steps_per_print: 1}
batch: {micro_batch_size: 2}
offload: {device: nvme, path: %s}
"""


def build_wheel(tmp_path: Path) -> Path:
    # Build from a copy so the build leaves nothing in the worktree; copytree copies
    # tierzero/'s links as links, and the build follows them.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("tierzero", *LAYERS):
        shutil.copytree(ROOT / package, src / package, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(dist), str(src)],
        capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stderr
    (wheel,) = dist.glob("tierzero-*.whl")
    return wheel


def fresh_venv(tmp_path: Path) -> Path:
    """A new venv that sees this one's dependencies (torch, ...) through a .pth line but
    not its editable tierzero: a .pth file only adds a path, it runs no finder."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    (inner,) = venv.glob("lib/python*/site-packages")
    (inner / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return venv


def test_wheel_installs_under_tierzero_namespace(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("tierzero/__init__.py", "tierzero/configs/default.yaml",
                    "tierzero/configs/zero3_nvme.yaml",
                    "tierzero/configs/deepspeed/zero3_offload.json",
                    "tierzero/engine/config/schema.py", "tierzero/engine/data/corpus.txt",
                    "tierzero/offload/_adam_kernel.c", "tierzero/swap/store.py"):
        assert shipped in names
    assert not [n for n in names if n.split("/")[0] in LAYERS], "top-level layer packages"

    venv = fresh_venv(tmp_path)
    py = venv / "bin" / "python"
    # the fresh venv's processes see no checkout: not through PYTHONPATH either (a run of
    # the suite from a worktree sets it)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index",
                              "-q", str(wheel)], capture_output=True, text=True, timeout=300,
                             check=False, env=env)
    assert install.returncode == 0, install.stderr
    (installed,) = venv.glob("lib/python*/site-packages/tierzero")

    # The user's project: its own engine.py and configs/ package next to the script.
    user = tmp_path / "user"
    (user / "configs").mkdir(parents=True)
    (user / "engine.py").write_text("USER = True\n")
    (user / "configs" / "__init__.py").write_text("USER = True\n")
    run = subprocess.run([str(py), "-c", PROBE, str(installed)], cwd=user,
                         capture_output=True, text=True, timeout=120, check=False, env=env)
    assert run.returncode == 0, run.stderr
    assert "from the embedded default" in run.stdout
    assert "path: /var/tmp" in run.stdout

    swap = tmp_path / "swap"
    swap.mkdir()
    (user / "train.yaml").write_text(TRAIN % swap)
    train = subprocess.run([str(venv / "bin" / "tierzero"), "train", "train.yaml",
                            "--no-progress"], cwd=user, capture_output=True, text=True,
                           timeout=300, check=False, env=env)
    assert train.returncode == 0, train.stderr
    assert "step 2/2" in train.stderr + train.stdout, train.stderr
    assert (user / "metrics.jsonl").read_text().count('"event": "step"') == 2
