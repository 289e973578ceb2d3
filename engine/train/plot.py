"""`--plot FILE.png`: per-tier memory over the run and the stall time per step.

matplotlib is the optional `plot` extra; `require_matplotlib` is called before
training starts so a missing package fails fast.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence

from tierzero.engine.train.metrics import TIERS, StepRecord
from tierzero.swap.safe_files import write_atomic


class PlotError(RuntimeError):
    """The plot cannot be drawn (matplotlib missing)."""


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotError("--plot needs matplotlib: pip install 'tierzero[plot]'") from exc


def plot_run(records: Sequence[StepRecord], path: str, mode: int = 0o600) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, (mem, stall) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for tier, color in zip(TIERS, ("tab:blue", "tab:orange", "tab:green"), strict=True):
        mem.plot(steps, [r.tier_bytes[tier] / 1e6 for r in records], color=color,
                 label=f"{tier} now")
        mem.plot(steps, [r.tier_peak_bytes[tier] / 1e6 for r in records], "--", color=color,
                 label=f"{tier} peak")
    mem.set_ylabel("MB on this rank")
    mem.set_title("memory per tier")
    mem.legend(fontsize="small", ncol=3)
    stall.bar(steps, [r.compute_s for r in records], label="compute")
    stall.bar(steps, [r.wait_s for r in records], bottom=[r.compute_s for r in records],
              label="wait (gather / I/O)", color="tab:red")
    stall.bar(steps, [r.optimizer_s for r in records],
              bottom=[r.compute_s + r.wait_s for r in records], label="optimizer")
    stall.set_xlabel("step")
    stall.set_ylabel("seconds")
    stall.set_title("step time and stall per step")
    stall.legend(fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format=os.path.splitext(path)[1].lstrip(".").lower() or "png")
    plt.close(fig)
    write_atomic(path, buf.getvalue(), mode)  # never through a planted link
