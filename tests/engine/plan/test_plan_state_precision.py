"""`tierzero plan`'s offload.optimizer.state_precision table (engine/plan/state_precision.py):
the moments' bytes and the NVMe bytes of a step per choice, checked by hand against the
dry run's fp32 count (offload nvme moves every NVMe-homed state byte once each way)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import BIG, MACHINE, plan_cli

from tierzero.engine.plan import model_shape, plan_all
from tierzero.engine.plan.state_precision import precision_rows
from tierzero.offload.state_codec import bytes_per_param


def test_rows_scale_the_counted_step(tmp_path: Path) -> None:
    shape = model_shape("50M")
    plans = plan_all(shape, BIG, world_size=1, precision="bf16", nvme_path=str(tmp_path))
    rows = {(r.choice, r.precision): r for r in precision_rows(plans)}
    nvme = next(x for x in plans if x.choice == "nvme")
    p = nvme.by_tier["nvme"]["master"] // 4  # this rank's (padded) shard elements
    fp32 = rows[("nvme", "fp32")]
    assert (fp32.nvme_written, fp32.nvme_read) == (nvme.nvme_written, nvme.nvme_read)
    assert fp32.moments == 8 * p and fp32.moments_tier == "nvme"
    for prec in ("bf16", "int8"):
        r = rows[("nvme", prec)]
        saved = int(8 * p * (1 - bytes_per_param(prec) / 8))
        assert r.nvme_written == nvme.nvme_written - saved
        assert r.nvme_read == nvme.nvme_read - saved
        assert r.written_per_1000 == 1000 * r.nvme_written
    # 14 B/param written with fp32 moments (param16 2 + master 4 + moments 8) -> 10 / ~8.03
    assert nvme.nvme_written == 14 * p
    assert rows[("nvme", "bf16")].nvme_written == 10 * p
    assert rows[("nvme", "int8")].nvme_written == pytest.approx(8.03 * p, rel=1e-3)
    cpu = rows[("cpu", "int8")]  # in host memory: smaller, no NVMe bytes saved
    assert cpu.moments_tier == "host" and cpu.moments < 2.04 * p
    assert cpu.nvme_written == 0


def test_cli_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan_cli(["--model", "50M", *MACHINE, "--nvme-path", str(tmp_path)], capsys)
    assert code == 0
    assert "state_precision" in out and "moments B/param" in out
    assert "int8" in out and "2.03" in out
