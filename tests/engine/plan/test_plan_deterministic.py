"""The plan's counted bytes do not depend on when a thread ran: the streamed step's
read-ahead runs on its own thread, and the dry run counts each read in the phase that
issued it (dry_run's phase_done waits for the read-ahead); a clipped run's deferred
update has no worker on a dry run. A reader slowed down counts the same bytes, phase by
phase and step by step, as one that keeps up."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tierzero import engine
from tierzero.engine.models import SIZES, TinyLM
from tierzero.engine.plan import dry_run
from tierzero.offload import AdamStream


def _counted(tmp_path: Path, clip: float) -> list[dict[str, Any]]:
    tmp_path.mkdir()
    config = engine.load_config({
        "zero": {"stage": 3, "persistence_threshold_bytes": 0}, "precision": "bf16",
        "gradient_clipping": clip,
        "offload": {"device": "nvme", "path": str(tmp_path), "buffer_count": 8}})
    with torch.device("meta"):
        module = TinyLM(SIZES["tiny"])
    return dry_run(module, config, steps=3).steps


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_slow_read_ahead_counts_the_same_bytes_per_phase(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clip: float) -> None:
    """clip 1.0: the update deferred into the next forward, run by the training thread
    as each unit's gather waits for it (no worker on a dry run)."""
    prompt = _counted(tmp_path / "a", clip)
    assert sum(t.nvme_read for s in prompt for t in s.values()) > 0
    issue = AdamStream._issue_read

    def slow(self: AdamStream, *args: Any) -> Any:
        time.sleep(0.02)  # the read-ahead thread lags the training thread
        return issue(self, *args)

    monkeypatch.setattr(AdamStream, "_issue_read", slow)
    assert _counted(tmp_path / "b", clip) == prompt
