"""[Note: CPU compute defaults] (engine/host_defaults.py): on a CPU compute device the bounds
sized for accelerator memory default to what the schedule needs and explicit values win.
Results are bitwise the same either way (only residency changes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import psutil
import pytest
import torch
from engine_helpers import (
    assert_match,
    engine_train,
    make_batches,
    make_config,
    make_model,
    reference_train,
)

from tierzero import engine
from tierzero.engine.config import Config, load_config
from tierzero.engine.config.schema import (
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)
from tierzero.engine.host_defaults import GPU_GATHER_BYTES, engine_device, gather_bounds
from tierzero.engine.models import SIZES, TinyLM
from tierzero.engine.plan import dry_run
from tierzero.engine.shards.tier_config import tier_settings
from tierzero.offload import ShardSpec

CPU = torch.device("cpu")
STEPS = 3


def _nvme(cfg: Config, path: Path, **zero: int) -> Config:
    where = str(path)
    return dataclasses.replace(
        cfg, zero=dataclasses.replace(cfg.zero, **zero),  # type: ignore[arg-type]
        offload=OffloadConfig(params=ParamOffloadConfig(device="nvme", path=where),
                              optimizer=OptimizerOffloadConfig(device="nvme", path=where)))


def _train(cfg: Config) -> tuple[engine.ZeroEngine, dict[str, torch.Tensor], int]:
    """The engine after STEPS steps, its parameters, and the most bytes it kept gathered
    during them (before the parameters are gathered to be read)."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
    for ids, tg in make_batches(STEPS):
        eng.backward(eng(ids, tg))
        eng.step()
    peak = eng.scheduler.gathered_peak_bytes
    with engine.GatheredParameters(list(eng.module.parameters())):
        params = {k: v.detach().clone() for k, v in eng.module.named_parameters()}
    return eng, params, peak


def _unit_bytes(eng: engine.ZeroEngine) -> tuple[int, int]:
    """(bytes gathered through every forward: root and persistent units, largest other)."""
    full = {u.index: sum(g.padded_numel * g.full.element_size() for g in u.groups)
            for u in eng.units}
    always = sum(full[u.index] for u in eng.units if u.is_root or u.persistent)
    return always, max(full[u.index] for u in eng.units if not (u.is_root or u.persistent))


def test_cpu_keeps_only_the_last_unit_gathered_for_backward(tmp_path: Path) -> None:
    """Unset gather bounds on a CPU: one unit (the last of forward) stays gathered for its
    backward, so the gathered bytes never exceed the root + the largest unit; the 2 GB
    GPU default kept every unit. Explicit values still apply; the results are identical."""
    (tmp_path / "a").mkdir(mode=0o700)
    (tmp_path / "b").mkdir(mode=0o700)
    eng, params, peak = _train(_nvme(make_config(), tmp_path / "a"))
    always, largest = _unit_bytes(eng)
    assert gather_bounds(eng.config.zero, CPU, eng.units) == (always + largest, largest)
    blocks = sum(1 for u in eng.units if not (u.is_root or u.persistent))
    assert blocks > 1
    # forwards after the first (the first records the trace): one unit kept in each
    assert eng.scheduler.kept == STEPS - 1
    assert peak <= always + largest
    assert eng.memory_report()["tiers"]["order_mismatches"] == 0
    eng.close()
    wide, wide_params, wide_peak = _train(_nvme(make_config(), tmp_path / "b",
                                     max_live_bytes=GPU_GATHER_BYTES,
                                     max_reuse_distance_bytes=GPU_GATHER_BYTES))
    assert wide.scheduler.kept == blocks * (STEPS - 1)
    assert wide_peak > always + largest
    wide.close()
    assert all(torch.equal(params[k], wide_params[k]) for k in params)


def test_cuda_defaults_stay_gpu_sized(tmp_path: Path) -> None:
    """The same units planned for a CUDA device keep the 2 GB defaults; set values win."""
    eng, _, _ = _train(_nvme(make_config(), tmp_path))
    assert gather_bounds(eng.config.zero, torch.device("cuda"), eng.units) == (
        GPU_GATHER_BYTES, GPU_GATHER_BYTES)
    for device in (CPU, torch.device("cuda")):
        cfg = dataclasses.replace(eng.config, zero=dataclasses.replace(
            eng.config.zero, max_live_bytes=123, max_reuse_distance_bytes=0))
        assert gather_bounds(cfg.zero, device, eng.units) == (123, 0)
    eng.close()


def test_cpu_params_on_nvme_are_gathered_from_their_host_cache(tmp_path: Path) -> None:
    """Params on NVMe, no device budget, a CPU compute device: each param shard is gathered
    from the host cache its NVMe read fills, never copied into the device tier (host memory
    here) first ([Note: params gathered from host memory]): the device tier holds nothing,
    and the training matches plain PyTorch (AdamW) within the parity tolerances."""
    batches = make_batches(STEPS)
    got = engine_train(_nvme(make_config(), tmp_path), batches, STEPS)
    ref = reference_train(make_model(), make_config(), [batches], STEPS)
    assert_match(got.losses, got.params, ref.losses, ref.params)
    assert got.report is not None
    tiers = got.report["tiers"]
    assert tiers["moved"]["nvme_to_host"] > 0
    assert tiers["moved"].get("host_to_device", 0) == 0
    assert tiers["moved"].get("device_to_host", 0) == 0
    assert tiers["peak"].get("device", 0) == 0


def test_dry_run_planning_cuda_fetches_params_to_the_device() -> None:
    """A dry run on meta gathers as on the machine it plans: from host memory for a CPU,
    through the device tier for a CUDA machine (its host-to-device copies are counted)."""
    config = load_config({"zero": {"stage": 3}, "precision": "bf16", "gradient_clipping": 0.0,
                          "offload": {"device": "nvme", "path": "/tmp"}})
    with torch.device("meta"):
        module = TinyLM(SIZES["tiny"])
    cpu = dry_run(module, config, steps=2)
    with torch.device("meta"):
        module = TinyLM(SIZES["tiny"])
    cuda = dry_run(module, config, steps=2, device_is_host=False)
    assert cpu.step().host_to_device == 0
    assert cuda.step().host_to_device > 0


def _specs(n16: list[int]) -> list[ShardSpec]:
    out = [ShardSpec(f"u{i}:param", "param", n, torch.bfloat16) for i, n in enumerate(n16)]
    return out + [ShardSpec(f"u{i}:{kind}", kind, n, torch.float32)
                  for i, n in enumerate(n16) for kind in ("master", "grad")]


def _settings(offload: Mapping[str, object], specs: list[ShardSpec], *,
              params_to_device: bool = False) -> int:
    config = load_config({"zero": {"stage": 3}, "offload": offload})
    budget = tier_settings(config, CPU, specs=specs,
                           params_to_device=params_to_device).budgets.device
    assert budget is not None
    return budget


def test_cpu_device_tier_budget_is_what_the_schedule_needs() -> None:
    """The CPU stand-in device tier's default budget: device homes, at least the
    placement's cache reserve (the largest param or gradient
    shard homed below the device); with an auto home (the planner may fill it) the
    available memory; an explicit budget wins."""
    specs = _specs([1000, 3000, 2000])
    nvme = {"device": "nvme", "path": "/tmp"}
    # params gathered from host memory: the reserve alone, one fp32 gradient of 3000
    assert _settings(nvme, specs) == 3000 * 4
    # params fetched to the device (a dry run planning CUDA): two of the largest param
    # shard, 5000 x 2 B each, above the reserve (that shard: frozen, no gradient)
    frozen = [ShardSpec(f"u{i}:param", "param", n, torch.bfloat16)
              for i, n in enumerate([1000, 5000])]
    assert _settings(nvme, frozen, params_to_device=True) == 2 * 5000 * 2
    assert _settings(nvme, frozen) == 5000 * 2
    # param on the device (offload.params none): its homes + the largest gradient
    both = {"params": {"device": "none"}, "optimizer": nvme}
    assert _settings(both, specs) == 6000 * 2 + 3000 * 4
    auto = {"device": "auto", "path": "/tmp"}
    assert _settings(auto, specs) > psutil.virtual_memory().available // 2
    assert _settings({**nvme, "budgets": {"device_bytes": 12345}}, specs) == 12345


def test_engine_device_names_the_cuda_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA device given as "cuda" becomes the current one with its index (layer-major's
    micro-batch threads set it as theirs, which takes an index: found on an H200); None is
    the current CUDA device where there is one, else the CPU; others are kept."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert engine_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert engine_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert engine_device(torch.device("cpu")) == torch.device("cpu")
    assert engine_device(torch.device("meta")) == torch.device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_device(None) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_device(None) == torch.device("cpu")
