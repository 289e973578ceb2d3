"""`tierzero train` end to end on the tiny built-in model: metrics, trace, plot, numerics."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from cli_helpers import read_metrics, write_config

from tierzero import engine
from tierzero.engine.cli import main
from tierzero.engine.models import SIZES, TinyLM
from tierzero.engine.train import KINDS, ByteBatches, StepRecord, load_bytes

STEP_FIELDS = set(StepRecord.__dataclass_fields__)


def reference_losses(steps: int, *, seed: int, lr: float, wd: float, batch: int,
                     seq_len: int, norms: list[float] | None = None,
                     clip: float = 0.0) -> list[float]:
    """The same run in plain PyTorch: same init, same batches, torch.optim.AdamW; `norms`
    gets each step's gradient norm before clipping (clip_grad_norm_ to `clip`, if > 0)."""
    torch.manual_seed(seed)
    model = TinyLM(SIZES["tiny"])
    tokens, source = load_bytes(None)
    data = ByteBatches(tokens, seq_len, batch, seed=seed, rank=0, source=source)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    losses = []
    for _ in range(steps):
        x, y = data.next()
        loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                              clip if clip > 0 else math.inf)
        if norms is not None:
            norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_train_end_to_end(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra (in dev)")
    config = write_config(tmp_path)
    trace, plot = tmp_path / "trace.json", tmp_path / "run.png"
    caplog.set_level("INFO", logger="tierzero.engine.train")
    code = main(["train", str(config), "--trace", str(trace), "--trace-steps", "2,2",
                 "--plot", str(plot), "--no-progress"])
    assert code == 0
    rows = read_metrics(tmp_path)
    assert [r["event"] for r in rows] == ["run"] + ["step"] * 6 + ["end"]
    run, steps, end = rows[0], rows[1:-1], rows[-1]
    n_params = SIZES["tiny"].num_parameters
    assert run["parameters"] == n_params and run["units"] == 3  # 2 blocks + root
    assert run["config"]["train"]["model"] == "builtin:tiny"
    for i, row in enumerate(steps, 1):
        assert set(row) == STEP_FIELDS | {"event"}
        assert row["step"] == i and math.isfinite(row["loss"])
        assert row["tokens"] == 2 * 32
        assert row["step_s"] >= row["optimizer_s"] > 0 and row["wait_s"] >= 0
        assert row["compute_s"] + row["wait_s"] + row["optimizer_s"] == pytest.approx(
            row["step_s"], rel=1e-6)
        # Nothing is offloaded (offload none): every byte is on the device tier, and it
        # holds at least the fp32 master and both Adam moments (4 bytes each) and the bf16
        # param and gradient (2 each: world size 1, [Note: gradient precision]) of every
        # parameter.
        assert row["tier_bytes"]["host"] == row["tier_bytes"]["nvme"] == 0
        assert row["tier_peak_bytes"]["device"] >= row["tier_bytes"]["device"] >= 4 * 4 * n_params
        assert row["nvme_read_bytes"] >= 0 and row["nvme_written_bytes"] >= 0
    assert end["steps"] == 6 and end["last_loss"] == steps[-1]["loss"]
    # Per-step log lines name the parts of the step.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 6
    assert all(k in lines[0] for k in ("loss", "lr", "tok/s", "compute", "wait", "optimizer",
                                        "device", "host", "nvme read"))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    check_trace(json.loads(trace.read_text()), steps=(2, 3))


ENGINE_KINDS = {"step", "forward", "backward", "optimizer", "gather", "release", "compute",
                "reduce"}  # what a run without offloading records (no I/O, no CPU Adam)


def check_trace(doc: dict[str, Any], steps: tuple[int, ...]) -> None:
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    kinds = {e["cat"] for e in spans}
    assert kinds == ENGINE_KINDS and kinds <= set(KINDS)
    assert sorted(e["name"] for e in spans if e["cat"] == "step") == [f"step {s}" for s in steps]
    fwd = [e["name"] for e in spans
           if e["cat"] == "compute" and e.get("args", {}).get("phase") == "forward"]
    assert fwd == ["blocks.0", "blocks.1"] * len(steps)  # forward order, every traced step
    forwards = [e for e in spans if e["cat"] == "forward"]
    for e in spans:
        assert e["dur"] >= 0 and e["ts"] >= 0
        if e["cat"] == "compute" and e["args"]["phase"] == "forward":  # inside a forward span
            assert any(f["ts"] <= e["ts"] and e["ts"] + e["dur"] <= f["ts"] + f["dur"] + 1
                       for f in forwards)


def test_losses_match_plain_pytorch(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    assert main(["train", str(config), "--no-progress"]) == 0
    ours = [r["loss"] for r in read_metrics(tmp_path) if r["event"] == "step"]
    ref = reference_losses(6, seed=3, lr=3.0e-3, wd=0.01, batch=2, seq_len=32)
    # fp32 on both sides; the engine sums flat shards and runs foreach AdamW, plain
    # PyTorch per tensor, so results differ by float rounding only (~1e-6 relative),
    # which six Adam steps amplify to well under 1e-4.
    assert ours == pytest.approx(ref, rel=1e-4, abs=1e-5)
    assert ours[-1] < ours[0] - 0.5  # the loss visibly falls


@pytest.mark.parametrize("offload", ["none", "nvme"])
@pytest.mark.parametrize("clip", [0.0, 0.3, 100.0])
def test_grad_norm_in_every_step_line_matches_pytorch(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, clip: float, offload: str) -> None:
    """grad_norm (before clipping) and clip_coef in every step line of metrics.jsonl and
    in the log line, clipping off and on (0.3 is below every step's norm here, so it
    acts; 100 above every one, so it never does), with state on the device and streamed
    from NVMe; the norm is the one clip_grad_norm_ returns on the plain model. fp32 both
    sides: the norms differ by the float rounding the losses do (measured <= 2.2e-7
    relative), asserted within 2e-6. How each step's update ran (`update`): on NVMe,
    during backward without clipping, deferred while clipping fires, and speculated
    after the first step where it never does ([Note: speculated step])."""
    config = write_config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    cfg["gradient_clipping"] = clip
    if offload == "nvme":
        cfg["offload"] = {"device": "nvme", "path": str(tmp_path)}
    config.write_text(yaml.safe_dump(cfg))
    caplog.set_level("INFO", logger="tierzero.engine.train")
    assert main(["train", str(config), "--no-progress"]) == 0
    steps = [r for r in read_metrics(tmp_path) if r["event"] == "step"]
    want: list[float] = []
    reference_losses(6, seed=3, lr=3.0e-3, wd=0.01, batch=2, seq_len=32, norms=want,
                     clip=clip)
    assert [r["grad_norm"] for r in steps] == pytest.approx(want, rel=2e-6)
    coefs = [r["clip_coef"] for r in steps]
    if 0 < clip < 1:
        assert min(want) > clip
        assert coefs == pytest.approx([clip / (n + 1e-6) for n in want], rel=2e-6)
    else:
        assert max(want) < clip or not clip
        assert coefs == [1.0] * 6
    updates = [r["update"] for r in steps]
    if offload == "none":
        assert updates == ["step"] * 6
    elif not clip:
        assert updates == ["backward"] * 6
    elif clip < 1:
        assert updates == ["deferred"] * 6  # clipping fires on every step: never speculated
    else:
        assert updates == ["deferred"] + ["speculated"] * 5
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 6
    for line, row in zip(lines, steps, strict=True):
        assert f"grad norm {row['grad_norm']:.4f}, clip coef {row['clip_coef']:.3f}" in line
        assert line.endswith(f" | update {row['update']}")
        # the step's CPU: the process ran (a CPU step computes on it); steal where counted
        assert row["cpu_cores"] > 0 and f" | cpu {row['cpu_cores']:.2f} cores" in line
        assert row["steal_cores"] is None or row["steal_cores"] >= 0


def test_steps_flag_overrides_config(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    assert main(["train", str(config), "--steps", "2", "--no-progress"]) == 0
    assert [r["event"] for r in read_metrics(tmp_path)] == ["run", "step", "step", "end"]


def test_metrics_path_setting(tmp_path: Path) -> None:
    target = tmp_path / "m" / "metrics.jsonl"
    config = write_config(tmp_path, steps=1, metrics_path=str(target))
    assert main(["train", str(config), "--no-progress"]) == 0
    assert json.loads(target.read_text().splitlines()[1])["event"] == "step"


def test_jsonl_dataset(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"line {i} of a tiny dataset. " * 4})
                              for i in range(20)))
    config = write_config(tmp_path, steps=2, dataset=str(data))
    assert main(["train", str(config), "--no-progress"]) == 0
    assert read_metrics(tmp_path)[0]["dataset"] == str(data)


def test_embedded_default_names_the_built_in_model() -> None:
    cfg = engine.load_config()
    assert cfg.train.model == "builtin:small" and cfg.train.dataset is None
    assert 20e6 < SIZES["small"].num_parameters < 50e6  # "a few tens of millions"
    assert cfg.offload.params.device == cfg.offload.optimizer.device == "nvme"


@pytest.mark.cuda
def test_train_on_cuda_matches_cpu(tmp_path: Path) -> None:
    """The same short fp32 run on the GPU (the engine's default device there) and the plain
    PyTorch reference on the CPU: equal up to kernel differences (TF32 is off by default for
    matmuls in PyTorch; reductions still differ in order, hence 1e-3)."""
    config = write_config(tmp_path)
    assert main(["train", str(config), "--no-progress"]) == 0
    rows = read_metrics(tmp_path)
    assert rows[0]["machine"]["cuda"] is True
    ours = [r["loss"] for r in rows if r["event"] == "step"]
    ref = reference_losses(6, seed=3, lr=3.0e-3, wd=0.01, batch=2, seq_len=32)
    assert ours == pytest.approx(ref, rel=1e-3, abs=1e-4)


def test_gradient_accumulation(tmp_path: Path) -> None:
    """Two micro-batches per step: twice the tokens, one optimizer step per record."""
    config = write_config(tmp_path, steps=2)
    text = config.read_text().replace("gradient_accumulation_steps: 1",
                                      "gradient_accumulation_steps: 2")
    config.write_text(text)
    assert main(["train", str(config), "--no-progress"]) == 0
    steps = [r for r in read_metrics(tmp_path) if r["event"] == "step"]
    assert [r["tokens"] for r in steps] == [2 * 2 * 32] * 2
    assert all(r["optimizer_s"] > 0 for r in steps)
