"""SIGINT and SIGTERM during `tierzero train`: stop at a step boundary, or abandon the step.

[Note: stopping a run] Python's default SIGINT raises KeyboardInterrupt wherever the main
thread happens to be (inside a swap wait, an optimizer stream, a save), and SIGTERM (what
schedulers and `docker stop` send) kills the process without cleanup, leaving its swap
files behind. While `StopSignals` is entered, both signals only *ask* the run to stop:

- the step loop checks `requested` between steps (every rank agrees, loop.py), finishes
  the step in progress, optionally saves a checkpoint (train.save_on_interrupt), closes the
  engine (which removes its swap files) and reports "stopped at step N; resume with ...".
  The loop reports each finished step (`at_step`), so the warning logged on the signal
  names the last step finished before it, K: a run that stops at a boundary stops at K or
  K + 1 (at most the step in progress is finished, no new one starts);
- if the step in progress has not finished `grace_s` seconds after the first signal, or a
  second signal comes, the step is abandoned: `KeyboardInterrupt` is raised in the main
  thread (a BaseException: no `except Exception` handler rewraps it), nothing is saved
  (the step's state is half-updated), and the engine closes the same way.

The exit status is 128 + the signal number (130 for SIGINT, 143 for SIGTERM), as a shell
reports a process killed by it. Handlers are installed only in the main thread (Python
allows no other) and the previous ones are restored on exit.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType, TracebackType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Turns SIGINT/SIGTERM into a stop request for the training loop (see the Note)."""

    def __init__(self, grace_s: float = 4.0) -> None:
        self.grace_s = grace_s  # a step still running this long after the signal is abandoned
        self.signum: int | None = None  # the first stop signal received
        self.abandoned = False  # the step in progress was interrupted, not finished
        self.done = 0  # the last step finished (at_step), counted from the run's start
        self._previous: dict[int, object] = {}
        self._previous_alarm: object = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum if self.signum is not None else signal.SIGINT)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGINT).name

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            log.warning("%s received after step %d: stopping after the step in progress (a "
                        "second signal, or %.0f s without the step finishing, abandons it)",
                        signal.Signals(signum).name, self.done, self.grace_s)
            if self.grace_s > 0:
                signal.setitimer(signal.ITIMER_REAL, self.grace_s)
            return
        self._abandon()

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            self._abandon()

    def _abandon(self) -> None:
        if self.abandoned:
            return  # already unwinding: let the cleanup finish
        self.abandoned = True
        raise KeyboardInterrupt

    def at_step(self, step: int) -> None:
        """The run has finished `step` optimizer steps (counted from the start of training,
        a resumed run's included): the warning on a signal names it."""
        self.done = step

    def request(self, signum: int) -> None:
        """Stop as if `signum` had come here (another rank received it); the first request
        stands. No warning and no grace timer: the loop is already at a step boundary."""
        if self.signum is None:
            self.signum = signum

    def interrupted(self) -> None:
        """A KeyboardInterrupt reached the run: the step in progress was abandoned (SIGINT
        when none came through the handlers, a plain Ctrl-C off the main thread)."""
        self.request(signal.SIGINT)
        self.abandoned = True

    def step_done(self) -> None:
        """The loop reached a step boundary after the request: no step left to abandon."""
        if self.signum is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals go to the main thread only; nothing to install
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._previous_alarm = signal.signal(signal.SIGALRM, self._on_alarm)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._previous:
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._previous_alarm)  # type: ignore[arg-type]
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
