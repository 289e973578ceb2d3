"""`tierzero plan` times the CPU Adam by the rate `tierzero bench` measured for the run's
own state layout (--state-precision, --master-precision): int8 moments and a bf16 master
update at about half fp32's rate, so a step timed by fp32's could be the CPU's, not the
drive's."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
from cli_helpers import plan_cli

from tierzero.engine.bench.measure import adam_state_key
from tierzero.engine.plan import model_shape, plan_all
from tierzero.engine.plan.command import _bench_speeds
from tierzero.engine.plan.planner import Machine, step_time

GB = 10**9
BY_STATE = {"fp32": 2e9, "bf16": 1.5e9, "int8": 1.2e9, "fp32+bf16master": 2.2e9,
            "bf16+bf16master": 1.4e9, "int8+bf16master": 1e9}


def bench_file(tmp_path: Path, *, by_state: bool) -> Path:
    doc = {"nvme_read_gbps": 6.0, "nvme_write_gbps": 5.0, "memory_copy_gbps": 20.0,
           "h2d_gbps": None, "adam_params_per_s": 3e9}
    if by_state:
        doc["adam_params_per_s_by_state"] = BY_STATE
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    return path


def namespace(bench: Path, state: str, master: str, **rates: float) -> argparse.Namespace:
    given = {k: rates.get(k) for k in ("nvme_read_gbps", "nvme_write_gbps", "copy_gbps",
                                        "adam_params_per_s")}
    return argparse.Namespace(bench=str(bench), state_precision=state, master_precision=master,
                              **given)


@pytest.mark.parametrize(("state", "master"), [("fp32", "fp32"), ("int8", "fp32"),
                                                ("int8", "bf16"), ("bf16", "bf16")])
def test_the_rate_of_the_run_s_own_layout(tmp_path: Path, state: str, master: str) -> None:
    notes: list[str] = []
    speeds = _bench_speeds(namespace(bench_file(tmp_path, by_state=True), state, master), notes)
    key = adam_state_key(state, master)
    assert speeds["adam_params_per_s"] == BY_STATE[key]
    assert dict(speeds["adam_rates"]) == BY_STATE  # every layout's, for the rows
    assert any(f"state {key}, as measured" in n for n in notes)


def test_a_bench_file_without_the_layouts_gives_fp32_adamw_s_rate_and_says_so(
        tmp_path: Path) -> None:
    notes: list[str] = []
    speeds = _bench_speeds(namespace(bench_file(tmp_path, by_state=False), "int8", "bf16"),
                           notes)
    assert speeds["adam_params_per_s"] == 3e9
    assert any("none for state int8+bf16master" in n and "rerun tierzero bench" in n
               for n in notes)


def test_the_command_line_rate_wins(tmp_path: Path) -> None:
    notes: list[str] = []
    speeds = _bench_speeds(namespace(bench_file(tmp_path, by_state=True), "int8", "bf16",
                                     adam_params_per_s=5e8), notes)
    assert speeds["adam_params_per_s"] == 5e8
    assert not any("CPU Adam rate" in n for n in notes)
    assert speeds["adam_rates"] == ()  # the file's other layouts are not comparable with it


def test_a_slower_layout_rate_lengthens_the_predicted_step(tmp_path: Path) -> None:
    """The plan's step time takes each phase's longest of drive, copies and CPU Adam: with
    the update's rate low enough the optimizer phase is the CPU's, and the step follows."""
    shape = model_shape("50M")
    times = {}
    for rate in (2e9, 1e7):
        machine = Machine(device_bytes=80 * GB, host_bytes=512 * GB, nvme_bytes=4000 * GB,
                          cuda=True, nvme_read_gbps=6.0, nvme_write_gbps=5.0, copy_gbps=25.0,
                          adam_params_per_s=rate)
        plan = {p.choice: p for p in plan_all(shape, machine, world_size=1, precision="bf16",
                                              nvme_path=str(tmp_path), state_precision="int8",
                                              master_precision="bf16")}["nvme"]
        times[rate] = step_time(plan.phases, machine)
        adam = plan.adam_params
    assert times[2e9] is not None and times[1e7] is not None
    assert times[1e7] >= adam / 1e7 > times[2e9]


def test_cli_names_the_rate_it_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = bench_file(tmp_path, by_state=True)
    code, out, _ = plan_cli(["--model", "50M", "--device-mem", "80GB", "--host-mem", "512GB",
                             "--nvme-size", "4TB", "--nvme-path", str(tmp_path), "--bench",
                             str(bench), "--state-precision", "int8", "--master-precision",
                             "bf16"], capsys)
    assert code == 0
    assert "CPU Adam rate: the offloaded step's with state int8+bf16master, as measured" in out


def test_each_state_precision_row_is_timed_by_its_own_layout_s_rate(tmp_path: Path) -> None:
    """The state_precision table's predicted step: the counted step with the row's moment
    bytes, timed by the rate bench measured for the row's layout; the run's own row is the
    traffic table's step; a layout without a measured rate has none."""
    from tierzero.engine.plan.state_precision import precision_placements, precision_rows

    shape = model_shape("50M")
    rates = {"fp32+bf16master": 2e9, "int8+bf16master": 1e7}  # bf16 moments: not measured
    machine = Machine(device_bytes=80 * GB, host_bytes=512 * GB, nvme_bytes=4000 * GB,
                      cuda=True, nvme_read_gbps=6.0, nvme_write_gbps=5.0, copy_gbps=25.0,
                      adam_params_per_s=rates["int8+bf16master"],
                      adam_rates=tuple(rates.items()))
    plans = plan_all(shape, machine, world_size=1, precision="bf16", nvme_path=str(tmp_path),
                     state_precision="int8", master_precision="bf16")
    placed = precision_placements(shape, machine, plans, world_size=1, precision="bf16",
                                  nvme_path=str(tmp_path), max_in_cpu_bytes=0, chosen="int8",
                                  master_precision="bf16")
    rows = {(r.choice, r.precision): r
            for r in precision_rows(plans, placed, "int8", machine, "bf16")}
    for choice in ("cpu", "nvme"):
        plan = next(p for p in plans if p.choice == choice)
        own, fp32 = rows[(choice, "int8")], rows[(choice, "fp32")]
        assert own.step_s == plan.step_s is not None
        assert own.step_s >= plan.adam_params / 1e7  # the CPU's at 1e7 elements a second
        assert fp32.step_s is not None and fp32.step_s < own.step_s  # 200x the rate
        assert rows[(choice, "bf16")].step_s is None
    # at one rate, fast enough that the drive is the limit, the row that moves more
    # moment bytes (fp32's 8 B/param against bf16's 4) takes longer
    fast = dataclasses.replace(machine, adam_rates=(("fp32+bf16master", 1e12),
                                                    ("bf16+bf16master", 1e12)))
    rows = {(r.choice, r.precision): r
            for r in precision_rows(plans, placed, "int8", fast, "bf16")}
    fp32, bf16 = rows[("nvme", "fp32")], rows[("nvme", "bf16")]
    assert fp32.step_s is not None and bf16.step_s is not None
    assert fp32.nvme_read is not None and bf16.nvme_read is not None
    assert fp32.nvme_read > bf16.nvme_read and fp32.step_s > bf16.step_s


@pytest.mark.parametrize(("content", "needle"), [
    ("{not json", "is not a readable JSON file"),
    ("[1, 2]", "holds list, not the JSON object"),
    ('{"nvme_read_gbps": "fast"}', "nvme_read_gbps is 'fast'; allowed: a number > 0"),
    ('{"adam_params_per_s": -1}', "adam_params_per_s is -1; allowed: a number > 0"),
    ('{"adam_params_per_s_by_state": [1]}', "adam_params_per_s_by_state is [1]"),
    ('{"adam_params_per_s_by_state": {"int8": true}}',
     "adam_params_per_s_by_state['int8'] is True; allowed: a number > 0"),
])
def test_a_bad_bench_file_is_one_error_naming_file_and_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, needle: str) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(content)
    code, _, err = plan_cli(["--model", "50M", "--device-mem", "80GB", "--host-mem", "512GB",
                             "--nvme-size", "4TB", "--nvme-path", str(tmp_path), "--bench",
                             str(bench)], capsys)
    assert code == 1
    assert "--bench" in err and str(bench) in err and needle in err
    assert len(err.strip().splitlines()) == 1
