"""`tierzero bench`: measures, prints, saves JSON where `plan` looks; bad paths refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tierzero.engine.bench import results_path
from tierzero.engine.bench.measure import adam_state_key
from tierzero.engine.cli import main
from tierzero.offload.bf16_master import MASTER_PRECISIONS
from tierzero.offload.state_codec import STATE_PRECISIONS


def test_bench_quick_saves_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TIERZERO_CACHE_DIR", str(tmp_path / "cache"))
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--path", str(swap_dir), "--nvme-mib", "8",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for label in ("memory copy", "NVMe write", "NVMe read", "CPU Adam", "saved:"):
        assert label in printed
    saved = json.loads(Path(results_path()).read_text())
    assert saved == json.loads(out.read_text())
    assert Path(results_path()).parent == tmp_path / "cache"
    for key in ("memory_copy_gbps", "nvme_write_gbps", "nvme_read_gbps", "adam_params_per_s"):
        assert saved[key] > 0
    # the offloaded step's update per state layout, which `tierzero plan` times a run by
    layouts = {adam_state_key(s, m) for s in STATE_PRECISIONS for m in MASTER_PRECISIONS}
    assert set(saved["adam_params_per_s_by_state"]) == layouts
    assert all(rate > 0 for rate in saved["adam_params_per_s_by_state"].values())
    assert "CPU Adam, offloaded step, state int8+bf16master" in printed
    assert saved["nvme_path"] == str(swap_dir) and isinstance(saved["nvme_direct"], bool)
    assert saved["sizes"]["nvme_bytes"] == 8 << 20
    assert {"cpu", "cores", "torch"} <= set(saved["machine"])
    assert list(swap_dir.iterdir()) == []  # the store removed its scratch files
    if not torch.cuda.is_available():
        assert saved["h2d_gbps"] is None and saved["d2h_gbps"] is None


@pytest.mark.parametrize(("args", "needle"), [
    (["--path", "/no/such/dir"], "--path: '/no/such/dir' does not exist"),
    (["--nvme-mib", "0"], "--nvme-mib: 0 is not allowed"),
])
def test_bench_bad_arguments(args: list[str], needle: str, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TIERZERO_CACHE_DIR", str(tmp_path))
    assert main(["bench", "--quick", *args]) == 1
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.cuda
def test_bench_measures_device_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TIERZERO_CACHE_DIR", str(tmp_path))
    assert main(["bench", "--quick", "--path", str(tmp_path), "--nvme-mib", "8"]) == 0
    assert "host -> device (pinned)" in capsys.readouterr().out
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["h2d_gbps"] > 1 and saved["d2h_gbps"] > 1  # any PCIe link does > 1 GB/s
