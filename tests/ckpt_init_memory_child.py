"""Child process of test_ckpt_init_nvme_memory: build a ~100M-parameter model under
engine.Init with params and optimizer state on NVMe, initialize, train one step; report
peak RSS per phase (and the RSS after the imports, `imported_rss`, and after the first
torch optimizer's own imports, `base_rss`) and whether the values equal a plain build, as
JSON on stdout.

    python tests/ckpt_init_memory_child.py SWAP_DIR BLOCKS DIM HOST_BUDGET DEVICE_BUDGET \
        [KNOBS [PRECISION]]
HOST_BUDGET, DEVICE_BUDGET: bytes, or "none" (not set: detected from the machine); KNOBS:
"tuned" (default: the zero.* bounds below) or "defaults" (every zero.* bound left at its
schema default); PRECISION: bf16 (default) or fp32.
"""

from __future__ import annotations

import json
import sys

import psutil
import torch
from engine_memory_child import MLP, PeakSampler

from tierzero import engine
from tierzero.engine.config import BatchConfig, Config, OptimizerConfig, PrecisionConfig, ZeroConfig
from tierzero.engine.config.schema import (
    BudgetsConfig,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)

MAX_LIVE = 32 << 20


def main() -> None:
    path, blocks, dim, host_budget, device_budget = sys.argv[1:6]
    knobs = sys.argv[6] if len(sys.argv) > 6 else "tuned"
    precision = sys.argv[7] if len(sys.argv) > 7 else "bf16"
    torch.set_num_threads(2)
    rss = psutil.Process().memory_info
    zero = (ZeroConfig(stage=3, units=("MLPBlock",), persistence_threshold_bytes=0,
                       prefetch_bytes=64 << 20, max_live_bytes=MAX_LIVE,
                       init_live_bytes=MAX_LIVE) if knobs == "tuned"
            else ZeroConfig(stage=3, units=("MLPBlock",)))
    cfg = Config(
        precision=PrecisionConfig(dtype=precision),  # type: ignore[arg-type]
        zero=zero,
        optimizer=OptimizerConfig(type="adamw", lr=1e-5),
        batch=BatchConfig(gradient_accumulation_steps=1),
        offload=OffloadConfig(
            params=ParamOffloadConfig(device="nvme", path=path),
            optimizer=OptimizerOffloadConfig(device="nvme", path=path),
            budgets=BudgetsConfig(
                host_bytes=None if host_budget == "none" else int(host_budget),
                device_bytes=None if device_budget == "none" else int(device_budget))))
    imported = rss().rss
    # The first torch.optim.Optimizer a process builds imports torch._dynamo (and sympy):
    # tens of MiB of modules (RESULTS.md), the same for any model, that a training script
    # pays with any optimizer (the engine's too: eng.optimizer is a torch.optim.Optimizer).
    # Paid before `base`, so the growth over it is what the engine holds.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    base = rss().rss
    torch.manual_seed(0)
    with PeakSampler() as init_peak, engine.Init(config=cfg) as ini:
        model = MLP(int(blocks), int(dim))
    n_params = sum(p.numel() for p in model.parameters())
    with PeakSampler() as setup_peak:
        eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    # lr 0 for this one step: it runs every part of the step (NVMe reads and writes, CPU
    # Adam, param refresh) but leaves the values as built, for the exactness check below
    eng.optimizer.param_groups[0]["lr"] = 0.0
    with PeakSampler() as step_peak:
        loss = eng(torch.randn(8, int(dim)))
        eng.backward(loss)
        eng.step()
    report = eng.memory_report()
    # Exactness, after the measurement: every gathered bf16 parameter against a plain fp32
    # build with the same seed, rounded to bf16 (what param holds).
    torch.manual_seed(0)
    plain = MLP(int(blocks), int(dim))
    unequal = []
    eng.close()  # leaves every parameter gathered, in the compute dtype
    for (k, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        if not torch.equal(p.detach(), q.detach().to(p.dtype)):
            unequal.append(k)
    json.dump({"n_params": n_params, "imported_rss": imported, "base_rss": base,
               "init_peak": init_peak.peak,
               "setup_peak": setup_peak.peak, "step_peak": step_peak.peak,
               "init_nvme_bytes": ini.nvme_bytes, "peak_live": ini.peak_live_bytes,
               "unequal": unequal, "loss": float(loss.detach()), "tiers": report["tiers"]},
              sys.stdout)


if __name__ == "__main__":
    main()
