"""`tierzero plan` counts the swap room a speculated optimizer step keeps ([Note: speculated
step] in engine/step/speculation.py): every state class the update writes, where all of
them are homed on NVMe, and says whether the NVMe has room for it beside the swap's own."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import BIG, MACHINE, plan_cli

from tierzero.engine.plan import model_shape, plan_all


def test_speculation_bytes_are_the_written_state_on_nvme(tmp_path: Path) -> None:
    plans = {p.choice: p for p in plan_all(model_shape("50M"), BIG, world_size=1,
                                           precision="bf16", nvme_path=str(tmp_path))}
    nvme = plans["nvme"].by_tier["nvme"]
    assert plans["nvme"].speculation_bytes() == (nvme["master"] + nvme["exp_avg"]
                                                 + nvme["exp_avg_sq"] + nvme["param"]) > 0
    assert plans["cpu"].speculation_bytes() is None  # state in host memory: never speculated
    assert plans["none"].speculation_bytes() is None


def test_cli_says_whether_the_nvme_has_the_room(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan_cli(["--model", "50M", *MACHINE, "--nvme-path", str(tmp_path)], capsys)
    assert code == 0, out
    lines = out.splitlines()
    at = next(i for i, ln in enumerate(lines) if "speculated step: NVMe kept (max)" in ln)
    assert lines[at + 2].split()[0] == "nvme" and lines[at + 2].rstrip().endswith("yes"), out
    small = [a if a != "4TB" else "1.3GB" for a in MACHINE]
    code, out, _ = plan_cli(["--model", "50M", *small, "--nvme-path", str(tmp_path)], capsys)
    assert code == 0, out
    assert "no: the clipped update stays deferred into the next forward" in out
