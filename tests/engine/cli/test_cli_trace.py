"""`tierzero train --trace` with NVMe offload: every event kind, from where it happens, with
sane times on its own thread's lane; and tracing off records nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tierzero.engine.cli import main
from tierzero.swap import trace
from tierzero.swap.trace import INSTANT_KINDS, KINDS, SPAN_KINDS

NVME_KINDS = {"nvme_read", "nvme_write", "copy", "adam", "prefetch", "evict", "writeback"}


def nvme_config(tmp_path: Path, steps: int = 3) -> Path:
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    cfg = {
        "seed": 3, "precision": "bf16",
        "optimizer": {"type": "adamw", "lr": 3.0e-3},
        "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
        # params and optimizer state on NVMe, so every tier moves bytes every step
        "offload": {"device": "nvme", "path": str(swap_dir)},
        "train": {"model": "builtin:tiny", "steps": steps, "seq_len": 32,
                  "out_dir": str(tmp_path / "runs")},
    }
    path = tmp_path / "nvme.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def events(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Spans and instants (not metadata, not the CPU's counters)."""
    return [e for e in doc["traceEvents"] if e["ph"] not in ("M", "C")]


def test_trace_every_kind_nested_in_steps(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert main(["train", str(nvme_config(tmp_path)), "--trace", str(out),
                 "--trace-steps", "2,2", "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    evs = events(doc)
    kinds = {e["cat"] for e in evs}
    # stall and prefetch depend on timing (a wait that found its transfer done is not a
    # stall; a shard whose cache is still there, or already on its way on demand, is not
    # prefetched: seen missing in the traced steps under load); evict and writeback only
    # under cache pressure or a dirty cache: the CPU Adam writes NVMe state straight from
    # its buffers (TierManager.write_from), so a step leaves no dirty cache to write back.
    # Those three are checked where they happen, in tests/offload/test_tiers_manager.py
    # (test_prefetch_evict_and_writeback_traced); the rest happen every step of an NVMe run
    # copy (host <-> device) happens with CUDA only: on a CPU params are gathered from
    # host memory ([Note: params gathered from host memory]; test_trace_on_cuda_has_copy_lanes)
    optional = {"stall", "prefetch", "evict", "writeback", "copy"}
    assert "copy" not in kinds
    assert kinds - optional == set(KINDS) - optional, set(KINDS) - kinds
    steps = sorted((e for e in evs if e["cat"] == "step"), key=lambda e: e["ts"])
    assert [e["name"] for e in steps] == ["step 2", "step 3"]
    assert steps[0]["ts"] + steps[0]["dur"] <= steps[1]["ts"] + 1e-3  # one after the other
    for e in evs:
        assert e["ts"] >= 0 and e["ph"] in ("X", "i")
        end = e["ts"] + e.get("dur", 0.0)
        assert e.get("dur", 0.0) >= 0
        # inside the traced steps (times are microseconds with a fraction: compare with a
        # nanosecond of slack); the training thread's events inside one step, while I/O
        # may run on across the boundary of two traced steps (a write-back of step 2
        # landing in step 3)
        assert steps[0]["ts"] - 1e-3 <= e["ts"] and end <= steps[-1]["ts"] + steps[-1][
            "dur"] + 1e-3, e
        if e["tid"] == 0:
            assert any(s["ts"] - 1e-3 <= e["ts"] and end <= s["ts"] + s["dur"] + 1e-3
                       for s in steps), e
        assert (e["ph"] == "X") == (e["cat"] in SPAN_KINDS)
        assert (e["ph"] == "i") == (e["cat"] in INSTANT_KINDS)
    # the CPU's track: one counter per sampled interval, from the recording's start to its
    # stop (the last interval cut short by the stop), each the process's cores and, where
    # /proc/stat counts it, the hypervisor's steal
    cpu = sorted((e for e in doc["traceEvents"] if e["ph"] == "C"), key=lambda e: e["ts"])
    assert cpu and {e["name"] for e in cpu} == {"cpu"}
    for e in cpu:
        assert steps[0]["ts"] - 1e-3 <= e["ts"] <= steps[-1]["ts"] + steps[-1]["dur"] + 1e-3
        assert set(e["args"]) in ({"process"}, {"process", "steal"}), e
        assert e["args"]["process"] >= 0 and e["args"].get("steal", 0.0) >= 0
    # lanes: the training thread is 0; I/O and copies run on their own named threads
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    lanes = {kind: {names[e["tid"]] for e in evs if e["cat"] == kind} for kind in kinds}
    assert all(n.startswith("tierzero-swap-io") for n in lanes["nvme_read"] | lanes["nvme_write"])
    assert {e["tid"] for e in evs if e["cat"] in ("step", "forward", "gather")} == {0}
    # bytes: every NVMe block and copy says how much it moved
    assert all(e["args"]["bytes"] > 0 for e in evs if e["cat"] in ("nvme_read", "nvme_write"))
    # per step: one Adam per trainable shard (3 units: 2 blocks + root)
    assert sum(e["cat"] == "adam" for e in evs) == 2 * 3
    # the metrics file of the same run: the tier manager's moves per step, in bytes
    (metrics,) = (tmp_path / "runs").glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps_m = [r for r in rows if r["event"] == "step"]
    for r in steps_m:
        assert set(r["moved_bytes"]) == {"nvme_to_host", "host_to_nvme", "host_to_device",
                                         "device_to_host"}
        assert r["moved_bytes"]["host_to_nvme"] > 0 and r["moved_bytes"]["nvme_to_host"] > 0
        assert r["moved_bytes"]["host_to_device"] == 0 and r["io_stall_s"] >= 0
    # the traced NVMe blocks add up to what the tier manager moved to and from NVMe in
    # the traced steps, give or take the write-backs still running at either edge (every
    # swap read and write is one of its transfers)
    written = sum(e["args"]["bytes"] for e in evs if e["cat"] == "nvme_write")
    read = sum(e["args"]["bytes"] for e in evs if e["cat"] == "nvme_read")
    # Both directions cross step boundaries: the CPU Adam's writes drain, and its reads
    # for the next step start, behind the next forward. Bytes issued in step 1 may land
    # in step 2 (they are in the trace), bytes issued in step 3 may land after it (they
    # are not).
    for direction, traced in (("host_to_nvme", written), ("nvme_to_host", read)):
        issued = [steps_m[i]["moved_bytes"][direction] for i in (0, 1, 2)]
        assert issued[1] <= traced <= sum(issued), direction
    # forward compute spans lie inside the forward span of their step
    forwards = [e for e in evs if e["cat"] == "forward"]
    for e in evs:
        if e["cat"] == "compute" and e["args"]["phase"] == "forward":
            assert any(f["ts"] <= e["ts"] and e["ts"] + e["dur"] <= f["ts"] + f["dur"] + 1e-3
                       for f in forwards)


def test_tracing_off_records_nothing(tmp_path: Path) -> None:
    """Structure, not timing: with no recorder every seam call returns the one shared no-op
    context, and a whole NVMe training run leaves no recorder behind."""
    assert trace.active() is None
    assert trace.span("copy", "x", bytes=1) is trace.span("adam", "y")  # the shared no-op
    trace.begin("compute", "u")
    trace.end("compute", "u")
    trace.instant("evict", "k")
    assert main(["train", str(nvme_config(tmp_path, steps=2)), "--no-progress"]) == 0
    assert trace.active() is None


def test_recorder_basics() -> None:
    rec = trace.Recorder(process="t")
    with trace.recording(rec):
        with trace.span("gather", "u", bytes=3):
            trace.instant("prefetch", "k", tier="host")
        trace.begin("compute", "u")
        with pytest.raises(RuntimeError, match="already active"), \
                trace.recording(trace.Recorder()):
            pass
        trace.begin("compute", "left open")
    assert trace.active() is None
    by_cat = {e["cat"]: e for e in rec.events}
    assert set(by_cat) == {"gather", "prefetch", "compute"}
    assert by_cat["gather"]["args"] == {"bytes": 3} and by_cat["gather"]["tid"] == 0
    g, p = by_cat["gather"], by_cat["prefetch"]
    assert g["ts"] <= p["ts"] <= g["ts"] + g["dur"]  # the mark lies inside the span
    # spans left open when recording stops are closed there, not lost
    assert sorted(e["name"] for e in rec.events if e["cat"] == "compute") == ["left open", "u"]
    with trace.span("copy", "after"):
        pass
    assert "copy" not in rec.kinds()  # recording is over


def test_recorder_samples_the_cpu_while_recording() -> None:
    """With cpu_interval_s the recording carries `cpu` counters from its start to its stop:
    each value holds until the next event, the last event is zeros, and the counters'
    process cores integrate to the CPU seconds the process spent in between (no more than
    measured around the recording, no less than measured around work inside it). The
    sampling thread is gone once recording stops."""
    import itertools
    import threading
    import time

    text = ("cpu  9 0 9 9 9 0 0 70 0 0\ncpu0 1 0 1 1 1 0 0 30 0 0\n"
            "cpu1 1 0 1 1 1 0 0 40 0 0\ncpu10 1 0 1 1 1 0 0 500 0 0\nintr 1 2\n")
    assert trace.steal_ticks({0}, text) == 30
    assert trace.steal_ticks({0, 1}, text) == 70
    assert trace.steal_ticks({10}, text) == 500  # cpu10 is not cpu1
    assert trace.steal_ticks({2}, text) is None  # no line for it
    assert trace.steal_ticks({0}, "cpu0 1 0 1 1 1 0 0\n") is None  # no steal column

    rec = trace.Recorder(process="t", cpu_interval_s=0.01)
    cpu0 = time.process_time()
    with trace.recording(rec):
        busy0 = time.process_time()
        deadline = time.perf_counter() + 0.1
        while time.perf_counter() < deadline:
            pass
        busy = time.process_time() - busy0
        with trace.span("compute", "u"):
            pass
    spent = time.process_time() - cpu0
    assert "tierzero-trace-cpu" not in {t.name for t in threading.enumerate()}
    counters = [e for e in rec.events if e["ph"] == "C"]
    assert len(counters) >= 2 and all(e["name"] == "cpu" and e["tid"] == 0 for e in counters)
    assert [e["ts"] for e in counters] == sorted(e["ts"] for e in counters)
    assert set(counters[-1]["args"].values()) == {0.0}  # where sampling stopped
    keys = {frozenset(e["args"]) for e in counters}
    assert keys in ({frozenset({"process"})}, {frozenset({"process", "steal"})})
    integral = sum(a["args"]["process"] * (b["ts"] - a["ts"]) / 1e6
                   for a, b in itertools.pairwise(counters))
    # process_time and the sampler's clock both count the whole process, every thread
    assert busy - 1e-3 <= integral <= spent + 1e-3, (busy, integral, spent)
    assert all(e["args"].get("steal", 0.0) >= 0.0 for e in counters)
    span = next(e for e in rec.events if e.get("cat") == "compute")
    assert counters[0]["ts"] <= span["ts"] <= counters[-1]["ts"]
    assert rec.kinds() == {"compute"}  # counters have no kind


@pytest.mark.cuda
def test_trace_on_cuda_has_copy_lanes(tmp_path: Path) -> None:
    """On a GPU the device tier is CUDA memory: host->device copies run on the tier
    manager's copy thread (its own CUDA stream), beside the training thread's compute."""
    out = tmp_path / "trace.json"
    assert main(["train", str(nvme_config(tmp_path)), "--trace", str(out),
                 "--trace-steps", "2,1", "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    evs = events(doc)
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    h2d = [e for e in evs if e["cat"] == "copy" and e["args"]["direction"] == "host_to_device"]
    assert h2d and all(names[e["tid"]].startswith("tierzero-h2d") for e in h2d)
    # every kind but those that depend on timing or cache pressure (as on the CPU, above;
    # with the GPU's device budget nothing is evicted), and the copies
    optional = {"stall", "prefetch", "evict", "writeback"}
    assert {e["cat"] for e in evs} - optional == set(KINDS) - optional
