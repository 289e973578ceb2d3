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
class LoraConfig:
    """LoRA adapters through `peft`: the base stays frozen (partitioned and offloaded like
    any parameter), only the adapters train and get optimizer state."""

    r: int = field(default=0, metadata=meta("adapter rank; 0 = no LoRA, every parameter trains",
                                            ge=0))
    alpha: float = field(default=16.0, metadata=meta("scaling numerator: updates are scaled "
                                                     "by alpha / r", gt=0))
    dropout: float = field(default=0.0, metadata=meta("dropout on the adapter input", ge=0,
                                                      le=1))
    target_modules: tuple[str, ...] = field(
        default=(),
        metadata=meta("module names (suffixes) that get adapters, e.g. [q_proj, v_proj]; "
                      "empty = peft's default for the architecture"),
    )


@dataclass(frozen=True)
class ExportConfig:
    """Hugging Face model directories written by `tierzero train` (Hugging Face models only):
    config.json, sharded safetensors and the source's tokenizer files, streamed one flat
    group at a time."""

    at_end: bool = field(default=True, metadata=meta(
        "write <dir>/final after the last step (skipped for built-in models)"))
    at_checkpoints: bool = field(default=False, metadata=meta(
        "also write <dir>/step<N> at every checkpoint (train.checkpoint_interval)"))
    dir: str | None = field(default=None, metadata=meta(
        "where exports go; null = <run dir>/hf", path=True))
    dtype: Literal["fp32", "bf16"] = field(default="fp32", metadata=meta(
        "dtype of the written weights (from the fp32 master of trained parameters)"))
    lora: Literal["adapter", "merged"] = field(default="adapter", metadata=meta(
        "with train.lora: adapter = a peft adapter directory (adapter_config.json + "
        "adapter_model.safetensors); merged = the base model with the adapters folded in"))
    max_shard_bytes: int = field(default=5 * 10**9, metadata=meta(
        "largest safetensors file; more weights are split over files with an index",
        gt=0, unit="bytes"))


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
    checkpoint_background: bool = field(
        default=True,
        metadata=meta("write checkpoints while training goes on: the save records the state "
                      "(offloaded state: swap regions kept, host state copied only before it "
                      "changes) and returns; false = every save finishes before the next step"),
    )
    save_on_interrupt: bool = field(
        default=False,
        metadata=meta("on SIGINT/SIGTERM, save step<N> (into checkpoint_dir) after the step in "
                      "progress finishes, before exiting; off = stop without saving"),
    )
    max_nonfinite_steps: int = field(
        default=3,
        metadata=meta("stop after this many optimizer steps in a row skipped for a non-finite "
                      "gradient norm (a non-finite loss stops at once)", gt=0),
    )
    out_dir: str = field(
        default="runs",
        metadata=meta("each run writes its files to a new directory inside this one", path=True),
    )
    lora: LoraConfig = field(default_factory=LoraConfig, metadata=meta(
        "LoRA adapters on a frozen base (needs the peft package: the hf extra)"))
    export: ExportConfig = field(default_factory=ExportConfig, metadata=meta(
        "Hugging Face model directories written at the end and at checkpoints"))
    report_to: Literal["none", "tensorboard"] = field(
        default="none",
        metadata=meta("also write the metrics as TensorBoard scalars (train/loss, "
                      "train/grad_norm, train/learning_rate, eval/loss, ...) to <run "
                      "dir>/tensorboard; needs the tensorboard extra"),
    )
    metrics_path: str | None = field(
        default=None,
        metadata=meta("JSONL metrics file, one line per step; null = <run dir>/metrics.jsonl",
                      path=True),
    )
