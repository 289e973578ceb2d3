"""`tierzero plan` recommends only what fits the machine it was given ([Note: plan within
the host] in engine/plan/planner.py): the predicted host and device peaks, not only the
tiers' budgets, stay within --host-mem / --device-mem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_helpers import plan_cli

from tierzero.engine.plan.host import HostPeak
from tierzero.engine.plan.planner import ChoicePlan, Machine, over_budget, recommend

GB = 10**9


def _plan(choice: str, *, host: int, device: int, step_s: float) -> ChoicePlan:
    p = ChoicePlan(choice, None, step_s=step_s)  # type: ignore[arg-type]
    p.host = HostPeak(build=1, initialize=host, train=host // 2,
                      parts={"init_staging": 0, "saved_activations": 0})
    p.device_peak = device
    return p


def test_recommend_skips_a_choice_that_peaks_above_the_host_or_device() -> None:
    machine = Machine(device_bytes=24 * GB, host_bytes=128 * GB, nvme_bytes=4000 * GB,
                      cuda=True)
    fast_over_host = _plan("auto", host=147 * GB, device=20 * GB, step_s=1.0)
    fast_over_device = _plan("cpu", host=100 * GB, device=25 * GB, step_s=0.5)
    slow_fits = _plan("nvme", host=127 * GB, device=9 * GB, step_s=2.0)
    plans = [fast_over_host, fast_over_device, slow_fits]
    assert over_budget(fast_over_host, machine) is not None
    assert over_budget(fast_over_device, machine) is not None
    assert over_budget(slow_fits, machine) is None
    assert recommend(plans, machine) is slow_fits
    assert recommend(plans) is fast_over_device  # (tiers only: what it did before)
    assert recommend([fast_over_host], machine) is None


def llama2_70b(tmp_path: Path) -> str:
    """config.json with Llama-2-70B's published values (weights in float16)."""
    path = tmp_path / "llama-2-70b" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 8192,
        "initializer_range": 0.02, "intermediate_size": 28672,
        "max_position_embeddings": 4096, "num_attention_heads": 64,
        "num_hidden_layers": 80, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
        "torch_dtype": "float16", "use_cache": True, "vocab_size": 32000}))
    return str(path)


@pytest.mark.slow
def test_70b_on_24gb_device_128gb_host_recommends_a_config_below_the_host(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Llama-2-70B's shape on a 24 GB GPU with 128 GB of RAM and 4 TB of NVMe: before, the
    plan recommended offload auto, whose own predicted host peak was ~147-152 GB (the model
    held whole in host memory while it is built, with its parameters homed by auto), and
    predicted ~132 GB for nvme (its gradients filled the whole host budget, the CPU Adam
    ring and placement came on top)."""
    pytest.importorskip("transformers")
    out_file = tmp_path / "rec.yaml"
    code, out, _ = plan_cli(["--model", llama2_70b(tmp_path), "--device-mem", "24GB",
                             "--host-mem", "128GB", "--nvme-size", "4TB",
                             "--nvme-read-gbps", "6", "--nvme-write-gbps", "5",
                             "--copy-gbps", "25", "--adam-params-per-s", "2e9",
                             "--nvme-path", str(tmp_path), "--write", str(out_file)], capsys)
    assert code == 0, out
    # the whole pipeline at 70B on this CPU-only machine: placement and the engine's dry run
    # of every choice (formerly a test of its own in test_cli_plan_engine, on an 80 GB GPU
    # and 512 GB of RAM; one 70B plan in the suite instead of two)
    assert "68.98B parameters, 81 units" in out
    assert "written/1,000 steps" in out and "n/a" not in out
    rec = yaml.safe_load(out_file.read_text())
    choice = rec["offload"]["device"]
    assert choice == "nvme", out
    # the host-peak table: the recommended choice's row, its predicted peak in GB
    row = next(ln for ln in out.splitlines() if ln.startswith(f"{choice} ")
               and ln.split()[1] == "host+nvme")
    peak_gb = float(row.split()[2])
    assert row.split()[3] == "GB" and peak_gb < 128.0, row
    # the budget the plan placed with comes along, so the run places the same
    budget = rec["offload"]["budgets"]["host_bytes"]
    assert budget < 128 * GB
    assert f"host budget lowered to {budget / 1e9:.1f} GB" in out
    # auto is not recommended, and the report says why and what would bring it in
    assert "auto: not recommended: the predicted host peak" in out
    assert "a near miss: building the model holds" in out
    assert "offload.params.device nvme" in out


@pytest.mark.slow
def test_a_choice_over_the_device_is_planned_with_a_lower_device_budget(
        tmp_path: Path) -> None:
    """README's 40B example: auto fills a 70 GB device tier with parameter shards and has
    no room left for the gathered units, activations and a unit's gradients beside it;
    planned again with a lower device budget it fits, and every choice recommended
    peaks within the machine."""
    from tierzero.engine.plan.planner import plan_all
    from tierzero.engine.plan.shapes import model_shape

    machine = Machine(device_bytes=70 * GB, host_bytes=512 * GB, nvme_bytes=4000 * GB,
                      cuda=True, nvme_read_gbps=6.0, nvme_write_gbps=5.0, copy_gbps=25.0,
                      adam_params_per_s=2e9)
    plans = {p.choice: p for p in plan_all(model_shape("40e9", layers=32), machine,
                                           world_size=1, precision="bf16",
                                           nvme_path=str(tmp_path))}
    auto = plans["auto"]
    assert auto.fits and auto.device_budget is not None and auto.host is not None
    assert auto.device_budget < machine.device_bytes
    assert auto.device_peak is not None and auto.device_peak <= machine.device_bytes
    assert auto.host.peak <= machine.host_bytes
    best = recommend(list(plans.values()), machine)
    assert best is not None and over_budget(best, machine) is None
