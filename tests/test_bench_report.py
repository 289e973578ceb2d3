"""The benchmarks' report code on rows of both engines' shapes, without DeepSpeed.

step_bench once stopped at its first DeepSpeed row (`KeyError: 'hidden_s'`): tierzero's and
DeepSpeed's children write different fields. These rows carry the keys each child really
writes (step_bench.child, ds_runner.child, scale_bench's run_child), with made-up numbers.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from benchmarks import bench_report, ds_pairs


def _tierzero(config: str, step_s: float) -> dict[str, Any]:
    return {"config": config, "model": "mlp", "params": 1000, "step_s": step_s,
            "mean_step_s": step_s, "fwd_bwd_s": 0.2, "opt_s": 0.1, "adam_s": 0.05,
            "hidden_s": 0.12, "nvme_read_per_step": 3e6, "nvme_write_per_step": 2e6,
            "peak_rss_process": 900 << 20, "peak_rss_train": 800 << 20,
            "peak_gpu_bytes": 0, "nvme_io_s": 0.01, "overlap_eff": 0.9}


def _deepspeed(config: str, step_s: float) -> dict[str, Any]:
    return {"config": config, "model": "mlp", "params": 1000, "step_s": step_s,
            "mean_step_s": step_s, "fwd_bwd_s": 0.4, "opt_s": 0.3, "adam_s": 0.2,
            "nvme_read_per_step": 0.0, "nvme_write_per_step": 4096.0,
            "peak_rss_process": 1800 << 20, "peak_rss_train": 1600 << 20,
            "nvme_bytes_source": "/proc/self/io", "swap_file_bytes": 0,
            "deepspeed": "0.19.8", "ds_optimizer": "DeepSpeedCPUAdam",
            "gradient_clipping": 0.0, "ds_zero": {"stage": 3}, "nvme_io_s": 0.0,
            "overlap_eff": 0.5}


def test_median_row_keeps_each_engines_own_fields() -> None:
    rounds = [_deepspeed("ds_cpu", 0.9), _deepspeed("ds_cpu", 0.7), _deepspeed("ds_cpu", 0.8)]
    rounds[1]["overlap_eff"] = None  # an overlap without a bound in one round
    m = bench_report.median_row(rounds)
    assert m["step_s"] == pytest.approx(0.8)
    assert m["overlap_eff"] == pytest.approx(0.5)
    assert m["ds_zero"] == {"stage": 3} and m["ds_optimizer"] == "DeepSpeedCPUAdam"
    assert "hidden_s" not in m


def test_step_lines_and_ratios_for_both_shapes() -> None:
    med = {"plain": _tierzero("plain", 0.5), "cpu": _tierzero("cpu", 0.4),
           "cpu:clip": _tierzero("cpu:clip", 0.5), "ds_cpu": _deepspeed("ds_cpu", 1.0),
           "ds_cpu:clip": _deepspeed("ds_cpu:clip", 1.5)}
    ds_pairs.report_deepspeed("mlp", med)
    assert med["ds_cpu"]["vs_tierzero"] == pytest.approx(2.5)
    assert med["ds_cpu:clip"]["vs_tierzero"] == pytest.approx(3.0)
    assert med["ds_cpu:clip"]["tierzero_twin"] == "cpu:clip"
    assert med["ds_cpu"]["rss_vs_tierzero"] == pytest.approx(2.0)
    ds_line = bench_report.step_line("mlp", "ds_cpu", med["ds_cpu"])
    assert "hidden n/a" in ds_line and "step 1.000s" in ds_line
    tz_line = bench_report.step_line("mlp", "cpu", med["cpu"], gpu=True)
    assert "hidden 0.120" in tz_line and "peakGPU 0 MiB" in tz_line
    assert "peakGPU n/a" in bench_report.step_line("mlp", "ds_cpu", med["ds_cpu"], gpu=True)
    json.dumps(list(med.values()))  # what step_bench writes


def test_failed_deepspeed_row_is_reported_not_raised() -> None:
    med = {"cpu": _tierzero("cpu", 0.4),
           "ds_cpu": {"config": "ds_cpu", "model": "hf",
                      "failed": "exit 1: Traceback ...\nRuntimeError: no cpu_adam"}}
    ds_pairs.report_deepspeed("hf", med)
    assert "vs_tierzero" not in med["ds_cpu"]
    line = bench_report.step_line("hf", "ds_cpu", med["ds_cpu"])
    assert "step n/a" in line and "FAILED: RuntimeError: no cpu_adam" in line


def test_ds_twins_pair_clip_variants_and_both_nvme_rows() -> None:
    configs = ["plain", "cpu", "cpu:clip", "cpu:noover", "all_nvme:clip", "all_nvme_noverify"]
    assert ds_pairs.ds_twins(configs) == ["ds_cpu", "ds_cpu:clip", "ds_all_nvme:clip",
                                          "ds_all_nvme_nocache:clip"]
    # the twin that ran is preferred; the other all-NVMe row is a marked fallback
    med = {"all_nvme:clip": _tierzero("all_nvme:clip", 1.0),
           "ds_all_nvme:clip": _deepspeed("ds_all_nvme:clip", 2.0),
           "ds_all_nvme_nocache:clip": _deepspeed("ds_all_nvme_nocache:clip", 3.0)}
    ds_pairs.report_deepspeed("hf", med)
    assert med["ds_all_nvme_nocache:clip"]["twin_placement"] == "same placement"
    assert med["ds_all_nvme:clip"]["twin_placement"].startswith("DIFFERENT")


def test_scale_table_for_finished_killed_and_skipped_rows() -> None:
    tierzero = {"params": 2_067_130_880, "peak_rss_wait4": 2.7e9,
                "phases": [{"phase": "build", "s": 3.0, "peak_growth": 0.5e9},
                           {"phase": "initialize", "s": 60.0, "peak_growth": 1.2e9},
                           {"phase": "step 1", "s": 57.0, "peak_growth": 2.0e9, "loss": 10.4,
                            "nvme_read": 40e9, "nvme_written": 30e9}],
                "summary": {"step_s": 57.0, "nvme_read_per_step": 40e9,
                            "nvme_written_per_step": 30e9}}
    killed = {"wall_s": 200.0, "peak_rss_wait4": 15.1e9, "rss_trace_max": 14.9e9,
              "killed": "child RSS 15.0 GB over --child-max-rss 15.0 GB; not a measurement",
              "killed_phase": "initialize",
              "partial": [{"phase": "build", "s": 30.0, "peak_growth": 8.3e9}]}
    rows = {"tierzero": tierzero, "deepspeed:whole": killed,
            "deepspeed:zero_init": {"skipped": "no --deepspeed-python"}}
    table = bench_report.scale_table(rows)
    assert len(table) == 2 + len(rows)
    assert "| finished 1 step(s) | 2.70 GB | 0.50 GB | 1.20 GB | 57.0 | 40.00 / 30.00 GB |" \
        in table[2]
    assert "stopped at 15.1 GB during initialize" in table[3]
    assert "| 8.30 GB | n/a GB | n/a |" in table[3]
    assert "skipped: no --deepspeed-python" in table[4]


def test_scale_bench_watchdog_stops_a_child_over_its_rss_cap() -> None:
    import subprocess
    import sys

    from benchmarks import scale_bench

    # a child that touches 256 MiB and then waits; the cap is far below that
    code = "import time; b = bytearray(256 << 20); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], text=True)
    try:
        dog = scale_bench.Watchdog(proc, max_rss=64 << 20, min_available=0, timeout=30,
                                   period=0.05)
        dog.phase = "initialize"  # run_child sets it from the child's phase marks
        proc.wait(timeout=30)
        dog.join()
    finally:
        proc.kill()
        proc.wait()
    assert dog.why is not None and "--child-max-rss" in dog.why
    assert dog.killed_phase == "initialize"
    assert dog.rss_max > 64 << 20
    row = {"killed": dog.why, "killed_phase": dog.killed_phase, "peak_rss_wait4": dog.rss_max}
    assert bench_report.stopped_text(row).startswith(
        f"stopped at {dog.rss_max / 1e9:.1f} GB during initialize")


def test_scale_bench_watchdog_leaves_the_exited_child_to_wait4() -> None:
    """run_child reaps its child with os.wait4 for the child's rusage (peak RSS); a
    watchdog that reaped it first (Popen.poll) made that wait4 fail with ECHILD."""
    import os
    import subprocess
    import sys

    from benchmarks import scale_bench

    code = "b = bytearray(32 << 20)"  # exits at once
    proc = subprocess.Popen([sys.executable, "-c", code], text=True)
    try:
        dog = scale_bench.Watchdog(proc, max_rss=1 << 40, min_available=0, timeout=30,
                                   period=0.01)
        dog.join()  # its loop ends only once it has seen the child exit
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        if proc.returncode is None:
            proc.returncode = 0  # reaped above: Popen must not wait for it again
    assert os.waitstatus_to_exitcode(status) == 0
    assert usage.ru_maxrss * 1024 >= 32 << 20
    assert dog.why is None


def test_drive_seconds_is_the_slowest_of_each_direction_and_both_together() -> None:
    # 4 GB read at 2 GB/s, 2 GB written at 1 GB/s: 2 s each way; 6 GB both ways at 3 GB/s
    assert bench_report.drive_seconds(4e9, 2e9, 2.0, 1.0, 3.0) == pytest.approx(2.0)
    # a drive that shares its bandwidth between reads and writes: both at once bound it
    assert bench_report.drive_seconds(4e9, 2e9, 2.0, 1.0, 1.5) == pytest.approx(4.0)
    # one direction slower alone than both at once: that direction bounds it
    assert bench_report.drive_seconds(4e9, 0.0, 1.0, 1.0, 8.0) == pytest.approx(4.0)


def test_fastest_drive_takes_each_rate_at_its_highest() -> None:
    before = {"read_gbps": 2.0, "write_gbps": 1.5, "mixed_gbps": 1.8, "bytes": 1.0}
    after = {"read_gbps": 1.7, "write_gbps": 2.1, "mixed_gbps": 1.9, "bytes": 1.0}
    assert bench_report.fastest_drive(before, after) == {
        "read_gbps": 2.0, "write_gbps": 2.1, "mixed_gbps": 1.9}
    assert bench_report.fastest_drive(before) == {
        "read_gbps": 2.0, "write_gbps": 1.5, "mixed_gbps": 1.8}
    # the deep-queue rate where every measurement has one (rows before it had none)
    deep_before = {**before, "deep_mixed_gbps": 2.4}
    deep_after = {**after, "deep_mixed_gbps": 2.2}
    assert bench_report.fastest_drive(deep_before, deep_after)["deep_mixed_gbps"] == 2.4
    assert "deep_mixed_gbps" not in bench_report.fastest_drive(deep_before, after)


def test_scale_bench_fingerprints_the_weights_each_module_first_computes_with() -> None:
    import torch

    from benchmarks import scale_bench

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 90), torch.nn.ReLU(),
                                torch.nn.Linear(90, 5000, bias=False))
    seen = scale_bench._fingerprints(model)
    x = torch.randn(2, 100)
    model(x)
    first = dict(seen[0])
    # modules with parameters of their own only; small parameters summed whole, a large one
    # every 4099th element and its last 4096
    assert sorted(first) == ["0", "2"]
    w0, b0, w2 = model[0].weight, model[0].bias, model[2].weight
    assert first["0"] == float(w0.detach().double().sum()) + float(b0.detach().double().sum())
    flat = w2.detach().reshape(-1)
    assert first["2"] == (float(flat[::4099].double().sum())
                          + float(flat[-4096:].double().sum()))
    with torch.no_grad():
        w2.reshape(-1)[4099] += 1.0  # a sampled element
        w2.reshape(-1)[-1] += 2.0  # one of the last page's
        w0.reshape(-1)[17] += 4.0  # a small parameter's: every element counts
    model(x)  # a module's first call of the step is what counts
    assert seen[0] == first
    seen[:] = [{}]  # the next step
    model(x)
    assert seen[0]["0"] == pytest.approx(first["0"] + 4.0, abs=1e-5)  # fp32 elements
    assert seen[0]["2"] == pytest.approx(first["2"] + 3.0, abs=1e-5)
    assert scale_bench._digest(first) != scale_bench._digest(seen[0])
    assert scale_bench._digest(first) == scale_bench._digest(dict(first))


def test_scale_bench_set_puts_a_dotted_key_in_the_tierzero_config() -> None:
    import argparse

    import pytest

    from benchmarks import scale_bench

    key, value = scale_bench.parse_set("offload.optimizer.buffer_count=8")
    assert (key, value) == ("offload.optimizer.buffer_count", 8)  # a YAML value: an int
    config = {"offload": {"device": "nvme", "optimizer": {"state_precision": "int8"}}}
    scale_bench.set_dotted(config, key, value)
    # YAML 1.1 reads a bare off as false: the engine's string is quoted
    scale_bench.set_dotted(config, *scale_bench.parse_set("nvme.direct_io='off'"))
    assert config == {"offload": {"device": "nvme", "optimizer": {
        "state_precision": "int8", "buffer_count": 8}}, "nvme": {"direct_io": "off"}}
    for bad in ("nvme.threads", "=3", "nvme..threads=3"):
        with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
            scale_bench.parse_set(bad)
    with pytest.raises(SystemExit, match="'device' is not a section"):
        scale_bench.set_dotted(config, "offload.device.x", 1)


def test_scale_bench_sets_the_step_against_the_cpu_time_of_its_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """summarize() takes the steady step's CPU seconds over its cores as the CPU's bound,
    and the precision table prints it; each phase records its CPU seconds and cores."""
    import os
    from pathlib import Path

    from benchmarks import scale_bench

    monkeypatch.syspath_prepend(str(Path(scale_bench.__file__).parent))  # as when run

    def step(name: str, s: float, cpu: float, steal: float | None) -> dict[str, Any]:
        return {"phase": name, "s": s, "cpu_s": cpu, "cpu_sys_s": cpu / 4, "cores": 2,
                "steal_s": steal, "peak_growth": 1 << 30,
                "end_growth": 1 << 29, "loss": 1.0, "nvme_read": 4e9, "nvme_written": 2e9}

    row = {"peak_rss_wait4": 2 << 30,
           "phases": [step("step 1", 9.0, 15.0, 1.0), step("step 2", 8.0, 12.0, 2.0)]}
    bw = {"read_gbps": 2.0, "write_gbps": 2.0, "mixed_gbps": 2.0}
    s = scale_bench.summarize(row, bw, state_bytes=8 << 30)
    assert s["step_s"] == 8.0 and s["cpu_s"] == 12.0 and s["cores"] == 2
    assert s["cpu_sys_s"] == 3.0  # the median step's system part
    assert s["cpu_bound_s"] == pytest.approx(6.0)
    assert s["step_over_cpu_bound"] == pytest.approx(8.0 / 6.0)
    # the hypervisor's 2 s of the step counted as busy cores: (12 + 2) / 2
    assert s["steal_s"] == 2.0 and s["cpu_steal_bound_s"] == pytest.approx(7.0)
    assert s["step_over_cpu_steal_bound"] == pytest.approx(8.0 / 7.0)
    table = scale_bench.precision_table({"tierzero": {
        "summary": s, "disk": {"write_gbps": 2.0, "read_gbps": 2.0, "mixed_gbps": 2.0}}})
    assert "CPU s / cores | + steal" in table[0] and "| 6.0 s | 7.0 s |" in table[2]
    assert table[1].count("|") == table[0].count("|") == table[2].count("|")

    # a kernel that counts no steal: no machine bound, the rest as before
    row["phases"] = [step("step 1", 9.0, 15.0, None), step("step 2", 8.0, 12.0, None)]
    s = scale_bench.summarize(row, bw, state_bytes=8 << 30)
    assert "steal_s" not in s and "cpu_steal_bound_s" not in s
    assert s["cpu_bound_s"] == pytest.approx(6.0)
    assert "| 6.0 s | nan s |" in scale_bench.precision_table({"tierzero": {
        "summary": s, "disk": {"write_gbps": 2.0, "read_gbps": 2.0, "mixed_gbps": 2.0}}})[2]

    ph = scale_bench.Phases()
    got = ph.end("work", ph.start("work"))
    assert got["cpu_s"] >= got["cpu_sys_s"] >= 0.0
    assert got["cores"] == len(os.sched_getaffinity(0))
    assert got["steal_s"] is None or got["steal_s"] >= 0.0


def test_steal_seconds_sums_the_steal_column_of_the_cpus_asked_for() -> None:
    """/proc/stat's eighth number of each `cpuN` line, in clock ticks, summed over the CPUs
    asked for; None when a CPU's line is missing or has no steal column."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    text = ("cpu  100 0 50 900 10 0 5 70 0 0\n"
            "cpu0 50 0 25 450 5 0 2 30 0 0\n"
            "cpu1 50 0 25 450 5 0 3 40 0 0\n"
            "cpu12 1 0 1 1 1 0 0 500 0 0\n"
            "intr 12345\n")
    assert bench_report.steal_seconds([0], text) == pytest.approx(30 / tick)
    assert bench_report.steal_seconds([0, 1], text) == pytest.approx(70 / tick)
    assert bench_report.steal_seconds([12], text) == pytest.approx(500 / tick)  # not cpu1
    assert bench_report.steal_seconds([2], text) is None  # no such CPU
    assert bench_report.steal_seconds([0], "cpu0 50 0 25 450 5 0 2\n") is None  # old kernel
    live = bench_report.steal_seconds(sorted(os.sched_getaffinity(0)))
    assert live is None or live >= 0.0


def test_io_steal_bench_rates_and_its_io_threads(tmp_path: Any) -> None:
    """per_second turns two /proc/stat readings into each CPU's user and steal seconds per
    second of wall time; run_io's threads move whole requests through O_DIRECT, reading
    and writing, and report every byte they moved."""
    import mmap
    import os

    from benchmarks import io_steal_bench

    got = io_steal_bench.per_second({0: (10.0, 1.0), 1: (20.0, 2.0)},
                                    {0: (14.0, 2.0), 1: (22.0, 4.0)}, wall=4.0)
    assert got == {"cpu0": {"user": 1.0, "steal": 0.25}, "cpu1": {"user": 0.5, "steal": 0.5}}
    cpus = sorted(os.sched_getaffinity(0))
    live = io_steal_bench.cpu_columns(cpus)
    assert sorted(live) == cpus and all(u >= 0.0 for u, _ in live.values())

    request = 16 * mmap.PAGESIZE
    try:
        path = io_steal_bench.make_file(str(tmp_path), 8 * request, request)
    except OSError as e:  # tmpfs and some others refuse O_DIRECT
        pytest.skip(f"no O_DIRECT in {tmp_path}: {e}")
    assert os.path.getsize(path) == 8 * request
    for kind in ("read", "write"):
        moved = io_steal_bench.run_io(path, kind, threads=2, request=request,
                                      file_bytes=8 * request, seconds=0.2)
        assert moved > 0 and moved % request == 0
    assert os.path.getsize(path) == 8 * request  # writes stay inside the file


def test_io_steal_bench_refuses_bad_input_before_any_io(tmp_path: Any) -> None:
    """A bad option stops the script with one line naming the option and what it accepts,
    before it writes anything."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "io_steal_bench.py"
    cases = [(["--dir", str(tmp_path / "missing")], "--dir"),
             (["--dir", str(tmp_path), "--request", "1000"], "--request 1000: must be"),
             (["--dir", str(tmp_path), "--file-bytes", "4096"], "--file-bytes 4096"),
             (["--dir", str(tmp_path), "--repeats", "0"], "must be positive")]
    for args, said in cases:
        got = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                             text=True, check=False, timeout=120)
        assert got.returncode == 2 and said in got.stderr, (args, got.stderr)
    assert list(tmp_path.iterdir()) == []


def test_trace_summary_cpu_means_over_the_window_and_each_phase() -> None:
    """The `cpu` counters' values weighted by the time each holds (until the next event),
    over the whole window and over the training thread's forward, backward and optimizer
    spans, the rest as "other"; no cpu section without counters."""
    from benchmarks import trace_summary

    def span(cat: str, t0: float, t1: float, tid: int = 0) -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": cat, "pid": 0, "tid": tid,
                "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6}

    def cpu(t: float, process: float, steal: float) -> dict[str, Any]:
        return {"ph": "C", "name": "cpu", "pid": 0, "tid": 0, "ts": t * 1e6,
                "args": {"process": process, "steal": steal}}

    spans = [span("forward", 0.0, 2.0), span("backward", 2.0, 3.0),
             span("optimizer", 3.0, 3.5), span("nvme_read", 0.5, 3.9, tid=1),
             span("compute", 0.1, 1.0)]
    counters = [cpu(0.0, 1.0, 0.5), cpu(1.0, 2.0, 0.0), cpu(2.5, 1.5, 0.25),
                cpu(4.0, 0.0, 0.0)]
    got = trace_summary.summarize({"traceEvents": spans + counters})["cpu"]
    assert got["forward"] == {"s": 2.0, "process_cores": 1.5, "steal_cores": 0.25}
    # backward: 0.5 s at 2.0 then 0.5 s at 1.5
    assert got["backward"] == {"s": 1.0, "process_cores": 1.75, "steal_cores": 0.125}
    assert got["optimizer"] == {"s": 0.5, "process_cores": 1.5, "steal_cores": 0.25}
    assert got["other"] == {"s": 0.4, "process_cores": 1.5, "steal_cores": 0.25}  # 3.5-3.9
    whole = got["window"]
    assert whole["s"] == 3.9
    assert whole["process_cores"] == round((1.0 + 2.0 * 1.5 + 1.5 * 1.4) / 3.9, 3)
    assert "cpu" not in trace_summary.summarize({"traceEvents": spans})
