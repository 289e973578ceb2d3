"""Background checkpoints in `tierzero train`: when each started and finished, and what the
steps it overlapped cost ([Note: background save] in engine/checkpoint/background.py).

metrics.jsonl gets a "checkpoint" line when a save returns (`phase` "started": the
seconds it held the training thread; "written": it was written before returning, with
the reason) and when it completes ("finished": its seconds, the steps that ran while it
was written, their median step time against the median of the undisturbed steps before,
the bytes it read from the snapshot and wrote, its writer's busy and paused seconds,
copies of host state taken before the steps changed it and the steps' waits for it).
Rank 0 logs the same in one line each.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tierzero.engine.checkpoint.background import PendingSave

log = logging.getLogger(__name__)

BASELINE_STEPS = 20  # undisturbed steps the slowdown is measured against (the latest)


@dataclass
class SaveTracker:
    """Follows the run's background saves; `write` emits a metrics line (rank 0)."""

    write: Callable[[dict[str, Any]], None] | None
    rank0: bool
    pending: PendingSave | None = None
    tag: str = ""
    step: int = 0
    overlapped: list[float] = field(default_factory=list)  # step_s of steps during the save
    undisturbed: deque[float] = field(default_factory=lambda: deque(maxlen=BASELINE_STEPS))

    def started(self, result: object, tag: str, step: int) -> None:
        """`result` of save_checkpoint for checkpoint `tag` saved after `step`."""
        self.finish()  # (the save waited for an earlier one already)
        if not isinstance(result, PendingSave):
            return
        held = result.stats.held_s
        if not result.background:
            self._emit({"phase": "written", "tag": tag, "step": step, "held_s": held,
                        "why": result.fallback},
                       "checkpoint %s written before training went on (%.2f s): %s", tag,
                       held, result.fallback)
            return
        self.pending, self.tag, self.step, self.overlapped = result, tag, step, []
        self._emit({"phase": "started", "tag": tag, "step": step, "held_s": held},
                   "checkpoint %s: background save started, the training thread was held "
                   "%.3f s", tag, held)

    def after_step(self, step_s: float) -> None:
        """A step finished in `step_s` seconds; a save that completed meanwhile is reported."""
        if self.pending is None:
            self.undisturbed.append(step_s)
            return
        began = time.perf_counter() - step_s
        finished = self.pending.stats.finished if self.pending.done() else None
        if finished is None or finished > began:  # the step ran (partly) during the save
            self.overlapped.append(step_s)
        if finished is not None:
            self.finish()

    def finish(self) -> None:
        """Wait for the pending save (its error is raised) and report it."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.wait()
        except KeyboardInterrupt:  # a step abandoned while waiting: so is its save
            self.pending = pending
            self.abandon()
            raise
        st = pending.stats
        base = statistics.median(self.undisturbed) if self.undisturbed else None
        during = statistics.median(self.overlapped) if self.overlapped else None
        ratio = during / base if during is not None and base else None
        self._emit({"phase": "finished", "tag": self.tag, "step": self.step,
                    "overlapped_steps": len(self.overlapped),
                    "overlapped_step_s": during, "undisturbed_step_s": base,
                    "slowdown": ratio, **st.as_json()},
                   "checkpoint %s: background save finished in %.1f s over %d steps (median "
                   "step %s vs %s undisturbed: %s); read %.1f MB of kept state, wrote %.1f MB, "
                   "writer busy %.1f s, paused %.1f s; %d host copies, steps waited %.2f s",
                   self.tag, (st.finished or st.started) - st.started, len(self.overlapped),
                   _s(during), _s(base), f"{ratio:.2f}x" if ratio is not None else "n/a",
                   st.read_bytes / 1e6, st.written_bytes / 1e6, st.busy_s, st.paused_s,
                   int(st.snapshot.get("copies", 0)), st.snapshot.get("wait_s", 0.0))

    def abandon(self) -> None:
        """The run is abandoned (a second SIGINT/SIGTERM, [Note: stopping a run]): the pending
        save stops at its next part, fails on every rank and leaves `latest` where it was;
        eng.close() waits for its writer to clean up."""
        pending, self.pending = self.pending, None
        if pending is not None and not pending.done():
            pending.job.cancel.set()
            log.warning("checkpoint %s: background save abandoned with the run; latest "
                        "still names the previous checkpoint", self.tag)

    def _emit(self, record: dict[str, Any], msg: str, *args: object) -> None:
        if self.write is not None:
            self.write({"event": "checkpoint", **record})
        if self.rank0:
            log.info(msg, *args)


def _s(x: float | None) -> str:
    return f"{x:.3f} s" if x is not None else "n/a"
