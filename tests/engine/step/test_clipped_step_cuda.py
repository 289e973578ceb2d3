"""The default run's step on a CUDA device: the update under clipping deferred into the next
forward ([Note: deferred streamed step] in engine/step/deferred_stream.py), 2-byte
gradients, the bf16 master with int8 moments and an fp16 overflow skip, each against plain
PyTorch on the same GPU (or the CPU-side fp16 GradScaler reference), the gradients computed
on the GPU and the optimizer state on NVMe. Layer-major on the GPU:
tests/engine/test_layer_major.py.

Tolerances: fp32 runs as tests/engine/test_engine_cuda.py (params 1e-4 absolute, losses 1e-5
relative: the CPU parity bounds with 10x margin for GPU reduction kernels); bf16 compute
tracks fp32 within the CPU bf16 test's 0.03 on the loss; fp16 within
test_deferred_step.assert_within_fp16_noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import FP16_OVERFLOW_STEP, full_params, make_batches, make_model
from test_deferred_step import assert_within_fp16_noise, grad_scaler_train
from test_deferred_stream import SCALES, reference

from tierzero import engine
from tierzero.engine.config import Config

pytestmark = pytest.mark.cuda


def _config(tmp: Path, *, precision: str = "fp32",
            optimizer: dict[str, Any] | None = None) -> Config:
    """Params and optimizer state on NVMe in `tmp`, overlap_step on (the default)."""
    tmp.mkdir(parents=True, exist_ok=True)
    raw: dict[str, Any] = {
        "zero": {"stage": 3, "persistence_threshold_bytes": 0, "units": ["Block"]},
        "precision": precision,
        "optimizer": {"type": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": 0.1},
        "gradient_clipping": 1.0,
        "offload": {"params": {"device": "nvme", "path": str(tmp)},
                    "optimizer": {"device": "nvme", "path": str(tmp), **(optimizer or {})}},
    }
    if precision == "fp16":  # dynamic scaling from 2**8, growth every 2 good steps
        raw["precision"] = {"dtype": "fp16", "loss_scale": {
            "initial_scale_power": 8, "growth_interval": 2, "hysteresis": 1}}
    return engine.load_config(raw)


def _train(cfg: Config, batches: list[tuple[torch.Tensor, torch.Tensor]],
           scales: tuple[float, ...]) -> dict[str, Any]:
    """One forward, backward and step per batch on the GPU, its loss times `scales[i]`."""
    eng, _, _, _ = engine.initialize(device="cuda", model=make_model(), config=cfg)
    out: dict[str, Any] = {"losses": [], "coefs": [], "loss_scales": []}
    try:
        for (ids, tg), scale in zip(batches, scales, strict=True):
            loss = eng(ids, tg)
            assert loss.device.type == "cuda"
            eng.backward(loss * scale)
            eng.step()
            out["losses"].append(float(loss.detach()))
            out["coefs"].append(eng.get_clip_coef())
            out["loss_scales"].append(eng.loss_scaler.scale if eng.loss_scaler else None)
        out["params"] = {k: v.cpu() for k, v in full_params(eng, eng.module).items()}
        out["report"] = eng.memory_report()
        out["skipped"] = eng.skipped_steps
    finally:
        eng.close()
    return out


@pytest.mark.parametrize("grads", ["cpu", "nvme"])
def test_cuda_deferred_clipped_step_matches_pytorch(tmp_path: Path, grads: str) -> None:
    """fp32, clipping 1.0 firing on the steps whose loss is not halved (SCALES), the update
    deferred into the next forward: plain PyTorch's clip_grad_norm_ + AdamW on the GPU."""
    batches = make_batches(len(SCALES))
    got = _train(_config(tmp_path, optimizer={"grad_device": grads}), batches, SCALES)
    ref = reference(batches, SCALES, 1.0, "cuda")
    fired = [n > 1.0 for n in ref["norms"]]
    assert any(fired) and not all(fired)
    for coef, norm in zip(got["coefs"], ref["norms"], strict=True):
        assert coef == pytest.approx(min(1.0, 1.0 / (norm + 1e-6)), rel=1e-5)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=0)
    for k, want in ref["params"].items():
        torch.testing.assert_close(got["params"][k], want, rtol=0, atol=1e-4, msg=k)
    moved = got["report"]["tiers"]["moved"]
    assert moved["nvme_to_host"] > 0 and moved["host_to_nvme"] > 0


@pytest.mark.parametrize("master,state", [("fp32", "fp32"), ("bf16", "int8")])
def test_cuda_default_run_and_bf16_master_track_fp32(tmp_path: Path, master: str,
                                                     state: str) -> None:
    """The default run's precision (bf16 compute, gradients in host memory at 2 bytes,
    clipping 1.0) and the leanest (bf16 master, int8 moments) on the GPU track plain fp32
    PyTorch as the CPU bf16 tests do."""
    batches = make_batches(10)
    ones = (1.0,) * len(batches)
    cfg = _config(tmp_path, precision="bf16", optimizer={
        "grad_device": "cpu", "master_precision": master, "state_precision": state})
    got = _train(cfg, batches, ones)
    ref = reference(batches, ones, 1.0, "cuda")
    diff = (torch.tensor(got["losses"]) - torch.tensor(ref["losses"])).abs().max()
    assert float(diff) < 0.03
    assert got["losses"][-1] < got["losses"][0]
    shard = got["report"]["shard_bytes"]
    assert shard["grad"] == shard["param"]  # one rank, no accumulation: 2-byte gradients
    assert shard["master"] == (0 if master == "bf16" else 2 * shard["param"])


def test_cuda_fp16_overflow_skips_the_step_like_grad_scaler(tmp_path: Path) -> None:
    """fp16 on the GPU, state on NVMe, the update deferred: step FP16_OVERFLOW_STEP's
    gradients overflow and the step is skipped, the scale halves and grows as
    torch.amp.GradScaler's, and the parameters stay within fp16 noise of its fp32 run."""
    n = 6
    batches = make_batches(n)
    scales = tuple(1e9 if i == FP16_OVERFLOW_STEP else 1.0 for i in range(n))
    got = _train(_config(tmp_path, precision="fp16"), batches, scales)
    want, want_scales, want_skipped = grad_scaler_train(batches, FP16_OVERFLOW_STEP, 1.0)
    assert got["skipped"] == want_skipped == 1
    assert got["loss_scales"] == want_scales
    assert_within_fp16_noise(got["params"], want)
