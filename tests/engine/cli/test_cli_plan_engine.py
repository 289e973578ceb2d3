"""The plan is the engine: the dry run's counted bytes equal a real run's counters, its
placement equals the table's, and a 70B Llama plans end to end on this machine."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_helpers import BIG, real_steps
from engine_dist import run_two_ranks

from tierzero import engine
from tierzero.engine.models import SIZES, TinyLM
from tierzero.engine.plan import (
    DryRun,
    ModelShape,
    Traffic,
    dry_run,
    engine_config,
    model_shape,
    plan_all,
)
from tierzero.engine.plan.planner import plan_choice
from tierzero.engine.shards.state_layout import DRY_PIECES
from tierzero.engine.shards.tiered import TieredShardStore


def nvme_config(swap_dir: Path, **offload: Any) -> engine.Config:
    return engine.load_config({"zero": {"stage": 3}, "precision": "bf16",
                               "gradient_clipping": 0.0,
                               "offload": {"device": "nvme", "path": str(swap_dir), **offload}})


def _rank_steps(_rank: int, swap_dir: str) -> list[Traffic]:
    return real_steps(nvme_config(Path(swap_dir), buffer_count=64), steps=3)


@pytest.mark.multiproc
def test_dry_run_world_two_equals_each_rank(tmp_path: Path) -> None:
    """Two gloo ranks really training, each counting its own swap and tier traffic, against
    the dry run of rank 0 of two (DryComm): every rank moves what the plan says."""
    config = nvme_config(tmp_path, buffer_count=64)
    with torch.device("meta"):
        module = TinyLM(SIZES["tiny"])
    dry = dry_run(module, config, world_size=2, steps=3)
    ranks = run_two_ranks(tmp_path, {"steps": partial(_rank_steps, swap_dir=str(tmp_path))})
    for r in ranks:
        assert_matches(r["steps"], dry, 3)
    one = dry_run(TinyLM(SIZES["tiny"]).to("meta"), config, steps=3)
    assert dry.step().nvme_written < one.step().nvme_written  # each rank holds half


def manager_part(run: DryRun, step: int) -> Traffic:
    """The dry run's step with only what the real counters see (no CPU Adam elements, no
    gradient copies: on a CPU-only machine the "device" is host memory, so the reduce
    path's copy to the host gradient shard is not a transfer)."""
    t = run.step(step)
    return Traffic(nvme_read=t.nvme_read, nvme_written=t.nvme_written,
                   host_to_device=t.host_to_device, device_to_host=t.device_to_host)


def assert_matches(real: list[Traffic], dry: DryRun, steps: int) -> None:
    """Writes and host->device copies equal step by step. Reads equal in total up to the
    read-ahead: the CPU Adam starts reading the next step's state as ring space frees,
    which in a real run depends on how fast its writes land (in the dry run at once), so
    which step a read is counted in moves, by at most one step's NVMe bytes (measured over
    10 steps: cumulative reads of real and dry runs stay within 1.3 MB of each other; a
    step reads 1.75 MB)."""
    plan = [manager_part(dry, i) for i in range(steps)]
    assert [(r.nvme_written, r.host_to_device, r.device_to_host) for r in real] == [
        (d.nvme_written, d.host_to_device, d.device_to_host) for d in plan]
    window = plan[-1].nvme_written  # every NVMe-homed byte is written (and read) once a step
    got = want = 0
    for r, d in zip(real, plan, strict=True):
        got, want = got + r.nvme_read, want + d.nvme_read
        assert abs(got - want) <= window, (got, want, window)


def test_dry_run_bytes_equal_a_real_run(tmp_path: Path) -> None:
    """A staging pool with room for every NVMe shard: no eviction depends on how fast a
    transfer lands, so the dry run must match the real run's counters (see
    assert_matches for the one timing-dependent part)."""
    config = nvme_config(tmp_path, buffer_count=64)
    with torch.device("meta"):
        module = TinyLM(SIZES["tiny"])
    dry = dry_run(module, config, steps=3)
    real = real_steps(config, steps=3)
    assert_matches(real, dry, 3)
    # sanity: the step moves something on every path the tiers have on a CPU, where params
    # are gathered from host memory ([Note: params gathered from host memory])
    assert real[-1].nvme_read > 0 and real[-1].nvme_written > 0
    assert real[-1].host_to_device == 0
    assert dry.step().adam_params > 0


@pytest.mark.parametrize("persist", [0, None])
def test_dry_run_counts_a_clipped_run_s_deferred_update(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persist: int | None) -> None:
    """Clipping on, speculation off: a real run defers each step's update into the next
    forward ([Note: deferred streamed step]), each group's right before its gather
    (`persist` None: the units are small enough to stay gathered, so right after the
    step, [Note: persistent units after the step]; 0: none stays), and so does the dry
    run (on meta the clip factor is 1). The
    real run's groups are updated on the training thread here, as on a dry run (a worker
    running ahead would move which step a byte lands in); then the two count the same
    bytes (assert_matches)."""
    from tierzero.engine.step import deferred_stream

    zero: dict[str, Any] = {"stage": 3}
    if persist is not None:
        zero["persistence_threshold_bytes"] = persist
    config = engine.load_config({
        "zero": zero,
        "precision": "bf16", "gradient_clipping": 1.0,
        "offload": {"device": "nvme", "path": str(tmp_path), "buffer_count": 64,
                    "optimizer": {"speculate_step": False}}})
    with torch.device("meta"):
        module = TinyLM(SIZES["tiny"])
    dry = dry_run(module, config, steps=3)
    real_init = deferred_stream.DeferredStream.__init__

    def no_worker(self: Any, *args: Any, **kw: Any) -> None:
        real_init(self, *args, **{**kw, "worker": False})

    monkeypatch.setattr(deferred_stream.DeferredStream, "__init__", no_worker)
    real = real_steps(config, steps=3)
    assert_matches(real, dry, 3)


def test_dry_run_in_coarse_pieces_counts_a_chunked_real_run(tmp_path: Path) -> None:
    """State kept in many small pieces (chunk_numel 2048: every block's shard is cut):
    the dry run cuts each shard into at most DRY_PIECES pieces instead ([Note: dry-run
    pieces]), and still counts the real run's bytes, and reports the real run's CPU Adam
    buffers (ring and param assembly), not its own coarser ring's."""
    config = nvme_config(tmp_path, buffer_count=64, chunk_numel=2048)
    with torch.device("meta"):
        module = TinyLM(SIZES["tiny"])
    dry = dry_run(module, config, steps=3)
    real = real_steps(config, steps=3)
    assert_matches(real, dry, 3)
    torch.manual_seed(0)
    eng, *_ = engine.initialize(model=TinyLM(SIZES["tiny"]), config=config)
    try:
        store = eng.store
        assert isinstance(store, TieredShardStore) and not store.layout.coarse
        many = [k for k in store.group_keys() if len(store.pieces(k, "master")) > DRY_PIECES]
        assert many, "the model must have shards in more pieces than a dry run keeps"
        eng.backward(eng(input_ids=torch.randint(0, 256, (2, 32))).logits.float().mean())
        eng.step()
        report = store.manager.memory_report()  # type: ignore[union-attr]
        assert dry.pipeline_bytes == store.layout.pipeline_bytes() == report.outside_peak
    finally:
        eng.close()


def test_dry_run_under_pool_pressure_writes_equal(tmp_path: Path) -> None:
    """With the default pool, which host caches survive to the optimizer depends on how
    fast transfers land (a cache still loading cannot be evicted), so re-reads differ
    run to run; the write-backs do not: every NVMe-homed shard is written once a step."""
    config = nvme_config(tmp_path)
    with torch.device("meta"):
        module = TinyLM(SIZES["tiny"])
    dry = dry_run(module, config, steps=3)
    real = real_steps(config, steps=3)
    assert [r.nvme_written for r in real] == [dry.step(i).nvme_written for i in range(3)]
    assert [r.host_to_device for r in real] == [dry.step(i).host_to_device for i in range(3)]
    # both read every state shard (master, two moments: 12 bytes per element) at least
    # once a step for the CPU Adam, counted over the run (a read-ahead may be counted in
    # the step before)
    states = 12 * dry.step().adam_params
    assert sum(dry.step(i).nvme_read for i in range(3)) >= 3 * states
    assert sum(r.nvme_read for r in real) >= 3 * states


def test_dry_run_placement_is_the_tables(tmp_path: Path) -> None:
    """The table (the engine's store declared and finalized) and the dry run's running
    engine place the same bytes per tier and class."""
    shape = model_shape("builtin:tiny")
    for choice in ("cpu", "nvme", "auto"):
        table = plan_choice(shape, choice, BIG, world_size=1, precision="bf16",
                            nvme_path=str(tmp_path))
        config = engine_config(choice, BIG, precision="bf16", nvme_path=str(tmp_path))
        run = dry_run(shape.fresh_module(), config, steps=1)
        assert run.placement is not None
        placed: dict[str, dict[str, int]] = {t: {} for t in ("device", "host", "nvme")}
        for key, spec in run.placement.specs.items():
            tier = placed[run.placement.homes[key]]
            tier[spec.cls] = tier.get(spec.cls, 0) + spec.nbytes
        assert {t: {c: n for c, n in v.items() if n} for t, v in table.by_tier.items()} == placed
        assert table.overhead["device"] == run.placement.device_reserve


def test_world_size_two_halves_every_shard(tmp_path: Path) -> None:
    shape = model_shape("1e9", layers=8)
    one, two = (
        {p.choice: p for p in plan_all(shape, BIG, world_size=w, precision="bf16",
                                       nvme_path=str(tmp_path))} for w in (1, 2))
    # each rank writes its half of every NVMe shard (shards are padded per rank to 128)
    assert two["nvme"].nvme_written == pytest.approx(one["nvme"].nvme_written / 2, rel=1e-5)
    assert two["cpu"].adam_params == pytest.approx(one["cpu"].adam_params / 2, rel=1e-5)
    # with several ranks the reduced fp32 shard (4 bytes per own element) goes to the host
    assert two["cpu"].traffic.grads_to_host == 4 * two["cpu"].adam_params


@pytest.mark.cuda
def test_dry_run_bytes_equal_a_real_cuda_run(tmp_path: Path) -> None:
    """On a GPU the device tier is CUDA memory and host->device copies are real PCIe
    transfers: the dry run (meta) planning a CUDA machine counts the same bytes as the real
    run."""
    config = nvme_config(tmp_path, buffer_count=64)
    with torch.device("meta"):
        module = TinyLM(SIZES["tiny"])
    dry = dry_run(module, config, steps=3, device_is_host=False)  # planning a CUDA machine
    real = real_steps(config, steps=3)
    assert all(d.host_to_device > 0 for d in (manager_part(dry, i) for i in range(3)))
    assert_matches(real, dry, 3)


class NeedsValues(torch.nn.Module):
    """A forward that reads a value (data-dependent control flow): not on meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(2))

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        x = input_ids.unsqueeze(-1).float().expand(*input_ids.shape, 64)
        for b in self.blocks:
            x = b(x)
            if x.sum().item() > 0:  # a real value
                x = -x
        return (x,)


def test_dry_run_failure_is_reported_not_fatal(tmp_path: Path) -> None:
    with torch.device("meta"):
        module = NeedsValues()
    shape = ModelShape("needs-values", (("blocks.0", 64 * 65), ("blocks.1", 64 * 65)), module)
    plans = {p.choice: p for p in plan_all(shape, BIG, world_size=1, precision="bf16",
                                           nvme_path=str(tmp_path))}
    cpu = plans["cpu"]
    assert cpu.fits and cpu.by_tier["host"]["master"] > 0  # the placement still holds
    assert cpu.step_s is None and "item" in (cpu.traffic_error or "").lower()


@pytest.mark.parametrize(("clip", "precision", "early"), [
    (0.0, "bf16", True), (1.0, "bf16", False), (0.0, "fp16", False)])
def test_dry_config_keeps_the_step_where_the_real_run_has_it(
        tmp_path: Path, clip: float, precision: str, early: bool) -> None:
    """Clipping and fp16 need every gradient before the step (the real run then defers it
    into the next forward); the dry run runs fp16 as bf16 with clipping on (on meta the
    clip factor is 1), so it defers the step as the real run does, never begins it early."""
    from tierzero.engine.plan.dry_run import dry_config
    config = engine.load_config({"zero": {"stage": 3}, "precision": precision,
                                 "gradient_clipping": clip,
                                 "offload": {"device": "nvme", "path": str(tmp_path)}})
    assert config.offload.optimizer.overlap_step
    dry = dry_config(config)
    assert dry.precision.dtype == "bf16" and dry.offload.optimizer.overlap_step
    assert (dry.gradient_clipping > 0) is not early
