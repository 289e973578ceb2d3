"""The client of tests/fault_server.py: `tierzero` processes forked from a server that
imported tierzero once (test_faults_signals.py, test_faults_runs.py; the session fixture
`fault_server` in conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO

HERE = Path(__file__).resolve().parent


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
        line = self._line()
        kind, pid = line.split(maxsplit=1)
        assert kind == "pid", line
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
