"""Training data of `tierzero train`: tokenizers, dataset files, batches, evaluation sets.

rows.py reads files into rows, tokenizer.py loads the tokenizer, encode.py
turns rows into token ids with a loss mask, batches.py packs or pads them
into epochs, stream.py keeps the byte-level random windows, and build.py
composes one run's data from config.train.
"""

from tierzero.engine.train.data.batches import (
    IGNORE,
    Batch,
    Batches,
    ExampleBatches,
    eval_batches,
    split_rows,
)
from tierzero.engine.train.data.build import TrainData, check_data_settings, load_data
from tierzero.engine.train.data.encode import Example, encode
from tierzero.engine.train.data.errors import DataError
from tierzero.engine.train.data.rows import Row, read_rows
from tierzero.engine.train.data.stream import SHIPPED, ByteBatches, load_bytes
from tierzero.engine.train.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "IGNORE",
    "SHIPPED",
    "Batch",
    "Batches",
    "ByteBatches",
    "ByteTokenizer",
    "DataError",
    "Example",
    "ExampleBatches",
    "HFTokenizer",
    "Row",
    "Tokenizer",
    "TrainData",
    "check_data_settings",
    "encode",
    "eval_batches",
    "load_bytes",
    "load_data",
    "load_tokenizer",
    "read_rows",
    "split_rows",
]
