"""Helpers shared by the tierzero train tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tierzero import engine
from tierzero.engine.cli import main
from tierzero.engine.models import SIZES, TinyLM
from tierzero.engine.plan import Machine, Traffic


def write_config(tmp_path: Path, **train: Any) -> Path:
    """fp32, no offload, the tiny model: small enough for a unit test, exact enough to compare."""
    cfg = {
        "seed": 3,
        "precision": "fp32",
        "optimizer": {"type": "adamw", "lr": 3.0e-3, "weight_decay": 0.01},
        "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
        "logging": {"steps_per_print": 1},
        "train": {"model": "builtin:tiny", "steps": 6, "seq_len": 32,
                  "out_dir": str(tmp_path / "runs"), **train},
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def read_metrics(tmp_path: Path) -> list[dict[str, Any]]:
    (path,) = (tmp_path / "runs").glob("*/metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- tierzero plan ------------------------------------------------------------------

GB = 10**9
BIG = Machine(device_bytes=80 * GB, host_bytes=2000 * GB, nvme_bytes=8000 * GB, cuda=True,
              nvme_read_gbps=6.0, nvme_write_gbps=5.0, copy_gbps=25.0, adam_params_per_s=2e9)


def llama_params(shape: tuple[int, int, int, int, int, int]) -> int:
    """Hand count: attention q, o (h x h) and k, v (h x kv_dim), SwiGLU MLP (3 x h x inter),
    two RMSNorm weights per layer; untied embedding and head; final norm."""
    hidden, inter, layers, heads, kv, vocab = shape
    kv_dim = hidden // heads * kv
    layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * inter + 2 * hidden
    return layers * layer + 2 * vocab * hidden + hidden


LLAMAS = {  # name: (hidden, intermediate, layers, heads, kv heads, vocab)
    "7b": (4096, 11008, 32, 32, 32, 32000),
    "40b": (8192, 22016, 56, 64, 8, 32000),
    "70b": (8192, 28672, 80, 64, 8, 32000),
}


def llama_config(tmp_path: Path, name: str) -> str:
    hidden, inter, layers, heads, kv, vocab = LLAMAS[name]
    path = tmp_path / f"llama-{name}.json"
    path.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 4096,
        "tie_word_embeddings": False}))
    return str(path)


def plan_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


MACHINE = ["--device-mem", "80GB", "--host-mem", "512GB", "--nvme-size", "4TB",
           "--nvme-read-gbps", "6", "--nvme-write-gbps", "5", "--copy-gbps", "25",
           "--adam-params-per-s", "2e9"]


def real_steps(config: engine.Config, steps: int) -> list[Traffic]:
    """Per-step bytes of a real CPU run, from the SwapStore's and TierManager's counters
    (gradient_accumulation_steps micro-batches per step, through train_batch)."""
    torch.manual_seed(0)
    eng, *_ = engine.initialize(model=TinyLM(SIZES["tiny"]), config=config)

    def counters() -> tuple[int, int, int, int]:
        swap, mgr = eng.store.swap, eng.store.manager  # type: ignore[attr-defined]
        stats, moved = swap.stats(), mgr.memory_report().moved
        return (stats.read.bytes, stats.write.bytes, moved.get("host_to_device", 0),
                moved.get("device_to_host", 0))

    def loss(x: torch.Tensor) -> torch.Tensor:
        return eng(input_ids=x).logits.float().mean()  # type: ignore[no-any-return]

    accum = config.batch.gradient_accumulation_steps or 1
    out = []
    try:
        last = counters()  # after initialize: the initial placement is not a step
        for _ in range(steps):  # one optimizer step each, in the config's batch.schedule
            eng.train_batch([torch.randint(0, 256, (2, 32)) for _ in range(accum)], loss)
            eng.store.manager.synchronize()  # type: ignore[attr-defined]
            now = counters()
            d = [a - b for a, b in zip(now, last, strict=True)]
            out.append(Traffic(nvme_read=d[0], nvme_written=d[1], host_to_device=d[2],
                               device_to_host=d[3]))
            last = now
    finally:
        eng.close()
    return out
