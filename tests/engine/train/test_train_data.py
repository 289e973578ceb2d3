"""Training data: tokenizers, row formats, prompt masking, packing/padding, epochs, files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from data_helpers import SPECIALS, chat_rows, tiny_tokenizer, write_jsonl

from tierzero.engine.train import token_loss
from tierzero.engine.train.data import (
    IGNORE,
    ByteTokenizer,
    DataError,
    Example,
    ExampleBatches,
    HFTokenizer,
    Row,
    encode,
    eval_batches,
    load_tokenizer,
    read_rows,
)
from tierzero.engine.train.data.batches import split_rows


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    tiny_tokenizer(d)
    (d / "config.json").write_text("{}")  # a model directory, for the model-dir lookup
    return d


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> HFTokenizer:
    t = load_tokenizer(None, str(tok_dir))
    assert isinstance(t, HFTokenizer)
    return t


def targets(ex: Example, tok: Any) -> str:
    return str(tok.decode([i for i, t in zip(ex.ids, ex.target, strict=True) if t]))


def replies(row: dict[str, Any], end: str) -> str:
    return "".join(m["content"] + end for m in row["messages"] if m["role"] == "assistant")


# -- tokenizers ---------------------------------------------------------------------

def test_tokenizer_resolution(tok_dir: Path, tmp_path: Path) -> None:
    own = load_tokenizer(None, str(tok_dir))
    assert isinstance(own, HFTokenizer) and own.name == str(tok_dir)
    assert own.vocab_size == 320 and own.has_chat_template
    assert own.end == [SPECIALS.index("</s>")] and own.pad_id == SPECIALS.index("<pad>")
    # a config.json path finds the tokenizer beside it; a bare tokenizer.json loads too
    assert load_tokenizer(None, str(tok_dir / "config.json")).vocab_size == 320
    bare = load_tokenizer(str(tok_dir / "tokenizer.json"), "builtin:tiny")
    assert bare.encode("The sky is blue.", specials=False) == own.encode(
        "The sky is blue.", specials=False)
    for spec, model in ((None, "builtin:tiny"), ("bytes", str(tok_dir))):
        assert isinstance(load_tokenizer(spec, model), ByteTokenizer)
    bare_model = tmp_path / "no_tok"
    bare_model.mkdir()
    assert isinstance(load_tokenizer(None, str(bare_model)), ByteTokenizer)
    with pytest.raises(DataError, match=r"train.tokenizer: '/no/such' does not exist"):
        load_tokenizer("/no/such", "builtin:tiny")
    with pytest.raises(DataError, match=r"holds none of tokenizer.json, tokenizer_config.json"):
        load_tokenizer(str(bare_model), "builtin:tiny")


# -- encoding and prompt masking ----------------------------------------------------

def test_chat_template_masks_everything_but_the_replies(tok: HFTokenizer) -> None:
    for i, data in enumerate(chat_rows(12)):
        ex = encode(Row(f"d.jsonl:{i + 1}", data), tok)
        # the tokens the loss sees are exactly the assistant replies, each closed by EOS
        assert targets(ex, tok) == replies(data, "</s>")
        # and the whole example is the template's rendering, tokenised
        assert tok.decode(ex.ids) == tok.render_chat(data["messages"], generation_prompt=False)
        assert not ex.target[0]  # BOS and the first user turn are prompt


def test_chat_without_template_and_prompt_completion(tmp_path: Path, tok: HFTokenizer) -> None:
    data = chat_rows(3)[2]  # two assistant turns
    byte = ByteTokenizer()
    ex = encode(Row("d.jsonl:1", data), byte)
    assert targets(ex, byte) == replies(data, "\n") + "\n\n"
    assert byte.decode(ex.ids).startswith("user: What color is")
    plain = tmp_path / "plain"
    tiny_tokenizer(plain, chat_template=False)
    no_template = load_tokenizer(str(plain), "builtin:tiny")
    assert targets(encode(Row("d.jsonl:1", data), no_template), no_template) == replies(
        data, "\n") + "</s>"
    pc = encode(Row("d.jsonl:1", {"prompt": "What color is the sky?",
                                  "completion": " The sky is blue."}), tok)
    assert targets(pc, tok) == " The sky is blue.</s>"
    head = tok.encode("What color is the sky?", specials=True)
    assert pc.ids[:len(head)] == head and not any(pc.target[:len(head)])
    # the text is tokenised whole, as the model sees it at inference: a boundary inside a
    # word keeps the word's token (a target only if it starts in the completion)
    cut = encode(Row("d.jsonl:1", {"prompt": "The sk", "completion": "y is blue."}), tok)
    assert cut.ids == tok.encode("The sky is blue.", specials=True) + tok.end
    assert targets(cut, tok) == " is blue.</s>"
    text = encode(Row("d.txt:1", {"text": "The snow is white."}), tok)
    assert all(text.target) and text.ids[-1] == tok.end[0]


@pytest.mark.parametrize(("data", "needle"), [
    ({"body": "x"}, "d.jsonl:4: needs a string field 'text', string fields 'prompt' and "
                    "'completion', or a list 'messages'"),
    ({"text": 3}, "d.jsonl:4: field 'text' is int 3; allowed: a string"),
    ({"prompt": "p"}, "d.jsonl:4: field 'completion' is NoneType"),
    ({"messages": []}, "d.jsonl:4: 'messages' is list; allowed: a non-empty list"),
    ({"messages": [{"role": "user"}]}, "d.jsonl:4: messages[0] is {'role': 'user'}"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "d.jsonl:4: no message with role "
                                                        "'assistant'; nothing to train on"),
])
def test_bad_rows_name_file_and_line(data: dict[str, Any], needle: str,
                                     tok: HFTokenizer) -> None:
    with pytest.raises(DataError) as err:
        encode(Row("d.jsonl:4", data), tok)
    assert needle in str(err.value)


def test_template_that_is_not_prefix_stable_is_refused(tok_dir: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    t = transformers.AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    # the count of messages is written first: earlier renderings are not prefixes
    t.chat_template = ("{{ messages|length }}{% for m in messages %}{{ m['content'] }}"
                       "{% endfor %}")
    t.save_pretrained(tmp_path / "t")
    bad = load_tokenizer(str(tmp_path / "t"), "builtin:tiny")
    with pytest.raises(DataError, match=r"d.jsonl:2: the chat template .* not a prefix"):
        encode(Row("d.jsonl:2", chat_rows(1)[0]), bad)


# -- files --------------------------------------------------------------------------

def test_every_file_form_gives_the_same_rows(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(5)]
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "disk"))
    (arrow,) = (tmp_path / "disk").glob("*.arrow")
    splits = datasets.DatasetDict({"train": ds, "validation": ds.select([1, 3])})
    splits.save_to_disk(str(tmp_path / "dict"))
    for path in (jsonl, tmp_path / "d.parquet", arrow, tmp_path / "disk", tmp_path / "dict"):
        got = read_rows(str(path), "train.dataset")
        assert [dict(r.data) for r in got] == rows, path
    assert read_rows(str(jsonl), "k")[2].where == f"{jsonl}:3"
    assert read_rows(str(tmp_path / "d.parquet"), "k")[2].where == f"{tmp_path}/d.parquet row 3"
    held = read_rows(str(tmp_path / "dict"), "train.eval_dataset", "eval")
    assert [r.data["prompt"] for r in held] == ["q1", "q3"]
    assert held[0].where == f"{tmp_path}/dict [validation] row 1"
    txt = tmp_path / "d.txt"
    txt.write_text("first para\nstill first\n\n\nsecond\n")
    assert [(r.where, r.data["text"]) for r in read_rows(str(txt), "k")] == [
        (f"{txt}:1", "first para\nstill first"), (f"{txt}:5", "second")]


def test_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"text": "ok"}\n\nnot json\n')
    with pytest.raises(DataError, match=r"d.jsonl:3: not valid JSON"):
        read_rows(str(bad), "train.dataset")
    bad.write_text('{"text": "ok"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: a JSON list; allowed: an object per line"):
        read_rows(str(bad), "train.dataset")
    csv = tmp_path / "d.csv"
    csv.write_text("a,b")
    with pytest.raises(DataError, match=r"train.dataset: '.*d.csv' has an unknown extension"):
        read_rows(str(csv), "train.dataset")
    with pytest.raises(DataError, match=r"train.eval_dataset: '/no/such.jsonl' is not a file"):
        read_rows("/no/such.jsonl", "train.eval_dataset")
    with pytest.raises(DataError, match=r"is a directory but not one datasets.save_to_disk"):
        read_rows(str(tmp_path), "train.dataset")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "x"}]}]).to_parquet(
        str(tmp_path / "c.parquet"))
    (row,) = read_rows(str(tmp_path / "c.parquet"), "train.dataset")
    with pytest.raises(DataError, match=r"c.parquet row 1: no message with role 'assistant'"):
        encode(row, ByteTokenizer())


# -- batches ------------------------------------------------------------------------

def examples(n: int) -> list[Example]:
    # example i: tokens 10i .. 10i+k-1 (k = 3 + i % 4), the first token a prompt
    out = []
    for i in range(n):
        ids = [10 * i + j for j in range(3 + i % 4)]
        out.append(Example(ids, [False] + [True] * (len(ids) - 1)))
    return out


def test_labels_are_next_tokens_with_prompt_and_padding_ignored() -> None:
    exs = examples(6)
    (x, y), = eval_batches(exs, seq_len=5, batch_size=6, packing="pad", pad_id=0, rank=0,
                           world=1, limit=0, source="s")
    assert x.shape == y.shape == (6, 5)
    for r, e in enumerate(exs):
        n = min(len(e.ids), 6)
        assert x[r, :n - 1].tolist() == e.ids[:n - 1]
        # the label at t is token t + 1 when that token is a target; pads carry no loss
        want = [e.ids[t + 1] if t + 1 < n and e.target[t + 1] else IGNORE for t in range(5)]
        assert y[r].tolist() == want
    ids = torch.tensor([[1, 2, 3, 4]])
    x2, y2 = split_rows(ids, torch.tensor([[True, False, True, True]]))
    assert x2.tolist() == [[1, 2, 3]] and y2.tolist() == [[IGNORE, 3, 4]]


def test_pack_epochs_shuffle_ranks_and_skip() -> None:
    exs = examples(40)
    stream = [t for e in exs for t in e.ids]

    def make(rank: int, shuffle: bool = True) -> ExampleBatches:
        return ExampleBatches(exs, seq_len=8, batch_size=2, packing="pack", pad_id=0,
                              shuffle=shuffle, seed=5, rank=rank, world=2, source="s")

    ranks = [make(0), make(1)]
    per_epoch = ranks[0].per_epoch
    assert per_epoch == (len(stream) - 1) // 8 // 4
    epochs: list[list[list[int]]] = []
    for _ in range(2):
        rows = [[*x[i].tolist(), 0] for b in ranks for _ in range(per_epoch)
                for x, _ in [b.next()] for i in range(2)]
        epochs.append(rows)
        assert len(rows) == per_epoch * 4
    # each epoch's rows are disjoint windows of one shuffled concatenation of all examples
    for rows in epochs:
        starts = {tuple(r[:8]) for r in rows}
        assert len(starts) == len(rows)
    assert epochs[0] != epochs[1]  # reshuffled
    assert ranks[0].epoch == 2
    fixed = make(0, shuffle=False)
    assert fixed.next()[0][0].tolist() == stream[:8]  # no shuffle: the data in file order
    # skip(n) lands where n next() calls would
    a, b = make(1), make(1)
    for _ in range(per_epoch + 1):
        a.next()
    b.skip(per_epoch + 1)
    assert all(torch.equal(p, q) for p, q in zip(a.next(), b.next(), strict=True))


def test_too_little_data_is_refused() -> None:
    with pytest.raises(DataError, match=r"s gives 6 rows of train.seq_len 4 tokens \(pad\); one "
                                        r"batch on every rank needs 8"):
        ExampleBatches(examples(6), seq_len=4, batch_size=4, packing="pad", pad_id=0,
                       shuffle=True, seed=0, rank=0, world=2, source="s")


def test_token_loss_ignores_masked_labels() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, requires_grad=True)
    labels = torch.tensor([[1, IGNORE, 2], [IGNORE, IGNORE, 6]])
    keep = labels != IGNORE
    ref = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    assert torch.allclose(token_loss(logits, labels), ref, rtol=1e-6)
    none = token_loss(logits, torch.full((2, 3), IGNORE))
    none.backward()
    assert none.item() == 0.0 and logits.grad is not None and not logits.grad.any()


def test_jsonl_rows_json(tmp_path: Path) -> None:
    # keys beyond the format's are ignored; a row's kind comes from its own keys
    path = write_jsonl(tmp_path / "m.jsonl", [{"text": "a b c", "id": 1},
                                              {"prompt": "q", "completion": "a", "x": [1]}])
    got = [encode(r, ByteTokenizer()) for r in read_rows(str(path), "train.dataset")]
    assert all(got[0].target) and not all(got[1].target)
    assert json.loads(path.read_text().splitlines()[0])["id"] == 1
