"""offload.params.max_in_cpu_bytes: with params on NVMe, the first parameter shards (blocks
in forward order) within it are homed in host memory, the rest on NVMe. Everything that
touches param must work with the mix: training (gathers, the NVMe Adam stream writing
each shard's new param to its own home), 1 and 2 ranks, checkpoints across different
splits, engine.Init onto NVMe, GatheredParameters write-back and the dry run.

Tolerances: against plain PyTorch AdamW as tests/engine/test_engine_offload.py (PARAM_ATOL 1e-5,
LOSS_RTOL 1e-6, reasons there; bf16: loss within 0.03 of the fp32 reference as
test_engine_parity). Against the all-NVMe run: bitwise (torch.equal), because the math is
the same: the same kernels see the same bytes, only the tier each param lives on differs.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_dist import run_two_ranks
from engine_helpers import (
    assert_match,
    engine_train,
    make_batches,
    make_config,
    make_model,
    reference_train,
    train_and_gather,
    train_steps,
)

from tierzero import engine
from tierzero.engine.config import Config
from tierzero.engine.config.schema import (
    BudgetsConfig,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)
from tierzero.engine.plan import dry_run, engine_config, model_shape
from tierzero.engine.plan.planner import plan_choice
from tierzero.swap.store import SwapStore

STEPS = 10
# TinyLM(4 blocks) at world size 1: each block's param shard is 17,408 B in fp32 (8,704 B
# bf16), the root's 16,896 B. 40,000 B keeps blocks 0-1 in fp32 and 0-3 in bf16 (the root,
# declared last, does not fit either): a real mix of host and NVMe homes.
CACHE = 40_000
HOST_BLOCKS = {"fp32": 2, "bf16": 4}  # the blocks CACHE homes in host memory
BLOCK_BYTES = {"fp32": 17_408, "bf16": 8_704}


def _cfg(cfg: Config, path: Path, cache: int, optimizer: str = "nvme") -> Config:
    path.mkdir(parents=True, exist_ok=True)
    # Every unit stays gathered from its forward to its backward (the accelerator-sized
    # bounds, not the CPU defaults of [Note: CPU compute defaults]): backward then reads no
    # param, so the NVMe bytes compared below do not depend on how much of the pool the
    # read-ahead holds when a unit is gathered again.
    zero = dataclasses.replace(cfg.zero, max_live_bytes=2 << 30, max_reuse_distance_bytes=2 << 30)
    return dataclasses.replace(cfg, zero=zero, offload=OffloadConfig(
        params=ParamOffloadConfig(device="nvme", path=str(path), max_in_cpu_bytes=cache),
        optimizer=OptimizerOffloadConfig(device=optimizer, path=str(path)),  # type: ignore[arg-type]
        budgets=BudgetsConfig(device_bytes=64 << 10)))


def _tiers(report: dict[str, Any] | None) -> dict[str, Any]:
    assert report is not None and isinstance(report["tiers"], dict)
    return report["tiers"]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad


@pytest.mark.parametrize(("precision", "optimizer"),
                         [("fp32", "nvme"), ("bf16", "nvme"), ("bf16", "cpu")])
def test_partial_cache_trains_like_all_nvme_bitwise(precision: str, optimizer: str,
                                                    tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """optimizer nvme: the streamed CPU Adam (offload/adam_stream.py); cpu: the in-place
    CPU Adam over host-homed state (engine/step/in_place.py). Both write param home."""
    reads: list[str] = []  # every key read from the swap files, in order
    read = SwapStore.read

    def spy(self: SwapStore, key: str, *args: Any, **kwargs: Any) -> Any:
        reads.append(key)
        return read(self, key, *args, **kwargs)

    monkeypatch.setattr(SwapStore, "read", spy)
    batches = make_batches(STEPS)
    base = make_config(precision=precision, clip=0.5)
    nvme = engine_train(_cfg(base, tmp_path / "a", 0, optimizer), batches, STEPS)
    first_reads = list(reads)
    reads.clear()
    cached = engine_train(_cfg(base, tmp_path / "b", CACHE, optimizer), batches, STEPS)
    assert cached.losses == nvme.losses
    _same(cached.params, nvme.params)
    ref = reference_train(make_model(), make_config(clip=0.5), [batches], STEPS)
    if precision == "fp32":
        assert_match(cached.losses, cached.params, ref.losses, ref.params)
    else:
        diff = (torch.tensor(cached.losses) - torch.tensor(ref.losses)).abs().max()
        assert float(diff) < 0.03, (cached.losses, ref.losses)
    t0, t1 = _tiers(nvme.report), _tiers(cached.report)
    p16 = t1["homes"]["param"]
    kept = t1["params_in_cpu"]
    assert 0 < kept <= CACHE and p16["host"] == kept and p16["nvme"] > 0  # a real mix
    assert "host" not in t0["homes"]["param"] and t0["params_in_cpu"] == 0
    # the cached shards' param never goes to NVMe: not placed there, not written per step
    # Counted for the param class alone: a gradient shard spills to NVMe when the host
    # pool is short at that moment, which depends on how far the read-ahead got.
    m0, m1 = t0["moved_by_class"], t1["moved_by_class"]
    saved = m0["host_to_nvme"]["param"] - m1["host_to_nvme"]["param"]
    if optimizer == "nvme":  # the stream writes every new param home at once
        assert saved == (STEPS + 1) * kept
    else:  # the in-place step updates param in host caches, written back on eviction
        assert saved >= kept
    # Nor read back: per key, since the class totals depend on which pool buffers still
    # hold a kept param when the next forward gathers it ([Note: param kept in host memory]
    # in offload/stream_parts.py), in the all-NVMe run as in this one.
    assert kept == HOST_BLOCKS[precision] * BLOCK_BYTES[precision]
    host = tuple(f"blocks.{i}/" for i in range(HOST_BLOCKS[precision]))
    assert any(k.endswith(":param") for k in first_reads)  # the spy sees param reads
    assert not [k for k in reads if k.startswith(host) and k.endswith(":param")]
    assert t1["current"]["nvme"] == t0["current"]["nvme"] - kept


def _two_rank_scenario(rank: int, swap: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = make_config(gas=2, clip=0.5)
    for cache in (0, CACHE // 2):  # half the shard bytes per rank: keep the same blocks
        cfg = _cfg(base, Path(swap) / f"r{rank}c{cache}", cache)
        r = engine_train(cfg, make_batches(STEPS * 2, seed=1 + rank), STEPS, world_mean=True)
        out[str(cache)] = {"losses": r.losses, "params": r.params,
                           "kept": _tiers(r.report)["params_in_cpu"]}
    return out


@pytest.mark.multiproc
def test_partial_cache_two_ranks_matches_pytorch(tmp_path: Path) -> None:
    (tmp_path / "swap").mkdir()
    results = run_two_ranks(tmp_path, {"run": partial(_two_rank_scenario,
                                                      swap=str(tmp_path / "swap"))})
    ref = reference_train(make_model(), make_config(gas=2, clip=0.5),
                          [make_batches(STEPS * 2, seed=1 + r) for r in range(2)], STEPS)
    for res in results:
        nvme, cached = res["run"]["0"], res["run"][str(CACHE // 2)]
        assert cached["kept"] > 0
        assert cached["losses"] == nvme["losses"]
        _same(cached["params"], nvme["params"])
        assert_match(cached["losses"], cached["params"], ref.losses, ref.params)


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with engine.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize(("save_cache", "load_cache"), [(CACHE, 0), (0, CACHE)])
def test_checkpoint_across_different_splits(save_cache: int, load_cache: int,
                                            tmp_path: Path) -> None:
    """Saved with one host/NVMe split of param, loaded into another: continued training
    equals the uninterrupted run bitwise (the checkpoint holds values, not homes)."""
    base = make_config(clip=0.5)
    batches = make_batches(8)
    model = make_model()
    eng, *_ = engine.initialize(device="cpu", model=model,
                                config=_cfg(base, tmp_path / "s1", save_cache))
    train_steps(eng, batches[:4])
    eng.save_checkpoint(tmp_path / "ckpt")
    full_losses = train_steps(eng, batches[4:])
    want = _gathered(model)
    eng.close()
    model2 = make_model(seed=7)  # different initial values: the load must overwrite them
    eng2, *_ = engine.initialize(device="cpu", model=model2,
                                 config=_cfg(base, tmp_path / "s2", load_cache))
    eng2.load_checkpoint(tmp_path / "ckpt")
    # fp32: blocks 0-1 (2 x 17,408 B) within CACHE, or nothing
    assert _tiers(eng2.memory_report())["params_in_cpu"] == (2 * 17_408 if load_cache else 0)
    assert train_steps(eng2, batches[4:]) == full_losses
    _same(_gathered(model2), want)
    eng2.close()


def test_init_onto_nvme_with_partial_cache(tmp_path: Path) -> None:
    """engine.Init stages slices on NVMe; initialize() then homes the first shards in host
    memory: values and training equal a plain build bitwise."""
    (tmp_path / "swap").mkdir()
    cfg = engine.load_config({
        "zero": {"stage": 3, "units": ["Block"], "persistence_threshold_bytes": 0},
        "precision": "fp32", "gradient_clipping": 0.5,
        "optimizer": {"type": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": 0.1},
        "offload": {"device": "nvme", "path": str(tmp_path / "swap"),
                    "max_in_cpu_bytes": CACHE}})
    with engine.Init(config=cfg):
        model = make_model(n_blocks=6)
    got = train_and_gather(model, cfg)
    want = train_and_gather(make_model(n_blocks=6), cfg)
    assert got["losses"] == want["losses"]
    _same(got["params"], want["params"])  # type: ignore[arg-type]


def test_gathered_parameters_write_back_to_both_homes(tmp_path: Path) -> None:
    """GatheredParameters(modifier_rank=0) writes new values of a host-homed block (0) and
    an NVMe-homed one (3); both read back, and the next step starts from them."""
    model = make_model()
    eng, *_ = engine.initialize(device="cpu", model=model,
                                config=_cfg(make_config(), tmp_path, CACHE))
    homes = eng.store.manager.plan.homes  # type: ignore[attr-defined]
    assert homes["blocks.0/float32/trainable:param"] == "host"
    assert homes["blocks.3/float32/trainable:param"] == "nvme"
    train_steps(eng, make_batches(2))
    targets = {"blocks.0.up.weight": 0.25, "blocks.3.down.bias": -0.5}
    params = dict(model.named_parameters())
    with engine.GatheredParameters([params[k] for k in targets], modifier_rank=0):
        for k, v in targets.items():
            params[k].data.fill_(v)
    now = _gathered(model)
    for k, v in targets.items():
        assert torch.equal(now[k], torch.full_like(now[k], v)), k
    before = now
    train_steps(eng, make_batches(1, seed=5))
    after = _gathered(model)
    # the step moved them from the written values (Adam's first update is ~lr per entry)
    for k in targets:
        assert 0 < float((after[k] - before[k]).abs().max()) < 0.05, k
    eng.close()


def test_dry_run_counts_the_cache(tmp_path: Path) -> None:
    """The plan's table and the dry run (meta tensors, DrySwap) both see the split: the
    cached param bytes are on host, and the step writes that much less to NVMe."""
    shape = model_shape("builtin:tiny")
    nocache = engine_config("nvme", _big(), precision="bf16", nvme_path=str(tmp_path))
    cache_bytes = 100_000  # of the tiny model's ~250 KB of param
    cached = engine_config("nvme", _big(), precision="bf16", nvme_path=str(tmp_path),
                           max_in_cpu_bytes=cache_bytes)
    assert cached.offload.params.max_in_cpu_bytes == cache_bytes
    table = plan_choice(shape, "nvme", _big(), world_size=1, precision="bf16",
                        nvme_path=str(tmp_path), max_in_cpu_bytes=cache_bytes)
    kept = table.by_tier["host"]["param"]
    assert 0 < kept <= cache_bytes and table.by_tier["nvme"]["param"] > 0
    runs = [dry_run(shape.fresh_module(), c, steps=2) for c in (nocache, cached)]
    plan = runs[1].placement
    assert plan is not None
    # host_kept also holds the gradient shards the host budget keeps (grad_device auto)
    assert sum(plan.specs[k].nbytes for k in plan.host_kept
               if plan.specs[k].cls == "param") == kept
    step0, step1 = runs[0].steps[-1], runs[1].steps[-1]
    written = [sum(t.nvme_written for t in s.values()) for s in (step0, step1)]
    # one param write per shard per step. (Reads are not compared: which step the CPU
    # Adam's read-ahead of optimizer state lands in depends on thread timing, +-0.3 MB.)
    assert written[0] - written[1] == kept


def _big() -> Any:
    from cli_helpers import BIG
    return BIG


def test_plan_cli_max_in_cpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`tierzero plan --max-in-cpu` puts that much param of the nvme choice in the host
    row and writes the key into the recommended config when nvme is chosen."""
    from cli_helpers import MACHINE, plan_cli
    args = ["--model", "builtin:tiny", *MACHINE, "--nvme-path", str(tmp_path)]
    code, plain, _ = plan_cli(args, capsys)
    assert code == 0
    code, cached, _ = plan_cli([*args, "--max-in-cpu", "100KB"], capsys)
    assert code == 0

    def nvme_host_row(text: str) -> list[str]:
        lines = text.splitlines()
        start = next(i for i, ln in enumerate(lines) if ln.startswith("nvme "))
        return lines[start + 1].split()  # the nvme choice's host row: tier, classes...

    assert nvme_host_row(plain)[1] in ("0", "0 B")  # no param on host without it
    assert nvme_host_row(cached)[1] not in ("0", "0 B")
