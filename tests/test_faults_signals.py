"""SIGINT and SIGTERM sent to a real `tierzero train` process at random steps (issue 21):
exit 130/143, one "stopped at step N; resume with ..." line and no traceback, no swap file
left, and a resumed run continues with exactly the losses of an uninterrupted one (checked
on every 4th trial and the last: a resume is a second run).

Trials run in processes forked from tests/fault_server.py (the command's own `main`, no
fresh interpreter per trial). TIERZERO_FAULT_TRIALS sets the trials per signal (default
20); the seed of the random steps is printed, and TIERZERO_FAULT_SEED replays it.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import yaml

pytestmark = pytest.mark.faults

HERE = Path(__file__).resolve().parent
TRIALS = int(os.environ.get("TIERZERO_FAULT_TRIALS", "20"))
STEPS = 8  # the reference run's length; every resumed run trains up to it
RESUME_EVERY = 4  # every 4th trial (and the last) also resumes and compares losses
STOP_LINE = re.compile(r"tierzero train: stopped at step (\d+) \((SIGINT|SIGTERM)(; step \d+ "
                       r"abandoned)?\); (resume with train\.resume: true .*newest checkpoint "
                       r"(step\d+)\)|nothing to resume from.*)$")


class Server:
    """The fork server: run(args) starts one `tierzero` process and returns its pid."""

    def __init__(self, root: Path) -> None:
        # one torch thread per run: the trials are tiny, and the machine is shared
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
            [str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, str(HERE / "fault_server.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=root)
        self._n = 0
        self.root = root

    def _line(self) -> str:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        line = out.readline()
        assert line, "the fault server died"
        return line.strip()

    def start(self, args: list[str]) -> tuple[int, Path, Path]:
        self._n += 1
        out, err = self.root / f"out{self._n}.txt", self.root / f"err{self._n}.txt"
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps({"args": args, "stdout": str(out), "stderr": str(err)}) + "\n")
        stdin.flush()
        kind, pid = self._line().split()
        assert kind == "pid"
        return int(pid), out, err

    def wait(self, pid: int) -> int:
        kind, got, code = self._line().split()
        assert kind == "exit" and int(got) == pid
        return int(code)

    def run(self, args: list[str]) -> tuple[int, str]:
        pid, _, err = self.start(args)
        return self.wait(pid), err.read_text()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("server"))
    yield s
    s.close()


def _config(path: Path, swap: Path, **train: Any) -> Path:
    cfg = {
        "seed": 5, "precision": "fp32", "gradient_clipping": 1.0,
        "optimizer": {"type": "adamw", "lr": 3.0e-3},
        "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
        "logging": {"level": "warning"},
        "offload": {"device": "nvme", "path": str(swap)},
        "train": {"model": "builtin:tiny", "seq_len": 32, **train},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def _steps(out_dir: Path) -> dict[int, float]:
    """step -> loss of every run under out_dir (one run per directory)."""
    losses: dict[int, float] = {}
    for f in out_dir.glob("*/metrics.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "step":
                losses[rec["step"]] = rec["loss"]
    return losses


def _wait_for_step(out_dir: Path, step: int, pid: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for f in out_dir.glob("*/metrics.jsonl"):
            if f'"step": {step},' in f.read_text():
                return
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"step {step} not reached in {timeout} s")


@pytest.fixture(scope="module")
def reference(server: Server, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    root = tmp_path_factory.mktemp("reference")
    cfg = _config(root / "c.yaml", root / "swap", steps=STEPS, out_dir=str(root / "runs"))
    (root / "swap").mkdir()
    code, err = server.run(["train", str(cfg), "--no-progress"])
    assert code == 0, err
    losses = _steps(root / "runs")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_at_random_steps(server: Server, reference: dict[int, float],
                                tmp_path: Path, sig: signal.Signals) -> None:
    seed = int(os.environ.get("TIERZERO_FAULT_SEED", "0")) or random.randrange(1 << 30)
    print(f"TIERZERO_FAULT_SEED={seed}")
    rng = random.Random(seed)
    swap = tmp_path / "swap"
    swap.mkdir()
    for trial in range(TRIALS):
        root = tmp_path / f"t{trial}"
        ck = root / "ck"
        at = rng.randint(1, STEPS - 2)
        save_on_interrupt = trial % 2 == 1
        root.mkdir()
        cfg = _config(root / "c.yaml", swap, steps=1000,
                      checkpoint_interval=3, checkpoint_dir=str(ck),
                      save_on_interrupt=save_on_interrupt, out_dir=str(root / "runs"))
        pid, _, err_file = server.start(["train", str(cfg), "--no-progress"])
        _wait_for_step(root / "runs", at, pid)
        sent = time.monotonic()
        os.kill(pid, sig)
        code = server.wait(pid)
        took = time.monotonic() - sent
        err = err_file.read_text()
        where = f"trial {trial} (seed {seed}, {sig.name} after step {at}): {err[-2000:]}"
        assert code == 128 + sig, where
        assert "Traceback" not in err and "Error" not in err, where
        lines = [ln for ln in err.splitlines() if ln.startswith("tierzero train:")]
        assert len(lines) == 1, where
        m = STOP_LINE.match(lines[0])
        assert m is not None and m.group(2) == sig.name, where
        stopped = int(m.group(1))
        assert stopped >= at and took < 60, (took, where)  # no re-gather of the model on exit
        assert not list(swap.rglob("*.swp")), where
        newest = m.group(5)
        if save_on_interrupt and m.group(3) is None:  # a step boundary: stepN was saved
            assert newest == f"step{stopped}", where
        if newest is None:
            assert stopped < 3, where
            continue
        if trial % RESUME_EVERY and trial != TRIALS - 1:
            continue
        # resume to the reference's end: the same losses, bit for bit
        resume = _config(root / "r.yaml", swap, steps=STEPS, checkpoint_interval=3,
                         checkpoint_dir=str(ck), resume=True, out_dir=str(root / "rest"))
        code, err = server.run(["train", str(resume), "--no-progress"])
        assert code == 0, f"resume of {where}: {err[-2000:]}"
        rest = _steps(root / "rest")
        start = int(newest.removeprefix("step"))
        assert rest == {s: reference[s] for s in range(start + 1, STEPS + 1)}, where
