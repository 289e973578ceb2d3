"""Tokenizers of `tierzero train`: UTF-8 bytes, or a Hugging Face tokenizer read from disk.

`train.tokenizer` null takes the model directory's own tokenizer when it has
one (tokenizer.json, tokenizer_config.json or tokenizer.model next to
config.json) and byte-level otherwise (the built-in models and the embedded
default); `bytes` forces byte-level; a path names a tokenizer directory or a
`tokenizer.json`. Hugging Face tokenizers load with `local_files_only`:
nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tierzero.engine.models import VOCAB
from tierzero.engine.train.data.errors import DataError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

Message = Mapping[str, str]  # {"role": ..., "content": ...}


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str  # for logs and the metrics header
    vocab_size: int  # every id is below this
    pad_id: int  # fills padded rows (never a target)
    end: list[int]  # appended after each document / reply: EOS, or "\n\n" for bytes
    has_chat_template: bool

    def encode(self, text: str, *, specials: bool) -> list[int]:
        """Token ids of `text`; `specials` adds the tokenizer's own (BOS) around it."""
        ...

    def encode_segments(self, segments: Sequence[tuple[str, bool]], *,
                        specials: bool) -> tuple[list[int], list[bool]]:
        """(ids, target) of the segments' concatenated text: a token is a target when it
        starts inside a segment marked True."""
        ...

    def render_chat(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        """The chat template applied to `messages`, as text (has_chat_template only)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


def encode_each(tok: Tokenizer, segments: Sequence[tuple[str, bool]], *,
                specials: bool) -> tuple[list[int], list[bool]]:
    """Segment by segment (specials only around the first): exact for bytes; for a
    tokenizer without character offsets, merges across a boundary are lost."""
    ids: list[int] = []
    target: list[bool] = []
    for i, (text, trained) in enumerate(segments):
        seg = tok.encode(text, specials=specials and i == 0) if text else []
        ids += seg
        target += [trained] * len(seg)
    return ids, target


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256): any text, nothing to download."""

    name = "bytes"
    vocab_size = VOCAB
    pad_id = 0
    has_chat_template = False

    def __init__(self) -> None:
        self.end = list(b"\n\n")

    def encode(self, text: str, *, specials: bool) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_segments(self, segments: Sequence[tuple[str, bool]], *,
                        specials: bool) -> tuple[list[int], list[bool]]:
        return encode_each(self, segments, specials=specials)

    def render_chat(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        raise DataError("byte-level tokenizer has no chat template")

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `transformers` tokenizer (fast or slow) loaded from local files."""

    def __init__(self, tok: Any, name: str) -> None:
        self._tok = tok
        self.name = name
        self.vocab_size = len(tok)
        eos = tok.eos_token_id
        self.end = [] if eos is None else [int(eos)]
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        self.pad_id = 0 if pad is None else int(pad)
        self.has_chat_template = getattr(tok, "chat_template", None) is not None

    def encode(self, text: str, *, specials: bool) -> list[int]:
        ids = self._tok(text, add_special_tokens=specials)["input_ids"]
        return [int(i) for i in ids]

    def encode_segments(self, segments: Sequence[tuple[str, bool]], *,
                        specials: bool) -> tuple[list[int], list[bool]]:
        """A fast tokenizer encodes the whole text once (as the model will see it at
        inference) and marks targets by character offsets; a slow one, segment by
        segment."""
        if not getattr(self._tok, "is_fast", False):
            return encode_each(self, segments, specials=specials)
        text = "".join(t for t, _ in segments)
        trained = [False] * (len(text) + 1)
        at = 0
        for seg, on in segments:
            if on:
                trained[at:at + len(seg)] = [True] * len(seg)
            at += len(seg)
        enc = self._tok(text, add_special_tokens=specials, return_offsets_mapping=True)
        ids = [int(i) for i in enc["input_ids"]]
        # a token starting inside a trained segment is a target; added special tokens
        # (BOS) have the empty span (0, 0) and are never targets
        target = [end > start and trained[start] for start, end in enc["offset_mapping"]]
        return ids, target

    def render_chat(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        text = self._tok.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=generation_prompt)
        return str(text)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))


def has_tokenizer_files(directory: str) -> bool:
    return os.path.isdir(directory) and any(
        os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES)


def model_directory(model: str) -> str | None:
    """The directory `train.model` names (a config.json's directory), or None (built-in)."""
    if model.startswith("builtin:"):
        return None
    if os.path.isdir(model):
        return model
    if os.path.isfile(model):
        return os.path.dirname(os.path.abspath(model))
    return None


def load_tokenizer(spec: str | None, model: str) -> Tokenizer:
    """The tokenizer `train.tokenizer` names for `train.model` (see the module doc)."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec is None:
        directory = model_directory(model)
        if directory is None or not has_tokenizer_files(directory):
            return ByteTokenizer()
        return _hf(directory, f"train.model '{model}' (its tokenizer)")
    if not os.path.exists(spec):
        raise DataError(f"train.tokenizer: '{spec}' does not exist; give a tokenizer directory, "
                        "a tokenizer.json, 'bytes', or null for the model directory's own")
    return _hf(spec, f"train.tokenizer '{spec}'")


def _hf(path: str, what: str) -> Tokenizer:
    if os.path.isdir(path) and not has_tokenizer_files(path):
        raise DataError(f"{what}: {path} holds none of {', '.join(TOKENIZER_FILES)}; save one "
                        "there (tokenizer.save_pretrained) or set train.tokenizer")
    try:
        import transformers
    except ImportError as exc:
        raise DataError(f"{what} needs the transformers package: pip install "
                        "'tierzero[hf]'") from exc
    try:
        tok: Any
        if os.path.isfile(path):  # a bare tokenizer.json
            tok = transformers.PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
                tokenizer_file=path)
        else:
            # never run code shipped with it (auto_map), never prompt on stdin for it
            tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                             trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise DataError(f"{what}: cannot load a tokenizer from {path} "
                        f"({type(exc).__name__}: {exc})") from exc
    return HFTokenizer(tok, path)
