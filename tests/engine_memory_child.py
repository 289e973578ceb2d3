"""Child process of test_engine_offload_memory: train a model with params and optimizer state
on NVMe under small host/device budgets and report RSS figures as JSON on stdout.

Run in a fresh interpreter so the RSS high-water mark belongs to this run alone:
    python tests/engine_memory_child.py SWAP_DIR BLOCKS DIM HOST_BUDGET DEVICE_BUDGET [CACHE
        [GRAD_DEVICE [CLIP [CHUNK]]]]
HOST_BUDGET, DEVICE_BUDGET: bytes, or "none" (not set: detected from the machine).
CACHE: offload.params.max_in_cpu_bytes (default 0: every parameter shard on NVMe).
GRAD_DEVICE: offload.optimizer.grad_device (default auto); CLIP: gradient_clipping (default
1.0); CHUNK: offload.optimizer.chunk_numel ("none": the default).
"""

from __future__ import annotations

import json
import sys
import threading
import time

import psutil
import torch
from torch import nn

from tierzero import engine
from tierzero.engine.config import BatchConfig, Config, OptimizerConfig, PrecisionConfig, ZeroConfig
from tierzero.engine.config.schema import (
    BudgetsConfig,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C) -> (B, C)
        return x + self.down(torch.relu(self.up(x)))


class MLP(nn.Module):
    def __init__(self, blocks: int, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).float().pow(2).mean()


class PeakSampler:
    """RSS sampled every millisecond on a thread (the training loop's own peak)."""

    def __init__(self) -> None:
        self.peak = 0
        self._proc = psutil.Process()
        self._stop = threading.Event()
        # One sampling thread: it must run beside the training loop to see its peak.
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.001)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    path, blocks, dim, host_budget, device_budget = sys.argv[1:6]
    cache = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    grad_device = sys.argv[7] if len(sys.argv) > 7 else "auto"
    clip = float(sys.argv[8]) if len(sys.argv) > 8 else 1.0
    host_bytes = None if host_budget == "none" else int(host_budget)
    device_bytes = None if device_budget == "none" else int(device_budget)
    chunk = {} if len(sys.argv) <= 9 or sys.argv[9] == "none" else {
        "chunk_numel": int(sys.argv[9])}
    torch.manual_seed(0)
    torch.set_num_threads(2)
    rss = psutil.Process().memory_info
    base = rss().rss
    model = MLP(int(blocks), int(dim))
    model_rss = rss().rss
    n_params = sum(p.numel() for p in model.parameters())
    cfg = Config(
        precision=PrecisionConfig(dtype="bf16"),
        zero=ZeroConfig(stage=3, units=("MLPBlock",), persistence_threshold_bytes=0,
                        prefetch_bytes=64 << 20, max_live_bytes=32 << 20),
        optimizer=OptimizerConfig(type="adamw", lr=1e-5),
        batch=BatchConfig(gradient_accumulation_steps=1),
        gradient_clipping=clip,
        offload=OffloadConfig(
            params=ParamOffloadConfig(device="nvme", path=path, max_in_cpu_bytes=cache),
            optimizer=OptimizerOffloadConfig(device="nvme", path=path,
                                             grad_device=grad_device,  # type: ignore[arg-type]
                                             **chunk),
            budgets=BudgetsConfig(host_bytes=host_bytes, device_bytes=device_bytes)))
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    after_init = rss().rss
    x = torch.randn(8, int(dim))
    losses: list[float] = []
    hwm_ok = _reset_hwm()
    t0 = time.perf_counter()
    with PeakSampler() as sampler:
        for _ in range(3):
            loss = eng(x)
            eng.backward(loss)
            eng.step()
            losses.append(float(loss.detach()))
        # the last step's update, deferred into a next forward under clipping ([Note:
        # deferred streamed step] in engine/step/deferred_stream.py), runs here
        eng.step_driver.drain()
    step_s = (time.perf_counter() - t0) / 3
    report = eng.memory_report()
    peak = max(sampler.peak, _hwm() if hwm_ok else 0)
    eng.close()
    json.dump({"n_params": n_params, "base_rss": base, "after_init_rss": after_init,
               "model_rss": model_rss,
               "train_peak_rss": peak, "hwm_reset": hwm_ok, "losses": losses,
               "step_s": step_s, "tiers": report["tiers"],
               "optimizer_step": report["optimizer_step"]}, sys.stdout)


if __name__ == "__main__":
    main()
