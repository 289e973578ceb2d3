"""MeasureJobs: gradient measurements on a worker thread while backward goes on ([Note:
gradients measured where they are reduced] in engine/step/streamed.py). What a step relies
on: every key's measurement comes back in key order, a job the worker has not started is
taken back by the caller, at most `backlog` jobs are unfinished after a submit, a failed
measurement is raised at the step naming its group, and `wait`/`forget` return only when
no job reads a shard any more."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tierzero.engine.step.measure import MeasureJobs
from tierzero.engine.step.precision import GradStat


@pytest.fixture
def worker() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(1)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True)


def stat(key: str) -> GradStat:
    return GradStat(float(len(key)), True)


class Gate:
    """A measurement that blocks on the worker until released; records who measured."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.started = threading.Event()
        self.where: dict[str, str] = {}

    def on_worker(self, key: str) -> GradStat:
        self.where[key] = "worker"
        self.started.set()
        assert self.open.wait(30)
        return stat(key)

    def here(self, key: str) -> GradStat:
        self.where[key] = "here"
        return stat(key)


def test_no_worker_measures_at_submit_on_the_callers_thread() -> None:
    seen: list[tuple[str, str]] = []

    def one(key: str) -> GradStat:
        seen.append((key, threading.current_thread().name))
        return stat(key)

    jobs = MeasureJobs(one)
    jobs.submit(["a", "bb"])
    me = threading.current_thread().name
    assert seen == [("a", me), ("bb", me)]
    assert jobs.collect(["bb", "a", "ccc"], set()) == {"bb": stat("bb"), "a": stat("a"),
                                                       "ccc": stat("ccc")}
    assert "a" not in jobs  # consumed


def test_jobs_not_started_are_taken_back_and_results_keep_key_order(
        worker: ThreadPoolExecutor) -> None:
    gate = Gate()
    jobs = MeasureJobs(gate.on_worker, measure_here=gate.here)
    jobs.worker = worker
    jobs.submit(["k1", "k22", "k333"])
    assert gate.started.wait(30)  # k1 runs on the worker (blocked); the others are queued
    gate.open.set()
    out = jobs.collect(["k333", "k22", "k1", "k4444"], set())
    assert list(out) == ["k333", "k22", "k1", "k4444"]
    assert out == {k: stat(k) for k in out}
    assert gate.where["k1"] == "worker"
    assert gate.where["k4444"] == "here"  # never submitted


def test_redo_is_measured_again_here(worker: ThreadPoolExecutor) -> None:
    calls: list[str] = []

    def one(key: str) -> GradStat:
        calls.append(key)
        return stat(key)

    jobs = MeasureJobs(one)
    jobs.worker = worker
    jobs.submit(["a", "b"])
    jobs.wait(["a", "b"])
    assert sorted(calls) == ["a", "b"]
    jobs.collect(["a", "b"], {"b"})
    assert sorted(calls) == ["a", "b", "b"]


def test_submit_keeps_at_most_backlog_jobs_unfinished(worker: ThreadPoolExecutor) -> None:
    release: dict[str, threading.Event] = {}
    ended: list[str] = []

    def one(key: str) -> GradStat:
        assert release[key].wait(30)
        ended.append(key)
        return stat(key)

    jobs = MeasureJobs(one, backlog=1)
    jobs.worker = worker
    for k in ("a", "b", "c"):
        release[k] = threading.Event()
    jobs.submit(["a"])
    release["a"].set()
    release["b"].set()
    jobs.submit(["b"])  # one unfinished at most: waits for a first
    assert "a" in ended
    jobs.submit(["c"])  # waits for b
    assert ended[:2] == ["a", "b"]
    release["c"].set()
    jobs.forget()  # waits for c
    assert ended == ["a", "b", "c"]


def test_a_failed_measurement_is_raised_at_collect_naming_its_group(
        worker: ThreadPoolExecutor) -> None:
    def one(key: str) -> GradStat:
        if key == "bad":
            raise OSError("swap file corrupted")
        return stat(key)

    jobs = MeasureJobs(one, backlog=1)
    jobs.worker = worker
    jobs.submit(["ok", "bad", "ok2"])  # the backlog wait does not raise it
    jobs.wait(["ok", "bad", "ok2"])
    with pytest.raises(RuntimeError, match=r"shard group 'bad'.*swap file corrupted"):
        jobs.collect(["ok", "bad", "ok2"], set())
    assert "ok" not in jobs  # consumed even so


def test_forget_waits_for_a_running_job(worker: ThreadPoolExecutor) -> None:
    gate = Gate()
    jobs = MeasureJobs(gate.on_worker)
    jobs.worker = worker
    jobs.submit(["x"])
    assert gate.started.wait(30)
    done = threading.Event()

    def forget() -> None:
        jobs.forget()
        done.set()

    t = threading.Thread(target=forget)
    t.start()
    assert not done.wait(0.2)  # still measuring: forget has not returned
    gate.open.set()
    t.join(30)
    assert done.is_set() and "x" not in jobs
