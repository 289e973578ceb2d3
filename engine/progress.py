"""Progress bars for long engine operations (Init onto NVMe, checkpoint save and load).

One rule for all of them: shown on rank 0 only; `logging.progress` says
on/off, or `auto` (the default) for "when stderr is a terminal"; the
environment variable TIERZERO_PROGRESS (1/on, 0/off) overrides the config, so
a batch job can silence them without editing it.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Literal

from tqdm import tqdm

ENV = "TIERZERO_PROGRESS"
ProgressSetting = Literal["auto", "on", "off"]


def progress_enabled(setting: ProgressSetting, rank: int = 0) -> bool:
    if rank != 0:
        return False
    env = os.environ.get(ENV, "").strip().lower()
    if env in ("1", "on", "true", "yes"):
        return True
    if env in ("0", "off", "false", "no"):
        return False
    if setting != "auto":
        return setting == "on"
    return sys.stderr.isatty()


def progress_bar(setting: ProgressSetting | bool, rank: int = 0, **kwargs: Any) -> tqdm[Any]:
    """A tqdm bar on stderr, disabled by the rule above (a disabled bar costs nothing);
    a bool is an already-made decision."""
    shown = setting if isinstance(setting, bool) else progress_enabled(setting, rank)
    return tqdm(disable=not shown, file=sys.stderr, **kwargs)
