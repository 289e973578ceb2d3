"""What `tierzero train`'s data pipeline costs: reading and tokenising rows, and per batch.

Builds a tiny byte-level BPE tokenizer with a chat template (as the tests do)
and N synthetic conversations, then times, in the same run:
  load   load_data on the chat .jsonl (template rendered per assistant turn to
         mask the prompt) against the baseline of the same conversations as
         plain-text rows (one encode per row, no template);
  batch  ExampleBatches.next() (packed rows, labels masked) against
         ByteBatches.next() (the byte-level random windows) at the same shape.
Medians of repeats; ratios against the baseline of the same run.

    python benchmarks/data_bench.py --rows 2000 --repeats 3 --out bench_out/data_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from data_helpers import chat_rows, tiny_tokenizer, write_jsonl
from machine import describe

from tierzero.engine.config.train import TrainConfig
from tierzero.engine.train.data import ByteBatches, load_bytes, load_data


def median_s(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=200, help="next() calls per timing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        tiny_tokenizer(d / "model")
        (d / "model" / "config.json").write_text("{}")
        chats = chat_rows(args.rows)
        write_jsonl(d / "chat.jsonl", chats)
        write_jsonl(d / "text.jsonl", [{"text": "\n".join(m["content"] for m in c["messages"])}
                                       for c in chats])
        tc = TrainConfig(model=str(d / "model"), dataset=str(d / "chat.jsonl"),
                         seq_len=args.seq_len, packing="pack")
        text_tc = replace(tc, dataset=str(d / "text.jsonl"))

        def load(c: TrainConfig) -> object:
            return load_data(c, micro=args.batch, accum=1, seed=0, rank=0, world=1)

        chat_load = median_s(lambda: load(tc), args.repeats)
        text_load = median_s(lambda: load(text_tc), args.repeats)
        data = load_data(tc, micro=args.batch, accum=1, seed=0, rank=0, world=1)
        tokens, source = load_bytes(None)
        windows = ByteBatches(tokens, args.seq_len, args.batch, seed=0, rank=0, source=source)

        def draw(b: object) -> None:
            for _ in range(args.batches):
                b.next()  # type: ignore[attr-defined]

        pack_s = median_s(lambda: draw(data.batches), args.repeats) / args.batches
        window_s = median_s(lambda: draw(windows), args.repeats) / args.batches
    result = {
        "machine": describe(), "rows": args.rows, "seq_len": args.seq_len, "batch": args.batch,
        "load_chat_s": chat_load, "load_text_s": text_load,
        "load_chat_x_text": chat_load / text_load,
        "chat_rows_per_s": args.rows / chat_load,
        "pack_next_us": pack_s * 1e6, "windows_next_us": window_s * 1e6,
        "pack_x_windows": pack_s / window_s,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
