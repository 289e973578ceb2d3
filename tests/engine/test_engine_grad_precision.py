"""Gradient shards in the compute dtype where that is exact ([Note: gradient precision] in
engine/shards/grad_precision.py): world size 1, no accumulation, bf16 or fp16 compute.

Every run here is compared with the same run forced to fp32 gradient shards
(precision.grad_dtype fp32): the upcast is exact, so losses and parameters are equal bit
for bit (torch.equal), while the gradient shards hold, and NVMe moves, half the bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_dist import run_two_ranks
from engine_helpers import full_params, make_batches, make_config, make_model
from lategrad_helpers import make_shared_model

from tierzero import engine
from tierzero.engine.checkpoint.layout import CheckpointError
from tierzero.engine.config import Config, LossScaleConfig
from tierzero.engine.config.schema import (
    BatchConfig,
    BudgetsConfig,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)
from tierzero.engine.shards.grad_precision import grad_dtype
from tierzero.engine.shards.store import ShardStore
from tierzero.engine.step import precision
from tierzero.engine.step.precision import NORM_BLOCK, grad_stat

STEPS = 4


def configure(precision: str = "bf16", *, offload: str = "none", path: Path | None = None,
              grad: str = "auto", clip: float = 0.5, state: str = "fp32", gas: int = 1,
              overlap_step: bool = True, loss_scale: LossScaleConfig | None = None) -> Config:
    """make_config with params and optimizer state offloaded to `offload` (gradients on NVMe
    with nvme, a device budget below the param shards so caches are evicted) and the
    gradient shards' dtype `grad` (precision.grad_dtype)."""
    cfg = make_config(precision, gas=gas, clip=clip)
    prec = dataclasses.replace(cfg.precision, grad_dtype=grad,  # type: ignore[arg-type]
                               loss_scale=loss_scale or cfg.precision.loss_scale)
    cfg = dataclasses.replace(cfg, precision=prec)
    if offload == "none":
        return cfg
    where = str(path) if offload == "nvme" else None
    return dataclasses.replace(cfg, offload=OffloadConfig(
        params=ParamOffloadConfig(device=offload, path=where),  # type: ignore[arg-type]
        optimizer=OptimizerOffloadConfig(
            device=offload, path=where,  # type: ignore[arg-type]
            grad_device=offload if offload != "none" else "auto",  # type: ignore[arg-type]
            state_precision=state,  # type: ignore[arg-type]
            overlap_step=overlap_step),
        budgets=BudgetsConfig(device_bytes=64 << 10)))


def train(cfg: Config, steps: int = STEPS, *, overflow_at: int | None = None,
          ckpt_at: int | None = None, ckpt_dir: Path | None = None,
          resume_cfg: Config | None = None) -> dict[str, Any]:
    """`steps` optimizer steps of make_model() on make_batches(steps): losses, parameters,
    memory_report(). `overflow_at`: that step's loss times 1e9 (an fp16 overflow skips it).
    `ckpt_at`: after that many steps save, close, and go on in a fresh engine built with
    `resume_cfg` (default `cfg`) that loads the checkpoint."""
    gas = cfg.batch.gradient_accumulation_steps or 1
    batches = make_batches(steps * gas)
    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    losses = []
    for i in range(steps):
        if ckpt_at is not None and i == ckpt_at:
            assert ckpt_dir is not None
            eng.save_checkpoint(ckpt_dir)
            eng.close()
            model = make_model(seed=7)  # other initial values: the checkpoint restores them
            eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                             config=resume_cfg or cfg)
            eng.load_checkpoint(ckpt_dir)
        for ids, tg in batches[i * gas:(i + 1) * gas]:
            loss = eng(ids, tg)
            eng.backward(loss * 1e9 if i == overflow_at else loss)
            eng.step()
            losses.append(float(loss.detach()))
    out = {"losses": losses, "params": full_params(eng, model), "report": eng.memory_report()}
    eng.close()
    return out


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["losses"] == want["losses"]
    for k, v in want["params"].items():
        assert torch.equal(got["params"][k], v), k


def nvme_grad_bytes(report: dict[str, Any]) -> tuple[int, int]:
    """(read, written) NVMe bytes of the gradient class over the run."""
    moved = report["tiers"]["moved_by_class"]
    return moved["nvme_to_host"].get("grad", 0), moved["host_to_nvme"].get("grad", 0)


# -- the decision -----------------------------------------------------------------------
@pytest.mark.parametrize(("case", "want"), [
    (("bf16", 1, 1, "auto", "auto"), torch.bfloat16),
    (("fp16", 1, 1, "auto", "auto"), torch.float16),
    (("bf16", 1, 1, "micro_step", "auto"), torch.bfloat16),
    (("fp32", 1, 1, "auto", "auto"), torch.float32),  # nothing to save
    (("bf16", 2, 1, "auto", "auto"), torch.float32),  # the reduce-scatter averages in fp32
    (("bf16", 1, 2, "auto", "auto"), torch.float32),  # accumulation sums in fp32
    (("bf16", 1, 1, "layer_major", "auto"), torch.float32),  # its sums are fp32
    (("bf16", 1, 1, "auto", "fp32"), torch.float32),  # forced
])
def test_gradient_dtype_is_the_compute_dtype_only_where_exact(
        case: tuple[str, int, int, str, str], want: torch.dtype) -> None:
    """case: (precision.dtype, world size, accumulation, batch.schedule, grad_dtype)."""
    precision, world, gas, schedule, grad = case
    cfg = configure(precision, grad=grad, gas=gas)
    cfg = dataclasses.replace(cfg, batch=BatchConfig(gradient_accumulation_steps=gas,
                                                     schedule=schedule))  # type: ignore[arg-type]
    assert grad_dtype(cfg, world) == want


def _shard(values: torch.Tensor, kind: torch.dtype) -> ShardStore:
    """A store holding `values` as the gradient shard "g", kept in `kind`."""
    store = ShardStore(torch.device("cpu"), kind)
    store.add("g", torch.zeros(values.numel()), values.dtype, True)
    store.tensor("g", "grad").copy_(values)
    return store


def test_grad_stat_of_a_compute_dtype_shard_is_the_fp32_shards_bit_for_bit() -> None:
    """The norm of a bf16 / fp16 shard is taken over its exact upcast, in the blocks an
    fp32 shard is measured in: the same float as the fp32 shard's (not a norm accumulated
    in the narrow dtype), for shards of one block, several and a ragged last one; inf is
    seen as inf."""
    gen = torch.Generator().manual_seed(0)
    for n in (100_003, 2 * NORM_BLOCK, 3 * NORM_BLOCK + 129):
        for dtype in (torch.bfloat16, torch.float16):
            values = (torch.randn(n, generator=gen) * 3).to(dtype)
            stats = []
            for kind in (dtype, torch.float32):
                store = _shard(values, kind)
                stats.append(grad_stat(store, "g"))
                store.tensor("g", "grad")[n - 17] = float("inf")
                assert not grad_stat(store, "g").finite
            assert stats[0] == stats[1] and stats[0].finite
            assert stats[0].sq_norm > 0


def test_grad_stat_is_accurate_on_a_large_shard_and_independent_of_the_thread_count() -> None:
    """[Note: the gradient norm in blocks]: on 4M elements torch's one-call fp32 norm is
    off by about 6e-5 (relative; its error grows with the shard); the blocked squared norm
    is within 1e-6 of the float64 sum of squares of the same values, the same float with
    1 and 2 torch threads, and the sum of the blocks' norms taken one block at a time.
    The device form (a (rows, NORM_BLOCK) view normed by row, run here on the CPU) is
    within the same bound."""
    values = (torch.randn(4 * 1024 * 1024 + 256, generator=torch.Generator().manual_seed(2))
              * 0.01).bfloat16()
    exact = float(values.double().square().sum())
    store = _shard(values, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        stats = []
        for n in (1, 2):
            torch.set_num_threads(n)
            stats.append(grad_stat(store, "g"))
    finally:
        torch.set_num_threads(threads)
    assert stats[0] == stats[1]
    assert abs(stats[0].sq_norm - exact) <= 1e-6 * exact
    # the blocks normed several to a call are each the float of that block alone
    one_by_one = 0.0
    for lo in range(0, values.numel(), NORM_BLOCK):
        norm = float(torch.linalg.vector_norm(values[lo:lo + NORM_BLOCK].float()))
        one_by_one += norm * norm
    assert stats[0].sq_norm == one_by_one
    device = precision._sq_norm_device(values)  # the GPU path, run on the CPU
    assert abs(device - exact) <= 1e-6 * exact


def test_grad_stat_sees_finite_values_whose_squares_overflow_fp32() -> None:
    """A block of finite values whose fp32 norm overflows: the squared norm is inf, but
    every element is finite, so the step is not skipped as an overflow."""
    values = torch.full((NORM_BLOCK + 5,), 1e30)
    stat = grad_stat(_shard(values, torch.float32), "g")
    assert math.isinf(stat.sq_norm) and stat.finite
    values[3] = float("nan")
    assert not grad_stat(_shard(values, torch.float32), "g").finite


# -- bit-identical runs -----------------------------------------------------------------
@pytest.mark.parametrize(("offload", "state"), [
    ("none", "fp32"), ("cpu", "fp32"), ("cpu", "int8"), ("nvme", "fp32"), ("nvme", "int8")])
def test_bf16_gradients_train_bitwise_as_fp32_gradients(
        tmp_path: Path, offload: str, state: str, caplog: pytest.LogCaptureFixture) -> None:
    """Clipping on (the norm is measured on the 2-byte shards): offload none (torch AdamW
    over device-resident state, given fp32 copies), cpu (the in-place CPU Adam, deferred
    into the next forward), nvme (the streamed CPU Adam; gradients written down during
    backward and read back), fp32 and int8 moments."""
    runs = {}
    for grad in ("auto", "fp32"):
        sub = tmp_path / grad
        sub.mkdir()
        runs[grad] = train(configure(offload=offload, path=sub, grad=grad, state=state))
    assert_same(runs["auto"], runs["fp32"])
    assert "second contribution" not in caplog.text  # one reduction per group and step
    low, full = runs["auto"]["report"], runs["fp32"]["report"]
    assert (low["grad_dtype"], full["grad_dtype"]) == ("bfloat16", "float32")
    assert 2 * low["shard_bytes"]["grad"] == full["shard_bytes"]["grad"] > 0
    if offload != "none":
        assert (2 * low["tiers"]["homes"]["grad"][{"cpu": "host", "nvme": "nvme"}[offload]]
                == full["tiers"]["homes"]["grad"][{"cpu": "host", "nvme": "nvme"}[offload]])
    if offload == "nvme":  # clipping keeps each gradient past backward: written down
        # under pool pressure and read back for the update, at most half the bytes (a
        # 2-byte gradient takes one staging buffer where an fp32 one takes two, so fewer
        # are evicted). The 2-byte run may read none back: which of its gradients are
        # still cached when the update comes depends on when each write-behind ran.
        read, written = nvme_grad_bytes(low)
        full_read, full_written = nvme_grad_bytes(full)
        assert 2 * read <= full_read and 0 < 2 * written <= full_written
        assert full_read > 0


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_fp16_gradients_with_an_overflow_step_train_bitwise_as_fp32_gradients(
        tmp_path: Path, offload: str) -> None:
    """fp16 loss scaling: the overflow check reads the 2-byte shards, the step after the
    skipped one unscales them in the update, clipping on."""
    scale = LossScaleConfig(initial_scale_power=12, hysteresis=1)
    runs = {}
    for grad in ("auto", "fp32"):
        sub = tmp_path / grad
        sub.mkdir()
        runs[grad] = train(configure("fp16", offload=offload, path=sub, grad=grad,
                                     loss_scale=scale), overflow_at=1)
    assert_same(runs["auto"], runs["fp32"])
    low = runs["auto"]["report"]
    assert low["grad_dtype"] == "float16"
    assert low["skipped_steps"] == 1 and runs["fp32"]["report"]["skipped_steps"] == 1
    assert low["loss_scale"] == runs["fp32"]["report"]["loss_scale"] == 2.0 ** 11


def test_unclipped_nvme_step_during_backward_trains_bitwise(tmp_path: Path) -> None:
    """No clipping: each 2-byte gradient is consumed by the streamed update during
    backward, never written to NVMe."""
    runs = {}
    for grad in ("auto", "fp32"):
        sub = tmp_path / grad
        sub.mkdir()
        runs[grad] = train(configure(offload="nvme", path=sub, grad=grad, clip=0.0))
    assert_same(runs["auto"], runs["fp32"])
    assert runs["auto"]["report"]["grad_dtype"] == "bfloat16"


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_resume_from_a_checkpoint_trains_bitwise(tmp_path: Path, offload: str) -> None:
    """Saved after 2 steps with 2-byte gradients, loaded into a fresh engine: the run goes
    on as an uninterrupted fp32-gradient run; a checkpoint saved with fp32 gradient shards
    (an older run's) loads into a 2-byte engine the same."""
    (tmp_path / "ref").mkdir()
    want = train(configure(offload=offload, path=tmp_path / "ref", grad="fp32"))
    for saver in ("auto", "fp32"):
        sub = tmp_path / saver
        sub.mkdir()
        got = train(configure(offload=offload, path=sub, grad=saver), ckpt_at=2,
                    ckpt_dir=sub / "ckpt", resume_cfg=configure(offload=offload, path=sub))
        assert got["report"]["grad_dtype"] == "bfloat16"
        assert_same(got, want)


def test_a_mid_accumulation_checkpoint_does_not_load_into_2_byte_gradients(
        tmp_path: Path) -> None:
    """A checkpoint saved mid-accumulation holds partial fp32 gradients, which a 2-byte
    shard would round: the error says so and names the fixes."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=configure(gas=2))
    ids, tg = make_batches(1)[0]
    eng.backward(eng(ids, tg))
    eng.step()  # micro-step 1 of 2
    eng.save_checkpoint(tmp_path / "ckpt")
    eng.close()
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=configure())
    try:
        with pytest.raises(CheckpointError, match=r"mid-accumulation.*grad_dtype: fp32"):
            eng.load_checkpoint(tmp_path / "ckpt")
    finally:
        eng.close()


# -- where it does not apply: fp32 shards ----------------------------------------------
@pytest.mark.parametrize(("precision", "gas"), [("bf16", 2), ("fp32", 1)])
def test_accumulation_and_fp32_compute_keep_fp32_gradients(
        tmp_path: Path, precision: str, gas: int) -> None:
    got = train(configure(precision, offload="nvme", path=tmp_path, gas=gas), steps=2)
    report = got["report"]
    assert report["grad_dtype"] == "float32"
    numel = report["shard_bytes"]["master"] // 4
    assert report["shard_bytes"]["grad"] == 4 * numel


def _two_rank_grad_dtype(rank: int) -> tuple[str, int, int]:
    del rank
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=configure())
    ids, tg = make_batches(1)[0]
    eng.backward(eng(ids, tg))
    eng.step()
    report = eng.memory_report()
    eng.close()
    return report["grad_dtype"], report["shard_bytes"]["grad"], report["shard_bytes"]["master"]


@pytest.mark.multiproc
def test_two_ranks_keep_fp32_gradients(tmp_path: Path) -> None:
    for result in run_two_ranks(tmp_path, {"run": _two_rank_grad_dtype}):
        dtype, grad, master = result["run"]
        assert dtype == "float32" and grad == master > 0


def test_a_second_contribution_in_a_step_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """Late gradients (reentrant segments sharing parameters) add into a shard after its
    reduction: in the compute dtype here, which the store says once."""
    cfg = configure(clip=0.0)
    eng, _, _, _ = engine.initialize(device="cpu", model=make_shared_model(), config=cfg)
    with caplog.at_level(logging.WARNING, logger="tierzero.engine.shards.store"):
        for ids, tg in make_batches(2):
            eng.backward(eng(ids, tg))
            eng.step()
    late = eng.memory_report()["late_gradients"]
    eng.close()
    assert late > 0
    assert caplog.text.count("second contribution") == 1
    assert "precision.grad_dtype: fp32" in caplog.text
