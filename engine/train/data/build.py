"""The data of one `tierzero train` run, composed in one place from config.train.

Order: tokenizer, rows (train and evaluation), the mode, then the batch
streams. Which mode:

- windows (train.packing auto, byte-level tokenizer, every row plain text, no
  epochs): random seq_len windows of the byte stream (stream.py), the
  built-in models' default; eval_fraction holds out the stream's tail;
- pack / pad (everything else; auto means pack): encoded examples
  (encode.py) in epochs (batches.py); eval_fraction holds out a seeded
  share of the rows.

All reading and tokenising happens here, before the model is built, so a bad
row stops the run before any work.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from importlib import resources

import torch

from tierzero.engine.config.train import TrainConfig
from tierzero.engine.train.data import rows as rows_mod
from tierzero.engine.train.data.batches import (
    Batch,
    Batches,
    ExampleBatches,
    Packing,
    eval_batches,
)
from tierzero.engine.train.data.encode import Example, all_text, describe_kinds, encode_all
from tierzero.engine.train.data.errors import DataError
from tierzero.engine.train.data.rows import Row
from tierzero.engine.train.data.stream import SHIPPED, ByteBatches, load_bytes
from tierzero.engine.train.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class TrainData:
    tokenizer: Tokenizer
    batches: Batches
    mode: str  # "windows", "pack" or "pad"
    source: str  # the training data, for logs and the metrics header
    steps: int  # optimizer steps the run takes: train.steps, or what train.epochs make
    eval: list[Batch] = field(default_factory=list)  # this rank's; [] = no evaluation
    eval_source: str | None = None
    per_epoch: int | None = None  # batches per rank per epoch (not in windows mode)


def check_data_settings(tc: TrainConfig) -> None:
    """Refuse, before any work, data settings that cannot work together or name nothing."""
    if tc.dataset is not None:
        rows_mod.check_path(tc.dataset, "train.dataset")
    if tc.eval_dataset is not None:
        rows_mod.check_path(tc.eval_dataset, "train.eval_dataset")
        if tc.eval_fraction:
            raise DataError(f"train.eval_dataset and train.eval_fraction ({tc.eval_fraction}) "
                            "are both set; give one (eval_fraction 0 with an eval_dataset)")
    if tc.tokenizer not in (None, "bytes") and not os.path.exists(tc.tokenizer):
        raise DataError(f"train.tokenizer: '{tc.tokenizer}' does not exist; give a tokenizer "
                        "directory, a tokenizer.json, 'bytes', or null for the model "
                        "directory's own")
    if tc.packing == "pad" and tc.dataset is None:
        raise DataError("train.packing: pad needs train.dataset with one example per row; the "
                        "shipped corpus is one stream (use auto or pack)")


def _rows(path: str | None, key: str, split: rows_mod.Split) -> tuple[list[Row], str]:
    if path is None:
        text = resources.files("tierzero.engine.data").joinpath("corpus.txt").read_text("utf-8")
        return rows_mod.text_rows(text.splitlines(keepends=True), "corpus.txt"), SHIPPED
    return rows_mod.read_rows(path, key, split), path


def load_data(tc: TrainConfig, *, micro: int, accum: int, seed: int, rank: int,
              world: int) -> TrainData:
    """Tokenizer, batches and evaluation set for this rank (see the module doc)."""
    check_data_settings(tc)
    tok = load_tokenizer(tc.tokenizer, tc.model)
    rows, source = _rows(tc.dataset, "train.dataset", "train")
    if not rows:
        raise DataError(f"{source} has no rows")
    eval_rows: list[Row] = []
    eval_source: str | None = None
    if tc.eval_dataset is not None:
        eval_rows, eval_source = _rows(tc.eval_dataset, "train.eval_dataset", "eval")
    windows = (tc.packing == "auto" and isinstance(tok, ByteTokenizer) and tc.epochs == 0
               and all_text(rows) and all_text(eval_rows))
    if windows:
        data = _windows(tc, rows, source, eval_rows, eval_source, micro=micro, seed=seed,
                        rank=rank, world=world)
    else:
        data = _examples(tc, tok, rows, source, eval_rows=eval_rows, eval_source=eval_source,
                         micro=micro, accum=accum, seed=seed, rank=rank, world=world)
    log.info("data: %s, %s tokenizer, %s mode%s%s", source, tok.name, data.mode,
             f", {data.per_epoch} batches per rank per epoch" if data.per_epoch else "",
             f", evaluation: {data.eval_source} ({len(data.eval)} batches per rank)"
             if data.eval else "")
    return data


def _windows(tc: TrainConfig, rows: list[Row], source: str, eval_rows: list[Row],
             eval_source: str | None, *, micro: int, seed: int, rank: int,
             world: int) -> TrainData:
    tok = ByteTokenizer()
    if tc.dataset is None or tc.dataset.endswith((".txt", ".jsonl")):
        tokens, _ = load_bytes(tc.dataset)  # the file's bytes as they are
    else:
        tokens = _stream(encode_all(rows, tok))
    evals: list[Batch] = []
    if tc.eval_fraction:
        cut = tokens.numel() - math.ceil(tc.eval_fraction * tokens.numel())
        held = Example(tokens[cut:].tolist(), [True] * (tokens.numel() - cut))
        tokens, eval_source = tokens[:cut], f"the last {tc.eval_fraction:g} of {source}"
        evals = _eval(tc, [held], "pack", 0, micro=micro, rank=rank, world=world,
                      source=eval_source)
    elif eval_rows:
        evals = _eval(tc, encode_all(eval_rows, tok), "pack", 0, micro=micro, rank=rank,
                      world=world, source=str(eval_source))
    batches = ByteBatches(tokens, tc.seq_len, micro, seed=seed, rank=rank, source=source)
    return TrainData(tok, batches, "windows", source, tc.steps, evals, eval_source)


def _stream(examples: list[Example]) -> torch.Tensor:
    return torch.tensor([i for e in examples for i in e.ids], dtype=torch.uint8)


def _examples(tc: TrainConfig, tok: Tokenizer, rows: list[Row], source: str, *,
              eval_rows: list[Row], eval_source: str | None, micro: int, accum: int,
              seed: int, rank: int, world: int) -> TrainData:
    packing: Packing = "pad" if tc.packing == "pad" else "pack"
    if tc.eval_fraction:
        # The same split on every rank: a permutation seeded by the run's seed.
        gen = torch.Generator().manual_seed(seed * 1000003 + 7919)
        order = torch.randperm(len(rows), generator=gen).tolist()
        n_eval = max(1, round(tc.eval_fraction * len(rows)))
        if n_eval >= len(rows):
            raise DataError(f"train.eval_fraction {tc.eval_fraction} of {source}'s {len(rows)} "
                            "rows leaves none to train on; use more rows or a smaller fraction")
        eval_rows = [rows[i] for i in sorted(order[:n_eval])]
        rows = [rows[i] for i in sorted(order[n_eval:])]
        eval_source = f"{n_eval} of the {len(rows) + n_eval} rows of {source}"
    log.info("rows of %s: %s", source, describe_kinds(rows))
    if not tok.end:
        log.warning("tokenizer %s has no EOS token: examples are not closed by one (packed "
                    "examples run into each other, replies are not taught to stop)", tok.name)
    examples = encode_all(rows, tok)
    _check_vocab(examples, tok, source)
    if packing == "pad":
        long = sum(len(e.ids) > tc.seq_len + 1 for e in examples)
        if long:
            log.warning("%d of %d rows of %s are longer than train.seq_len + 1 = %d tokens and "
                        "are cut", long, len(examples), source, tc.seq_len + 1)
    batches = ExampleBatches(examples, seq_len=tc.seq_len, batch_size=micro, packing=packing,
                             pad_id=tok.pad_id, shuffle=tc.shuffle, seed=seed, rank=rank,
                             world=world, source=source)
    steps = tc.steps
    if tc.epochs:
        steps = max(1, tc.epochs * batches.per_epoch // accum)
        log.info("train.epochs %d: %d batches per rank per epoch, %d micro-batches per step "
                 "-> %d steps (train.steps %d is not used)", tc.epochs, batches.per_epoch,
                 accum, steps, tc.steps)
    evals: list[Batch] = []
    if eval_rows:
        eval_examples = encode_all(eval_rows, tok)
        _check_vocab(eval_examples, tok, str(eval_source))
        evals = _eval(tc, eval_examples, packing, tok.pad_id, micro=micro, rank=rank,
                      world=world, source=str(eval_source))
    return TrainData(tok, batches, packing, source, steps, evals, eval_source,
                     per_epoch=batches.per_epoch)


def _eval(tc: TrainConfig, examples: list[Example], packing: Packing, pad_id: int, *,
          micro: int, rank: int, world: int, source: str) -> list[Batch]:
    return eval_batches(examples, seq_len=tc.seq_len, batch_size=micro, packing=packing,
                        pad_id=pad_id, rank=rank, world=world, limit=tc.eval_batches,
                        source=source)


def _check_vocab(examples: list[Example], tok: Tokenizer, source: str) -> None:
    top = max((max(e.ids) for e in examples if e.ids), default=-1)
    if top >= tok.vocab_size:
        raise DataError(f"{source}: token id {top} from {tok.name} is outside its vocabulary "
                        f"of {tok.vocab_size}")
