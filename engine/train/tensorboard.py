"""TensorBoard output of `tierzero train` (train.report_to: tensorboard).

The events of the metrics file ([Note: metrics file] in metrics.py) written as TensorBoard
scalars under the names a Hugging Face Trainer user looks for (its TensorBoardCallback
puts "eval_*" logs under "eval/" and the rest under "train/"):

    step   train/loss, train/learning_rate, train/grad_norm (before clipping; left out for
           a skipped step), train/clip_coef; tierzero/... for the step's time split,
           tokens/s, resident memory and bytes per tier
    eval   eval/loss
    run    the resolved config as text ("config", as the Trainer writes its args)

Event files go to <run dir>/tensorboard: `tensorboard --logdir runs` shows every run.
Needs the `tensorboard` package (pip install 'tierzero[tensorboard]'); its absence is an
error before any work starts (`require_tensorboard`).
"""

from __future__ import annotations

import importlib.util
import json
import math
from typing import Any

from tierzero.engine.train.checkpoints import TrainError
from tierzero.swap.safe_files import OutputModes, make_output_dir

# step-event fields written under tierzero/ as they are (seconds, bytes, rates)
_STEP_EXTRAS = ("step_s", "compute_s", "wait_s", "optimizer_s", "optimizer_hidden_s",
                "tokens_per_s", "rss_bytes", "io_stall_s", "nvme_read_gbps", "nvme_write_gbps",
                "cpu_cores", "steal_cores")


def require_tensorboard() -> None:
    """TrainError naming the key and the fix when the tensorboard package is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise TrainError("train.report_to: tensorboard needs the tensorboard package: "
                         "pip install 'tierzero[tensorboard]' (or set report_to: none)")


class TensorBoardSink:
    """Writes metrics-file events as TensorBoard scalars; see the module docstring."""

    def __init__(self, log_dir: str, modes: OutputModes) -> None:
        require_tensorboard()
        make_output_dir(log_dir, modes)  # ours, as every output directory of the run
        # torch's writer (what the Trainer uses); it imports the tensorboard package
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer: Any = SummaryWriter(log_dir=log_dir)

    def write(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        w = self._writer
        if kind == "step":
            step = int(event["step"])
            scalars: dict[str, Any] = {
                "train/loss": event["loss"], "train/learning_rate": event["lr"],
                "train/grad_norm": event["grad_norm"], "train/clip_coef": event["clip_coef"]}
            scalars.update({f"tierzero/{k}": event.get(k) for k in _STEP_EXTRAS})
            for tier, n in event["tier_peak_bytes"].items():
                scalars[f"tierzero/peak_{tier}_bytes"] = n
            for tag, value in scalars.items():
                if value is not None and math.isfinite(float(value)):
                    w.add_scalar(tag, float(value), step)
        elif kind == "eval":
            w.add_scalar("eval/loss", float(event["eval_loss"]), int(event["step"]))
        elif kind == "run":
            w.add_text("config", "```\n" + json.dumps(event.get("config"), indent=1) + "\n```")
        w.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
