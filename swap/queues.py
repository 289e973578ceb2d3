"""Which request the swap store serves next: runnable and in-service queues per class.

Three classes of request, each with its own `queue_depth` of requests in service, so a
request of one class never waits for a slot held by another: foreground (reads and
writes wanted now), background reads (read-ahead wanted later), and reads of kept
regions (a snapshot copied out by a background checkpoint, swap/kept.py). Not
thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections import deque

from tierzero.swap.future import Op
from tierzero.swap.request import Request

__all__ = ["IDLE_SHARE", "WRITE_SHARE", "RequestQueues"]

WRITE_SHARE = 4  # while reads wait, every 4th block slot still goes to writes
IDLE_SHARE = 8  # while anything else waits, every 8th block slot goes to kept-region reads
_CLASSES = ("fg", "bg", "idle")


def _class_of(req: Request) -> str:
    return "idle" if req.idle else "bg" if req.background else "fg"


class RequestQueues:
    """Runnable requests (dependencies done) wait here for a service slot; requests in
    service with blocks left to hand out are picked from block by block."""

    def __init__(self, queue_depth: int) -> None:
        self.queue_depth = queue_depth
        self._runnable: dict[str, deque[Request]] = {c: deque() for c in _CLASSES}
        self._in_service = dict.fromkeys(_CLASSES, 0)
        # in service with blocks left, oldest first: foreground per direction, the others
        self._issuing: dict[Op, deque[Request]] = {"read": deque(), "write": deque()}
        self._issuing_bg: deque[Request] = deque()
        self._issuing_idle: deque[Request] = deque()
        self._picks = 0

    def runnable(self, req: Request) -> None:
        self._runnable[_class_of(req)].append(req)

    def admit(self) -> Request | None:
        """The next runnable request with a free slot in its class, now counted in service
        (foreground first, then background reads, then kept-region reads)."""
        for c in _CLASSES:
            if self._runnable[c] and self._in_service[c] < self.queue_depth:
                self._in_service[c] += 1
                return self._runnable[c].popleft()
        return None

    def _issuing_of(self, req: Request) -> deque[Request]:
        if req.idle:
            return self._issuing_idle
        return self._issuing_bg if req.background else self._issuing[req.op]

    def issue(self, req: Request) -> None:
        self._issuing_of(req).append(req)

    def stop_issuing(self, req: Request) -> None:
        """A failed request hands out no more blocks."""
        queue = self._issuing_of(req)
        if req in queue:
            queue.remove(req)

    def finished(self, req: Request) -> None:
        self._in_service[_class_of(req)] -= 1

    def pick(self) -> tuple[Request, int] | None:
        """The next block to move.

        [Note: swap I/O order] Reads come first (they are on the critical path:
        prefetch, optimizer state in), but every WRITE_SHARE-th pick goes to a waiting
        write so writes never starve. Background reads (read-ahead wanted later: the CPU
        Adam's state for the coming backward) stand behind every other read: a parameter
        gather issued after them does not wait for them; against writes they count as
        reads.
        Within a queue the oldest request's blocks go out first, in file order, so
        the drive sees sequential streams, and requests finish in the order they
        were submitted (the order the engine needs them).
        Reads of kept regions (a background checkpoint copying a snapshot out) come
        last: they move when nothing else waits, and take every IDLE_SHARE-th pick
        otherwise, so a training that keeps the drive busy loses at most that share of
        its block slots and the checkpoint still finishes.
        """
        writes = self._issuing["write"]
        reads = self._issuing["read"] or self._issuing_bg
        idle = self._issuing_idle
        if not reads and not writes and not idle:
            return None
        self._picks += 1
        if idle and ((not reads and not writes) or self._picks % IDLE_SHARE == 0):
            queue = idle
        elif writes and (not reads or self._picks % WRITE_SHARE == 0):
            queue = writes
        else:
            queue = reads
        req = queue[0]
        index = req.next_block
        req.next_block += 1
        if req.all_issued():
            queue.popleft()
        return req, index
