"""I/O counters of a swap store, per direction."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DirectionStats", "SwapStats", "Traffic"]


@dataclass(frozen=True)
class DirectionStats:
    """One direction (read or write) since the store opened."""

    requests: int  # finished requests, failed ones included
    failed: int  # requests whose future raised
    bytes: int  # payload bytes of successful requests
    busy_seconds: float  # wall time with at least one request of this direction in service
    bounced_bytes: int  # bytes copied through an aligned bounce buffer

    @property
    def gbps(self) -> float:
        """Payload GB/s over busy time (0 when idle so far)."""
        return self.bytes / self.busy_seconds / 1e9 if self.busy_seconds > 0 else 0.0


@dataclass(frozen=True)
class SwapStats:
    write: DirectionStats
    read: DirectionStats
    file_bytes: int  # size of the data file (preallocated)
    used_bytes: int  # bytes held by stored keys (headers and padding included)
    keys: int
    direct: bool  # O_DIRECT in use
    # reads of kept regions (a snapshot copied out, SwapStore.read_kept); not in `read`
    kept_read: DirectionStats | None = None
    kept_regions: int = 0  # regions held by keep() now
    kept_retired_bytes: int = 0  # of those, file bytes their keys no longer point at


class Traffic:
    """Mutable counters for one direction; the store updates them under its lock."""

    def __init__(self) -> None:
        self.requests = 0
        self.failed = 0
        self.bytes = 0
        self.bounced = 0
        self.busy = 0.0
        self.active = 0
        self.since = 0.0

    def begin(self, now: float) -> None:
        if self.active == 0:
            self.since = now
        self.active += 1

    def end(self, now: float, nbytes: int, *, failed: bool) -> None:
        self.active -= 1
        if self.active == 0:
            self.busy += now - self.since
        self.requests += 1
        if failed:
            self.failed += 1
        else:
            self.bytes += nbytes

    def snapshot(self, now: float) -> DirectionStats:
        busy = self.busy + (now - self.since if self.active else 0.0)
        return DirectionStats(self.requests, self.failed, self.bytes, busy, self.bounced)
