"""benchmarks/state_kernel_bench.py's comparison of two kernel sources in one process
(`--baseline-source`): both kernels run every choice, and each row carries the baseline's
time and the ratio, on a tiny shard."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import state_kernel_bench
from tierzero.offload.adam_build import compiled_kernel

needs_kernel = pytest.mark.skipif(compiled_kernel() is None,
                                  reason="no compiled CPU Adam kernel on this machine")


@needs_kernel
def test_baseline_source_rows(monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """The package's own built kernel as the baseline (a .so is loaded, not compiled: a
    compile of the source takes about 20 s)."""
    kernel = compiled_kernel()
    assert kernel is not None
    base = kernel.path
    monkeypatch.setattr(sys, "argv", ["state_kernel_bench", "--numel", "65536", "--threads",
                                      "1,2", "--repeats", "2", "--masters", "fp32,bf16",
                                      "--baseline-source", str(base)])
    state_kernel_bench.main()
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["baseline_source"] == str(base)
    assert len(doc["rows"]) == 2 * 6  # two thread counts x six state layouts
    for row in doc["rows"]:
        assert row["median_s"] > 0 and row["baseline_median_s"] > 0
        assert row["ratio_median"] > 0
        assert ("cpu_ratio_median" in row) == (row["threads"] == 1)


def test_a_baseline_that_does_not_compile_is_one_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "base.c"
    base.write_text("this is not C\n")
    monkeypatch.setattr(sys, "argv", ["state_kernel_bench", "--numel", "65536",
                                      "--baseline-source", str(base)])
    with pytest.raises(SystemExit, match="--baseline-source"):
        state_kernel_bench.main()


def test_a_missing_baseline_is_one_clear_error(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["state_kernel_bench", "--numel", "65536",
                                      "--baseline-source", str(tmp_path / "none.so")])
    with pytest.raises(SystemExit, match=r"--baseline-source .*none\.so: no such file"):
        state_kernel_bench.main()
