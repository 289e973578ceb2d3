"""Child process of test_plan_host: train a small Llama from config.json as `tierzero train`
builds it, and print its peak RSS growth over its imports as JSON on stdout.

Run in a fresh interpreter so the RSS high-water mark belongs to this run alone:
    python tests/plan_host_child.py MODEL_DIR CONFIG SEQ_LEN STEPS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers  # noqa: F401  (imported before the base, as the plan's figure assumes)

from tierzero import engine
from tierzero.engine.config import load_config
from tierzero.engine.train.model_source import build_model


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def main() -> None:
    model_dir, config_path, seq_len, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(
        sys.argv[4])
    torch.set_num_threads(1)
    config = load_config(config_path)
    with torch.device("meta"):  # imports the model's code (transformers loads it lazily)
        build_model(model_dir, seq_len)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts here
    base = status_bytes("VmRSS")
    torch.manual_seed(0)
    with engine.Init(config=config):  # as tierzero train builds a stage-3 model
        model = build_model(model_dir, seq_len)
    eng, _, _, _ = engine.initialize(model=model, config=config)
    del model  # the engine holds the module; `tierzero train` keeps no other reference
    g = torch.Generator().manual_seed(1)
    vocab = eng.module.config.vocab_size
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)  # (B, T)
    losses = []
    for _ in range(steps):
        logits = eng(input_ids=ids).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), torch.roll(ids, -1, 1).flatten())
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.item()))
    peak = status_bytes("VmHWM") - base
    eng.close()
    print(json.dumps({"peak_growth": peak, "losses": losses}))


if __name__ == "__main__":
    main()
