"""`tierzero train` fine-tunes a pretrained Hugging Face directory with its own tokenizer from
chat data, with an evaluation split; DeepSpeed "auto" run lengths; data settings refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_helpers import read_metrics, write_config
from data_helpers import chat_rows, pretrained_dir, write_jsonl

from tierzero import engine
from tierzero.engine.cli import main
from tierzero.engine.config.train import TrainConfig
from tierzero.engine.train import IGNORE, TrainOptions, load_data, run


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return pretrained_dir(tmp_path_factory.mktemp("llama"))


def finetune_config(tmp_path: Path, model: Path, data: Path, **train: Any) -> Path:
    (tmp_path / "nvme").mkdir(exist_ok=True)
    cfg = {
        "seed": 3, "precision": "fp32",
        "optimizer": {"type": "adamw", "lr": 1.0e-2, "weight_decay": 0.0},
        "batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
        "offload": {"device": "nvme", "path": str(tmp_path / "nvme")},
        "logging": {"steps_per_print": 10},
        "train": {"model": str(model), "dataset": str(data), "seq_len": 32, "epochs": 3,
                  "eval_fraction": 0.25, "eval_interval": 10, "out_dir": str(tmp_path / "runs"),
                  **train},
    }
    path = tmp_path / "finetune.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_finetune_chat_with_own_tokenizer_on_nvme(tmp_path: Path,
                                                  llama_dir: tuple[Path, Any]) -> None:
    model, _tok = llama_dir
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(80))
    config = finetune_config(tmp_path, model, data)
    assert main(["train", str(config), "--no-progress"]) == 0
    rows = read_metrics(tmp_path)
    run_row, end = rows[0], rows[-1]
    assert run_row["tokenizer"] == str(model) and run_row["data_mode"] == "pack"
    assert run_row["eval_dataset"] == f"20 of the 80 rows of {data}"
    steps = [r for r in rows if r["event"] == "step"]
    evals = [r for r in rows if r["event"] == "eval"]
    # 60 training rows of ~25 tokens packed into 32-token rows, 4 per batch, 3 epochs
    assert len(steps) == end["steps"] > 20
    assert [e["step"] for e in evals] == [0, *range(10, len(steps), 10), len(steps)]
    assert all(e["eval_tokens"] == evals[0]["eval_tokens"] > 0 for e in evals)
    # the offloaded shards really lived on NVMe
    assert max(r["tier_bytes"]["nvme"] for r in steps) > 0
    # the model learns the held-out answers: the loss on replies it never trained on falls
    assert end["last_eval_loss"] < 0.5 * end["first_eval_loss"]


def test_prompt_tokens_carry_no_loss_in_the_batches(tmp_path: Path,
                                                    llama_dir: tuple[Path, Any]) -> None:
    """The batches the job trains on (the same load_data call, in file order): every label
    that is not IGNORE is a reply token, and together they are the replies, in order."""
    model, tok = llama_dir
    chats = chat_rows(30)
    data = write_jsonl(tmp_path / "chat.jsonl", chats)
    config = engine.load_config(str(finetune_config(tmp_path, model, data, shuffle=False,
                                                    eval_fraction=0.0)))
    got = load_data(config.train, micro=4, accum=1, seed=3, rank=0, world=1)
    assert got.per_epoch is not None
    labels: list[int] = []
    for _ in range(got.per_epoch):
        _x, y = got.batches.next()
        # packed rows overlap by one token, so each token after the first is one label
        for row in y.tolist():
            labels += [t for t in row if t != IGNORE]
    replies = "".join(m["content"] + "</s>" for c in chats for m in c["messages"]
                      if m["role"] == "assistant")
    text = tok.decode(labels)
    assert replies.startswith(text) and len(text) > 0.8 * len(replies)  # (the tail is cut)
    prompt_words = {"What", "color", "And", "Answer", "<|user|>", "<|assistant|>"}
    assert not any(w in text for w in prompt_words)


def test_deepspeed_auto_total_steps_takes_the_run_length(tmp_path: Path) -> None:
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "scheduler": {"type": "WarmupDecayLR", "params": {
              "warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 0,
              "warmup_type": "linear", "total_num_steps": "auto"}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": 0}}
    config = engine.load_config(ds)
    assert config.run_length_auto == (("scheduler.params.total_num_steps", 1.0),)
    config = replace(config, train=TrainConfig(model="builtin:tiny", steps=4, seq_len=16,
                                               out_dir=str(tmp_path / "runs")))
    result = run(config, TrainOptions(progress=False))
    # warmup_num_steps 0 warms up over 2 steps, as DeepSpeed's schedulers clamp it; then a
    # linear decay from 1e-3 to 0 at total_num_steps = train.steps = 4
    assert [r.lr for r in result.records] == pytest.approx([5e-4, 1e-3, 5e-4, 0.0])


def test_epochs_set_the_steps_and_steps_flag_wins(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": f"Q{i}: what is {i} plus one?", "completion": f" {i + 1}."}
        for i in range(24)])
    config = write_config(tmp_path, dataset=str(data), epochs=2, packing="pad",
                          eval_dataset=str(data), eval_batches=2)
    assert main(["train", str(config), "--no-progress"]) == 0
    rows = read_metrics(tmp_path)
    # 24 rows, one per padded row, micro batch 2: 12 batches an epoch, 2 epochs
    assert rows[-1]["steps"] == 24
    assert rows[0]["data_mode"] == "pad"
    assert [r["step"] for r in rows if r["event"] == "eval"] == [0, 24]
    for path in (tmp_path / "runs").glob("*"):
        for f in path.iterdir():
            f.unlink()
        path.rmdir()
    assert main(["train", str(config), "--steps", "3", "--no-progress"]) == 0
    assert read_metrics(tmp_path)[-1]["steps"] == 3


def test_windows_mode_holds_out_the_streams_tail(tmp_path: Path) -> None:
    config = write_config(tmp_path, steps=2, eval_fraction=0.1)
    assert main(["train", str(config), "--no-progress"]) == 0
    rows = read_metrics(tmp_path)
    assert rows[0]["data_mode"] == "windows" and rows[0]["tokenizer"] == "bytes"
    assert rows[0]["eval_dataset"].startswith("the last 0.1 of the shipped corpus")
    evals = [r for r in rows if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2] and evals[0]["eval_tokens"] > 0


@pytest.mark.parametrize(("train", "needle"), [
    ({"eval_fraction": 0.1, "eval_dataset": "DATA"}, "train.eval_dataset and "
                                                     "train.eval_fraction (0.1) are both set"),
    ({"packing": "pad"}, "train.packing: pad needs train.dataset"),
    ({"dataset": "/no/such.parquet"}, "train.dataset: '/no/such.parquet' is not a file"),
    ({"tokenizer": "TOK"}, "train.model builtin:tiny has the byte vocabulary (256); tokenizer"),
    ({"eval_fraction": 0.9}, "train.eval_fraction: 0.9 is out of range"),
    ({"tokenizer": "/no/tok"}, "train.tokenizer: '/no/tok' does not exist"),
])
def test_bad_data_settings_are_refused_before_work(
        train: dict[str, Any], needle: str, tmp_path: Path, llama_dir: tuple[Path, Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    fixed = {k: str(data) if v == "DATA" else str(llama_dir[0]) if v == "TOK" else v
             for k, v in train.items()}
    assert main(["train", str(write_config(tmp_path, **fixed)), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tierzero train: error: ") and needle in err
    assert not (tmp_path / "runs").exists()


def test_resume_continues_the_epochs_data_position(tmp_path: Path) -> None:
    """A packed, shuffled run stopped mid-epoch and resumed ends with the uninterrupted
    run's losses exactly (fp32, no offload: the same kernels on the same batches)."""
    data = write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": f"Q{i}: what comes after {i}?", "completion": f" {i + 1}, then {i + 2}."}
        for i in range(6)])
    ck = tmp_path / "ck"

    def train(name: str, *flags: str, **train: Any) -> dict[int, float]:
        out = tmp_path / name
        out.mkdir()
        config = write_config(out, dataset=str(data), epochs=2, **train)
        assert main(["train", str(config), "--no-progress", *flags]) == 0
        return {r["step"]: r["loss"] for r in read_metrics(out) if r["event"] == "step"}

    full = train("full")
    assert len(full) == 6  # two epochs of 3 batches: the checkpoint at 5 is in the second
    first = train("first", "--steps", "5", checkpoint_interval=5, checkpoint_dir=str(ck))
    rest = train("rest", checkpoint_dir=str(ck), resume=True)
    assert first == {s: full[s] for s in range(1, 6)}
    assert rest == {s: full[s] for s in range(6, len(full) + 1)}
