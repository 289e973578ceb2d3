"""The `logging` and `outputs` sections: what the run logs and the files it writes.

Part of the config tree (schema.py's module doc says how a field is written).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tierzero.engine.config.fields import meta

LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True)
class LoggingConfig:
    """What the engine logs."""

    level: LogLevel = field(default="info", metadata=meta("log level of tierzero's loggers"))
    progress: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata=meta("progress bars for Init onto NVMe and checkpoint save/load (rank 0); auto "
                      "= when stderr is a terminal; env TIERZERO_PROGRESS=0/1 overrides"),
    )
    steps_per_print: int = field(
        default=10, metadata=meta("log loss, lr and throughput every this many steps", gt=0)
    )
    wall_clock_breakdown: bool = field(
        default=False, metadata=meta(
            "the engine logs (rank 0, every steps_per_print optimizer steps) the step's wall "
            "ms: forward, backward, step(), unit gathers, deferred-update waits, optimizer "
            "time hidden under compute, I/O stalls (engine/wall_clock.py)")
    )


@dataclass(frozen=True)
class OutputsConfig:
    """Files tierzero writes: checkpoints, metrics, bench results, plots, traces."""

    permissions: Literal["private", "group", "world"] = field(
        default="private",
        metadata=meta("who may read them: private = files 0600 and directories 0700 (like the "
                      "swap files of the same data); group = 0640/0750; world = 0644/0755"),
    )
    background_save_share: float = field(
        default=0.5,
        metadata=meta("a background checkpoint's writer is busy at most this share of the wall "
                      "time (it pauses between parts), so the training's CPU and disk come "
                      "first; 1 = never pause", gt=0, le=1),
    )
    background_save_copy_bytes: int = field(
        default=256 << 20,
        metadata=meta("host bytes a background checkpoint may hold in copies of host- or "
                      "device-resident state the training changes before the save has written "
                      "it; past this the step waits for the save to write that state", ge=0,
                      unit="bytes"),
    )
