"""Starts `tierzero train` processes quickly, for the interrupt trials (test_faults_signals.py).

Run as a subprocess: it imports tierzero (and torch) once, computes nothing (so no thread
pool exists to break a fork: checked before every fork, the process must have exactly one
thread), then per request line `<json list of CLI args>` on stdin
forks a child that is exactly the `tierzero` command (`main(["train", ...])`, stdout and
stderr to files, default signal dispositions) and answers `pid <N>`; when a child ends
it answers `exit <N> <status>` with the shell's convention (128 + signal when killed). The
test sends its signals to the child's pid. A fork costs milliseconds where a fresh
interpreter costs seconds of imports, which is what makes 40 trials affordable.

torch._dynamo is imported here too: torch.optim.Optimizer.__init__ imports it on first
use (torch._disable_dynamo), 2-6 s per process on a 2-core machine, which a child would
otherwise pay in every trial. The import starts no thread (the check above holds after it).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import traceback

import torch._dynamo  # noqa: F401  (see the module docstring)

from tierzero.engine.cli import main


def _child(args: list[str], out: str, err: str) -> None:
    fd_out = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    fd_err = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd_out, 1)
    os.dup2(fd_err, 2)
    sys.stdin.close()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
    code = 1
    try:
        code = main(args)
    except BaseException:  # what the interpreter would print for an uncaught exception
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # as the `tierzero` script's exit would: finalizers run
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never back into the server's loop


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only children get the test's signals
    for line in sys.stdin:
        request = json.loads(line)
        if _threads() != 1:  # a fork would copy locks other threads may hold
            sys.stdout.write(f"error the server has {_threads()} threads; fork is unsafe\n")
            sys.stdout.flush()
            return
        pid = os.fork()
        if pid == 0:
            _child(request["args"], request["stdout"], request["stderr"])
        sys.stdout.write(f"pid {pid}\n")
        sys.stdout.flush()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        sys.stdout.write(f"exit {pid} {code if code >= 0 else 128 - code}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
