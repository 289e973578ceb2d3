"""`train.model` -> an nn.Module: a built-in size, or a Hugging Face config.

`builtin:<size>` builds engine.models.TinyLM (byte vocabulary). A path to a
Hugging Face `config.json` builds that architecture with fresh weights through
`transformers` (the `hf` extra); a model directory that also holds weight
files (`*.safetensors`, `*.bin`) is fine-tuned from them: the training job
loads them with `engine.load_pretrained` once the model is partitioned
(`pretrained_dir` says whether there are any). The model's vocabulary must
cover the tokenizer's: the 256 byte tokens, or the model directory's own
tokenizer (engine/train/data/tokenizer.py).
"""

from __future__ import annotations

import glob
import os
from typing import Any

from torch import nn

from tierzero.engine.models import SIZES, VOCAB, TinyLM, TinyLMConfig


class ModelError(ValueError):
    """`train.model` names something that cannot be built; the message says what is allowed."""


def load_hf_config(config_file: str, label: str) -> Any:
    """The Hugging Face config in `config_file`, read without running any code it ships
    (`auto_map`) and without prompting on stdin for it. `label` is how the user named the
    model (`train.model: 'dir'`, `--model 'dir'`); errors are ModelErrors that start with it."""
    try:
        import transformers
    except ImportError as exc:
        raise ModelError(f"{label} is a Hugging Face config, which needs the "
                         "transformers package: pip install 'tierzero[hf]'") from exc
    try:
        return transformers.AutoConfig.from_pretrained(config_file, trust_remote_code=False)
    except (ValueError, OSError, KeyError) as exc:
        raise ModelError(f"{label}: cannot read {config_file} as a Hugging Face "
                         f"config without running code it ships ({exc})") from exc


def describe_sizes() -> str:
    return ", ".join(f"builtin:{name}" for name in SIZES)


def builtin_config(spec: str) -> TinyLMConfig:
    size = spec.removeprefix("builtin:")
    if size not in SIZES:
        raise ModelError(f"train.model: unknown built-in size {size!r}; allowed: "
                         f"{describe_sizes()}, or a Hugging Face config.json / model directory")
    return SIZES[size]


def build_model(spec: str, seq_len: int, vocab: int = VOCAB,
                tokenizer: str = "bytes") -> nn.Module:
    """The module `spec` names, with seq_len checked against its context length and its
    vocabulary against the `vocab` ids of the tokenizer named `tokenizer`."""
    if spec.startswith("builtin:") or spec in SIZES:
        cfg = builtin_config(spec if spec.startswith("builtin:") else f"builtin:{spec}")
        if seq_len > cfg.max_seq_len:
            raise ModelError(f"train.seq_len {seq_len} exceeds {spec}'s context of "
                             f"{cfg.max_seq_len} tokens; lower train.seq_len")
        if vocab > VOCAB:
            raise ModelError(f"train.model {spec} has the byte vocabulary ({VOCAB}); tokenizer "
                             f"{tokenizer} has {vocab} tokens; set train.tokenizer: bytes or "
                             "train a Hugging Face model")
        return TinyLM(cfg)
    return _hf_model(spec, seq_len, vocab, tokenizer)


def pretrained_dir(spec: str) -> str | None:
    """`spec` when it is a model directory holding weight files, else None."""
    if spec.startswith("builtin:") or spec in SIZES or not os.path.isdir(spec):
        return None
    weights = [f for pattern in ("*.safetensors", "*.bin")
               for f in glob.glob(os.path.join(spec, pattern))]
    return spec if weights else None


def model_dir(spec: str) -> str | None:
    """The directory of a Hugging Face model spec (where its tokenizer files are), else None."""
    if spec.startswith("builtin:") or spec in SIZES:
        return None
    path = spec if os.path.isdir(spec) else os.path.dirname(os.path.abspath(spec))
    return path if os.path.isdir(path) else None


def _hf_model(path: str, seq_len: int, need: int, tokenizer: str) -> nn.Module:
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(config_file):
        raise ModelError(f"train.model: {path!r} is neither a built-in size ({describe_sizes()}) "
                         "nor a Hugging Face config.json or a directory holding one")
    hf_config = load_hf_config(config_file, f"train.model: {path!r}")
    vocab = getattr(hf_config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < need:
        needs = (f"byte-level training needs at least {VOCAB}" if tokenizer == "bytes" else
                 f"tokenizer {tokenizer} has {need} tokens")
        raise ModelError(f"train.model: {config_file} has vocab_size {vocab}; {needs}")
    context = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(context, int) and seq_len > context:
        raise ModelError(f"train.seq_len {seq_len} exceeds max_position_embeddings {context} "
                         f"of {config_file}; lower train.seq_len")
    import transformers

    model: nn.Module = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call,unused-ignore]
        hf_config, trust_remote_code=False)
    return model
