"""Outputs are written without following symlinks, private by default (0600 files,
0700 directories; `outputs.permissions` widens them), with a warning for an output
directory another user owns. See [Note: output files] in swap/safe_files.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
from pathlib import Path

import pytest
from engine_helpers import make_batches, make_config, make_model

from tierzero import engine
from tierzero.engine.cli import main
from tierzero.engine.config import ConfigError, load_config
from tierzero.engine.config.schema import OutputsConfig
from tierzero.engine.train.metrics import MetricsWriter
from tierzero.swap import trace
from tierzero.swap.safe_files import create_new, make_output_dir, write_atomic

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    return victim


def test_write_atomic_and_create_new_replace_a_planted_link(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a.json", "b.bin"):
        (out / name).symlink_to(victim)
    write_atomic(out / "a.json", b"{}")
    os.close(create_new(out / "b.bin"))
    assert victim.read_text() == "precious"
    for name in ("a.json", "b.bin"):
        assert not (out / name).is_symlink() and _mode(out / name) == 0o600
    assert (out / "a.json").read_bytes() == b"{}"
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "b.bin"]  # no temp left


def _trained() -> engine.ZeroEngine:
    eng, _, _, _ = engine.initialize(model=make_model(n_blocks=2), config=make_config(),
                                     device="cpu")
    for ids, tg in make_batches(1):
        eng.backward(eng(ids, tg))
        eng.step()
    return eng


def test_checkpoint_is_private_and_ignores_planted_latest_links(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "latest").symlink_to(victim)
    (root / ".latest.partial").symlink_to(victim)
    eng = _trained()
    try:
        final = Path(eng.save_checkpoint(root, tag="a"))
    finally:
        eng.close()
    assert victim.read_text() == "precious"
    assert not (root / "latest").is_symlink() and (root / "latest").read_text() == "a"
    assert _mode(root / "latest") == 0o600
    assert _mode(final) == 0o700
    files = list(final.iterdir())
    assert files and all(_mode(f) == 0o600 for f in files)


def test_output_permissions_widen_checkpoints(tmp_path: Path) -> None:
    cfg = make_config()
    assert cfg.outputs.permissions == "private"
    eng, _, _, _ = engine.initialize(
        model=make_model(n_blocks=2), device="cpu",
        config=dataclasses.replace(cfg, outputs=OutputsConfig(permissions="group")),
    )
    try:
        final = Path(eng.save_checkpoint(tmp_path / "new" / "ckpt", tag="g"))
    finally:
        eng.close()
    assert _mode(final) == 0o750 and _mode(tmp_path / "new" / "ckpt") == 0o750
    assert all(_mode(f) == 0o640 for f in final.iterdir())
    assert _mode(tmp_path / "new" / "ckpt" / "latest") == 0o640


def test_bad_permissions_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"outputs\.permissions.*'everyone'.*private"):
        load_config({"outputs": {"permissions": "everyone"}})


def test_metrics_file_and_trace_never_follow_a_link(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.symlink_to(victim)
    with MetricsWriter(str(metrics)) as w:
        w.write({"step": 1})
    assert victim.read_text() == "precious"
    assert json.loads(metrics.read_text()) == {"step": 1} and _mode(metrics) == 0o600
    new_dir = tmp_path / "fresh" / "m.jsonl"
    MetricsWriter(str(new_dir)).close()
    assert _mode(new_dir.parent) == 0o700
    tr = tmp_path / "trace.json"
    tr.symlink_to(victim)
    trace.Recorder().write(str(tr))
    assert victim.read_text() == "precious" and "traceEvents" in json.loads(tr.read_text())


def test_bench_json_never_follows_a_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = _victim(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "bench.json").symlink_to(victim)
    monkeypatch.setenv("TIERZERO_CACHE_DIR", str(cache))
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    assert main(["bench", "--quick", "--path", str(swap_dir), "--nvme-mib", "4"]) == 0
    assert victim.read_text() == "precious"
    assert _mode(cache / "bench.json") == 0o600
    assert "nvme_read_gbps" in json.loads((cache / "bench.json").read_text())


@root_only
def test_output_dir_of_another_user_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="tierzero.swap.safe_files"):
        make_output_dir(theirs)
    assert any("belongs to uid 65534" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierzero.swap.safe_files"):
        make_output_dir(tmp_path / "mine")
    assert not caplog.records
