"""The `train` section: what `tierzero train` trains, for how long, and where its files go.

Read only by the CLI's training job (engine/train/); the engine itself never
looks at it, so a DeepSpeed JSON config simply gets these defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tierzero.engine.config.fields import meta

Packing = Literal["auto", "pack", "pad"]


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
    tokenizer: str | None = field(
        default=None,
        metadata=meta(
            "null = the model directory's own tokenizer (tokenizer.json / tokenizer_config.json "
            "next to config.json), else byte-level; 'bytes' = UTF-8 bytes (vocabulary 256); a "
            "path = a tokenizer directory or tokenizer.json (loaded offline, needs the hf extra)",
            path=True,
        ),
    )
    dataset: str | None = field(
        default=None,
        metadata=meta(
            "training data: a .txt file, a .jsonl file of 'text', 'prompt'+'completion' or chat "
            "'messages' rows, a .parquet / .arrow file or a datasets save_to_disk directory "
            "(the data extra); null = the corpus shipped with tierzero",
            path=True,
        ),
    )
    packing: Packing = field(
        default="auto",
        metadata=meta(
            "pack = examples concatenated and cut into seq_len rows; pad = one example per "
            "row, cut to seq_len and padded; auto = random seq_len windows of the byte stream "
            "for plain text with the byte-level tokenizer and no epochs, else pack"
        ),
    )
    shuffle: bool = field(
        default=True, metadata=meta("shuffle the examples anew each epoch (seeded by seed)")
    )
    epochs: int = field(
        default=0,
        metadata=meta("passes over the data to run, replacing steps; 0 = run steps", ge=0),
    )
    eval_dataset: str | None = field(
        default=None,
        metadata=meta(
            "evaluation data, in any dataset form (a save_to_disk DatasetDict gives its "
            "validation, else test, split); null = eval_fraction of dataset, or none",
            path=True,
        ),
    )
    eval_fraction: float = field(
        default=0.0,
        metadata=meta("share of dataset held out for evaluation (seeded); 0 = none", ge=0, le=0.5),
    )
    eval_interval: int = field(
        default=0,
        metadata=meta(
            "with an evaluation set: evaluate before the first step, every this many steps and "
            "after the last; 0 = before the first and after the last only",
            ge=0,
        ),
    )
    eval_batches: int = field(
        default=0,
        metadata=meta("batches per rank per evaluation; 0 = the whole evaluation set", ge=0),
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
