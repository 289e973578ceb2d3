"""`tierzero plan` placement for Llama shapes far above this machine (issue 15): with the
gradient home and the CPU Adam's pieces ([Note: gradient home], [Note: optimizer state in
chunks]) a user who asks for NVMe is not told to buy RAM. Placement only (the tier manager's
planner on meta tensors, no dry run of the steps, which takes minutes at this size).

33.7B: hidden 8192, 48 layers, MLP 22016, 8 KV heads, vocab 32000 (a 692M-parameter
unit, 14 B/param of state at 9.7 GB: its whole-shard CPU Adam ring alone was 38.6 GB).
70B: hidden 8192, 80 layers, MLP 28672, 8 KV heads, vocab 32000 (Llama 2 70B's shape).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierzero.engine.plan.planner import Machine, plan_choice
from tierzero.engine.plan.shapes import model_shape

GB = 10**9


def llama_config(tmp_path: Path, *, layers: int, mlp: int) -> Path:
    path = tmp_path / f"llama-{layers}" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": mlp, "num_hidden_layers": layers, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(("layers", "mlp", "params", "host"), [
    (48, 22016, 33.7e9, 64 * GB),
    (80, 28672, 69.0e9, 128 * GB),
])
def test_nvme_fits_a_workstation(tmp_path: Path, layers: int, mlp: int, params: float,
                                 host: int) -> None:
    shape = model_shape(str(llama_config(tmp_path, layers=layers, mlp=mlp)))
    assert abs(sum(n for _, n in shape.units) - params) < 0.05e9
    machine = Machine(device_bytes=80 * GB, host_bytes=host, nvme_bytes=4000 * GB, cuda=True)
    plan = plan_choice(shape, "nvme", machine, world_size=1, precision="bf16",
                       nvme_path=str(tmp_path))
    assert plan.fits, plan.error
    # the host holds gradients only as far as the budget has room, the rest go to NVMe
    # with the optimizer state; the pool and the CPU Adam's buffers are a fixed part
    by = plan.by_tier
    assert by["host"]["master"] == by["host"]["exp_avg"] == 0
    assert by["host"]["grad"] + plan.overhead["host"] <= host
    assert plan.overhead["host"] < 0.35 * host
    assert by["nvme"]["grad"] > 0
