"""`tierzero plan`'s host peak ([Note: plan host peak] in engine/plan/host.py) against the
peak RSS growth of the same run, measured in a child process; and the parts it adds up.

The run: a 12.5M-parameter Llama from config.json (hidden 256, 4 layers, vocab 16384
untied, so the root's embeddings and head are the largest unit, as in real vocabularies),
bf16, offload nvme, clipping 1.0, seq 64, built as `tierzero train` builds it. The 2.07B
comparison is benchmarks/scale_bench.py's (RESULTS.md).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from memory_child import MiB, run_memory_child

from tierzero.engine.config import load_config
from tierzero.engine.plan.dry_run import dry_run
from tierzero.engine.plan.host import SavedBytes, init_build_bytes, predict
from tierzero.engine.plan.planner import predict_run
from tierzero.engine.plan.shapes import model_shape

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 16384, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
SEQ = 64
TOLERANCE = 0.15  # the bound on |predicted / measured - 1|


def _inputs(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    swap = tmp_path / "swap"
    swap.mkdir(mode=0o700)
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "zero": {"stage": 3}, "precision": "bf16", "gradient_clipping": 1.0,
        "optimizer": {"type": "adamw", "lr": 1e-4},
        "offload": {"device": "nvme", "path": str(swap)}}))
    return model, config


@pytest.mark.multiproc
def test_predicted_host_peak_matches_measured_rss(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model, config = _inputs(tmp_path)
    predicted = predict_run(str(model), str(config), seq_len=SEQ, device_is_host=True)
    measured = run_memory_child("plan_host_child.py", model, config, SEQ, 2)
    assert measured["losses"][1] < measured["losses"][0]  # it trained
    ratio = int(predicted["peak"]) / measured["peak_growth"]  # type: ignore[call-overload]
    assert abs(ratio - 1) <= TOLERANCE, (
        f"plan predicts {int(predicted['peak']) / MiB:.0f} MiB "  # type: ignore[call-overload]
        f"({predicted['phase']}), measured {measured['peak_growth'] / MiB:.0f} MiB", predicted)


def test_saved_bytes_counts_activations_not_parameters() -> None:
    lin = torch.nn.Linear(64, 32, device="meta")
    x = torch.empty(8, 64, device="meta", requires_grad=True)  # (B, C)
    saved = SavedBytes()
    with saved:
        y = torch.relu(lin(x))  # linear saves x (and its weight); relu saves its output
    assert saved.nbytes == (8 * 64 + 8 * 32) * 4
    assert y.shape == (8, 32)


def test_predict_adds_the_phases() -> None:
    mb = MiB
    h = predict(model=100 * mb, init_peak={"host": 40 * mb, "device": 0},
                peak={"host": 50 * mb, "device": 10 * mb}, pipeline=20 * mb, saved=5 * mb,
                largest_unit=mb, largest_group=mb, compute_bytes=2,
                device_is_host=True)
    assert h.build == 100 * mb
    assert h.initialize == 100 * mb + 6 * mb  # model and homes overlap; one unit staged
    assert h.train == (50 + 10 + 20 + 5 + 6) * mb
    assert (h.peak, h.phase) == (106 * mb, "initialize")
    # the gathered units are host memory on a CPU (root, kept units, the one gathered)
    kept = predict(model=100 * mb, init_peak={"host": 40 * mb, "device": 0},
                   peak={"host": 50 * mb, "device": 10 * mb}, pipeline=20 * mb, saved=5 * mb,
                   largest_unit=mb, largest_group=mb, compute_bytes=2, device_is_host=True,
                   gathered=30 * mb)
    assert kept.train == h.train + 30 * mb and kept.parts["gathered_units"] == 30 * mb
    gpu = predict(model=100 * mb, init_peak={"host": 40 * mb}, peak={"host": 50 * mb,
                  "device": 10 * mb}, pipeline=20 * mb, saved=5 * mb, largest_unit=mb,
                  largest_group=mb // 2, compute_bytes=2, device_is_host=False,
                  init_build=0)
    assert (gpu.build, gpu.train) == (0, 70 * mb)  # device, activations, grads: on the GPU
    assert predict(model=100 * mb, init_peak={"host": 40 * mb}, peak={"host": 50 * mb},
                   pipeline=20 * mb, saved=5 * mb, largest_unit=mb, largest_group=mb,
                   compute_bytes=2, device_is_host=False, init_build=0,
                   gathered=30 * mb).train == 70 * mb  # gathered units too
    assert gpu.initialize == 40 * mb + 3 * mb  # the host homes, one group (0.5M x 6 B) staged


def test_init_build_holds_slices_and_the_live_bound() -> None:
    """A stage-3 build under engine.Init holds this rank's slices (host memory) or only the
    staging writes in flight (params on NVMe), plus zero.max_live_bytes of whole params."""
    mb = MiB
    assert init_build_bytes(100 * mb, world_size=2, max_live=32 * mb,
                            params_on_nvme=False) == (50 + 32) * mb
    assert init_build_bytes(1000 * mb, world_size=1, max_live=32 * mb,
                            params_on_nvme=True) == (64 + 32) * mb  # INFLIGHT_BYTES
    assert init_build_bytes(10 * mb, world_size=1, max_live=32 * mb,
                            params_on_nvme=True) == 20 * mb  # never more than the model


def test_dry_run_counts_gathered_units_and_root_groups() -> None:
    """The dry run reports the most parameter bytes gathered at once and, for the
    gradients, a block unit's trainable elements or one root group's (the root's groups
    are reduced one by one), not the whole root's."""
    pytest.importorskip("transformers")
    with tempfile.TemporaryDirectory() as tmp:
        model, config = _inputs(Path(tmp))
        run = dry_run(model_shape(str(model)).fresh_module(), load_config(str(config)),
                      seq_len=SEQ)
    vocab, hidden = LLAMA["vocab_size"], LLAMA["hidden_size"]
    assert isinstance(vocab, int) and isinstance(hidden, int)
    vocab_rows = vocab * hidden  # the embedding's and the head's elements: 4.2M each
    assert run.largest_unit == vocab_rows  # one root group, not embedding + head
    # the root (bf16) and at least one block stay gathered together in forward
    assert run.gathered_peak >= 2 * vocab_rows * 2
