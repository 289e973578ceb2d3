"""`tierzero plan` with offload.optimizer.master_precision bf16 ([Note: bf16 master weights]
in offload/bf16_master.py): no master bytes on any tier, and the counted step's NVMe bytes
change by hand arithmetic against the fp32 master's (offload nvme, 50M parameters): the
master's 4 B/param written are gone, its 4 B/param read become the param's 2 B/param read
by the optimizer (less where the param is kept in host memory after its write)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import BIG, MACHINE, plan_cli

from tierzero.engine.plan import model_shape, plan_all


def test_bf16_master_drops_the_master_bytes(tmp_path: Path) -> None:
    shape = model_shape("50M")
    plans = {m: {p.choice: p for p in plan_all(shape, BIG, world_size=1, precision="bf16",
                                               nvme_path=str(tmp_path), master_precision=m,
                                               state_precision="int8")}
             for m in ("fp32", "bf16")}
    fp32, bf16 = plans["fp32"]["nvme"], plans["bf16"]["nvme"]
    p = fp32.by_tier["nvme"]["master"] // 4  # this rank's (padded) shard elements
    assert p > 0
    for choice in ("cpu", "nvme", "auto"):  # no master on any tier; each step counted
        assert all(plans["bf16"][choice].by_tier[t]["master"] == 0 for t in bf16.by_tier)
        assert plans["bf16"][choice].traffic_error is None, choice
        assert plans["bf16"][choice].adam_params >= p
    assert plans["bf16"]["none"].by_tier["device"]["master"] == 4 * p  # device Adam: fp32
    assert bf16.by_tier["nvme"]["param"] == fp32.by_tier["nvme"]["param"] == 2 * p
    assert bf16.nvme_written == fp32.nvme_written - 4 * p
    extra_read = bf16.nvme_read - (fp32.nvme_read - 4 * p)  # the param the optimizer reads
    assert 0 <= extra_read <= 2 * p
    assert bf16.checkpoint_bytes("nvme") == fp32.checkpoint_bytes("nvme") - 2 * p
    # int8 moments + bf16 master: bytes per parameter and step on the disk
    per_param = (bf16.nvme_read + bf16.nvme_written) / p
    assert per_param <= (fp32.nvme_read + fp32.nvme_written) / p - 6


def test_cli_counts_and_recommends_it_only_when_set(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "50M", *MACHINE, "--nvme-path", str(tmp_path), "--state-precision",
            "int8"]
    code, out, _ = plan_cli(args, capsys)
    assert code == 0 and "master_precision fp32" in out and "NVMe B/param/step" in out
    assert "master_precision" not in out.split("recommended:")[1]
    code, out, _ = plan_cli([*args, "--master-precision", "bf16"], capsys)
    assert code == 0 and "master_precision bf16" in out
    rec = out.split("recommended:")[1]
    assert "master_precision: bf16" in rec or "offload none" in rec
    code, _, err = plan_cli([*args, "--master-precision", "bf16", "--precision", "fp16"],
                            capsys)
    assert code == 1 and "--master-precision" in err and "--precision bf16" in err
