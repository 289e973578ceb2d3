"""The `train` section: what `tierzero train` trains, for how long, and where its files go.

Read only by the CLI's training job (engine/train/); the engine itself never
looks at it, so a DeepSpeed JSON config simply gets these defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierzero.engine.config.fields import meta


@dataclass(frozen=True)
class TrainConfig:
    """The main job: model, data, steps, checkpoints, output files."""

    model: str = field(
        default="builtin:small",
        metadata=meta(
            "builtin:<size> (tiny, small, base), a Hugging Face config.json, or a model "
            "directory holding one (needs the hf extra)"
        ),
    )
    dataset: str | None = field(
        default=None,
        metadata=meta(
            "a .txt file or a .jsonl file with a 'text' field per line, byte-level tokenised; "
            "null = the corpus shipped with tierzero",
            path=True,
        ),
    )
    steps: int = field(default=40, metadata=meta("optimizer steps to run", gt=0))
    seq_len: int = field(default=128, metadata=meta("tokens per sample", gt=1))
    checkpoint_interval: int = field(
        default=0, metadata=meta("save a checkpoint every this many steps; 0 = never", ge=0)
    )
    checkpoint_dir: str | None = field(
        default=None, metadata=meta("where checkpoints go; null = <run dir>/checkpoints", path=True)
    )
    resume: bool | str = field(
        default=False,
        metadata=meta(
            "continue a run (step count, lr schedule, data position): true = from the latest "
            "checkpoint in checkpoint_dir; a path = from that checkpoint directory's latest, "
            "or from one checkpoint (a directory holding manifest.json)",
            path=True,
        ),
    )
    out_dir: str = field(
        default="runs",
        metadata=meta("each run writes its files to a new directory inside this one", path=True),
    )
    metrics_path: str | None = field(
        default=None,
        metadata=meta("JSONL metrics file, one line per step; null = <run dir>/metrics.jsonl",
                      path=True),
    )
