"""Write a checkpoint in the format from before the param16 -> param rename.

Ran once on commit add87bf (the last tree whose checkpoints name a frozen group's
compute-precision shard `param16`); its output is tests/data/ckpt_param16/.
tests/engine/checkpoint/test_ckpt_legacy.py loads it with today's code.
"""
import sys
from pathlib import Path

sys.path.insert(0, "tests")
from engine_helpers import make_batches, make_config, make_model, train_steps
from safetensors.torch import save_file

from tierzero import engine

out = Path(sys.argv[1])
model = make_model(n_blocks=1)
model.emb.weight.requires_grad_(False)  # a frozen group: saved as its param16 shard only
eng, _, _, _ = engine.initialize(device="cpu", model=model, config=make_config("bf16"))
train_steps(eng, make_batches(2))
eng.save_checkpoint(str(out / "ckpt"), tag="step2")
with engine.GatheredParameters(list(model.parameters())):
    save_file({k: v.detach().float().contiguous().clone() for k, v in model.named_parameters()},
              str(out / "expected_params.safetensors"))
eng.close()
