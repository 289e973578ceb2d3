"""`tierzero plan`'s offload.optimizer.state_precision table (engine/plan/state_precision.py):
the moments' bytes and the NVMe bytes of a step per choice, checked by hand against the
dry run's fp32 count (offload nvme moves every NVMe-homed state byte once each way), and
placement with each precision's own moment bytes (a host budget that only compressed
moments fit)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from cli_helpers import BIG, MACHINE, plan_cli

from tierzero.engine.plan import model_shape, plan_all
from tierzero.engine.plan.planner import plan_choice
from tierzero.engine.plan.state_precision import precision_placements, precision_rows
from tierzero.offload.state_codec import bytes_per_param

MB = 10**6


def test_rows_scale_the_counted_step(tmp_path: Path) -> None:
    shape = model_shape("50M")
    plans = plan_all(shape, BIG, world_size=1, precision="bf16", nvme_path=str(tmp_path))
    placed = precision_placements(shape, BIG, plans, world_size=1, precision="bf16",
                                  nvme_path=str(tmp_path), max_in_cpu_bytes=0, chosen="fp32")
    rows = {(r.choice, r.precision): r for r in precision_rows(plans, placed, "fp32")}
    nvme = next(x for x in plans if x.choice == "nvme")
    p = nvme.by_tier["nvme"]["master"] // 4  # this rank's (padded) shard elements
    fp32 = rows[("nvme", "fp32")]
    assert (fp32.nvme_written, fp32.nvme_read) == (nvme.nvme_written, nvme.nvme_read)
    assert fp32.moments == 8 * p and fp32.moments_tier == "nvme"
    for prec in ("bf16", "int8"):
        r = rows[("nvme", prec)]
        saved = 8 * p - r.moments  # the placement's real bytes (int8: scales per piece)
        assert r.moments == pytest.approx(bytes_per_param(prec) * p, rel=1e-3)
        assert r.nvme_written == nvme.nvme_written - saved
        assert r.nvme_read == nvme.nvme_read - saved
        assert r.written_per_1000 == 1000 * r.nvme_written
    # 14 B/param written with fp32 moments (param 2 + master 4 + moments 8) -> 10 / ~8.03
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


def test_placement_uses_each_precisions_moment_bytes(tmp_path: Path) -> None:
    """Host budgets that the 50M model's state fits only with int8 moments: offload cpu
    places int8 and not fp32; offload auto puts fp32 moments partly on NVMe and int8 ones
    all in host memory. The table shows each precision's own placement."""
    shape = model_shape("50M")
    # int8 needs ~502 MB, fp32 ~800 (bf16 gradients: one rank, [Note: gradient precision])
    small = dataclasses.replace(BIG, host_bytes=520 * MB)
    cpu = {prec: plan_choice(shape, "cpu", small, world_size=1, precision="bf16",
                             state_precision=prec) for prec in ("fp32", "int8")}
    assert not cpu["fp32"].fits and "tier host is short" in str(cpu["fp32"].error)
    assert cpu["int8"].fits
    assert cpu["int8"].by_tier["host"]["exp_avg"] == pytest.approx(50 * MB * 1.016, rel=0.01)

    tight = dataclasses.replace(BIG, host_bytes=460 * MB)
    plans = plan_all(shape, tight, world_size=1, precision="bf16", nvme_path=str(tmp_path))
    auto = next(p for p in plans if p.choice == "auto")
    assert auto.by_tier["nvme"]["exp_avg_sq"] > 0  # fp32 moments spill to NVMe
    placed = precision_placements(shape, tight, plans, world_size=1, precision="bf16",
                                  nvme_path=str(tmp_path), max_in_cpu_bytes=0, chosen="fp32")
    int8 = placed[("auto", "int8")]
    assert int8.fits
    assert int8.by_tier["nvme"]["exp_avg"] == int8.by_tier["nvme"]["exp_avg_sq"] == 0
    rows = {(r.choice, r.precision): r for r in precision_rows(plans, placed, "fp32")}
    assert rows[("auto", "fp32")].moments_tier == "host+nvme"
    assert rows[("auto", "int8")].moments_tier == "host"
    # the same homes for everything else: the int8 row's NVMe bytes are the counted step
    # less the fp32 moments' NVMe bytes, read and written once each
    spilled = auto.by_tier["nvme"]["exp_avg"] + auto.by_tier["nvme"]["exp_avg_sq"]
    assert rows[("auto", "int8")].nvme_written == auto.nvme_written - spilled
    assert not rows[("cpu", "int8")].fits and rows[("cpu", "int8")].moments_tier == "-"

    # planned with int8 (the user allowed it): the counted plan itself places it in host
    plans8 = plan_all(shape, small, world_size=1, precision="bf16", nvme_path=str(tmp_path),
                      traffic=False, state_precision="int8")
    assert next(p for p in plans8 if p.choice == "cpu").fits


def test_cli_recommends_compressed_state_only_when_set(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "50M", *MACHINE, "--nvme-path", str(tmp_path)]
    code, out, _ = plan_cli(args, capsys)
    assert code == 0 and "state_precision: " not in out.split("recommended:")[1]
    code, out, _ = plan_cli([*args, "--state-precision", "int8"], capsys)
    assert code == 0
    assert "int8 (run)" in out
    rec = out.split("recommended:")[1]
    assert "state_precision: int8" in rec or "offload none" in rec
