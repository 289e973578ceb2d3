"""tierzero plan counts both batch schedules' bytes ([Note: layer-major schedule]): the
dry run runs `train_batch` as `tierzero train` does, so with gradient accumulation its
counted bytes equal a real run's counters, layer-major and micro-step alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_helpers import plan_cli, real_steps

from tierzero import engine
from tierzero.engine.models import SIZES, TinyLM
from tierzero.engine.plan import dry_run

ACCUM = 4


def _config(swap_dir: Path, schedule: str) -> engine.Config:
    return engine.load_config({
        "zero": {"stage": 3}, "precision": "bf16", "gradient_clipping": 0.0,
        "batch": {"gradient_accumulation_steps": ACCUM, "schedule": schedule},
        "offload": {"device": "nvme", "path": str(swap_dir), "buffer_count": 64}})


@pytest.mark.parametrize("schedule", ["layer_major", "micro_step"])
def test_dry_run_counts_each_schedule_as_a_real_run(tmp_path: Path, schedule: str) -> None:
    """Writes and copies equal step by step; reads equal in total up to the CPU Adam's
    read-ahead (see test_cli_plan_engine.assert_matches)."""
    config = _config(tmp_path, schedule)
    with torch.device("meta"):
        module = TinyLM(SIZES["tiny"])
    dry = dry_run(module, config, steps=3)
    assert dry.schedule == schedule
    real = real_steps(config, 3)
    assert dry.schedule == config.batch.schedule
    plan = [dry.step(i) for i in range(3)]
    assert [(r.nvme_written, r.host_to_device, r.device_to_host) for r in real] == [
        (d.nvme_written, d.host_to_device, d.device_to_host) for d in plan]
    window = plan[-1].nvme_written
    got = want = 0
    for r, d in zip(real, plan, strict=True):
        got, want = got + r.nvme_read, want + d.nvme_read
        assert abs(got - want) <= window, (got, want, window)


def test_layer_major_moves_one_pass_of_parameters(tmp_path: Path) -> None:
    """Per optimizer step of ACCUM micro-batches on the 25.5M built-in model with a small
    staging pool (parameters do not stay cached), planned for a CUDA machine (params are
    copied to the device to be gathered): layer-major copies each unit's parameters in
    once per pass and reduces each gradient once, micro-step ACCUM times."""
    def config(schedule: str) -> engine.Config:
        return engine.load_config({
            "zero": {"stage": 3}, "precision": "bf16",
            "batch": {"gradient_accumulation_steps": ACCUM, "schedule": schedule},
            "offload": {"device": "nvme", "path": str(tmp_path), "buffer_count": 8}})

    with torch.device("meta"):
        runs = {s: dry_run(TinyLM(SIZES["small"]), config(s), steps=2, device_is_host=False)
                for s in ("layer_major", "micro_step")}
    lm, ms = (runs[s].step() for s in ("layer_major", "micro_step"))
    assert ms.grads_to_host == ACCUM * lm.grads_to_host > 0
    assert ms.host_to_device >= 3 * lm.host_to_device > 0
    assert 2 * (lm.nvme_read + lm.nvme_written) < ms.nvme_read + ms.nvme_written


def test_plan_reports_both_schedules(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    rc, out, err = plan_cli(["--model", "builtin:tiny", "--device-mem", "1GB", "--host-mem",
                             "8GB", "--nvme-size", "100GB", "--nvme-path", str(tmp_path),
                             "--grad-accum", str(ACCUM)], capsys)
    assert rc == 0, err
    table = out[out.index("schedule"):]
    assert "layer_major" in table and "micro_step" in table


def test_dry_run_of_a_hugging_face_llama_runs_layer_major(tmp_path: Path) -> None:
    """On meta tensors a Hugging Face Llama's training forward (no KV cache) must not test
    position ids for packed sequences (a data-dependent branch): the dry run passes an
    all-ones mask, and the pass stays layer-major."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=128, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    run = dry_run(model, _config(tmp_path, "layer_major"), steps=2)
    assert run.schedule == "layer_major"
    assert run.step().nvme_written > 0
