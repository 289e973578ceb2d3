"""What `ZeroEngine.memory_report()` and `optimizer_times()` return."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from tierzero.engine.engine import ZeroEngine


class OptimizerTimes(NamedTuple):
    """Cumulative seconds of the optimizer's work beside the training thread."""

    hidden_s: float  # worker seconds that ran while the training thread computed
    worker_s: float  # every second the optimizer's worker thread ran (hidden or waited for)
    update_wait_s: float  # forward's waits for a unit's deferred update ([Note: deferred step])


def memory_report(eng: ZeroEngine) -> dict[str, Any]:
    """Bytes on this rank, from element counts: shards by kind, gathered params now and at
    peak, and what the unpartitioned model would hold; with them the counters a reader of
    the memory wants beside (late gradients, reductions in flight, skipped steps, the
    tiers' report, the optimizer pipeline's statistics)."""
    shards = eng.store.nbytes()
    full_params = sum(g.numel for u in eng.units for g in u.groups) * (
        torch.finfo(eng.dtype).bits // 8)
    return {
        "rank": eng.comm.rank,
        "world_size": eng.comm.world_size,
        "shard_bytes": shards,
        # the gradient shards' dtype ([Note: gradient precision])
        "grad_dtype": str(eng.store.grad_dtype).removeprefix("torch."),
        # how bf16/fp16 matrix products are computed ([Note: low-precision matmul on CPU])
        "cpu_matmul": "fp32" if eng.upcast_matmul else "native",
        "shard_bytes_total": sum(shards.values()),
        "gathered_bytes": eng.scheduler.gathered_bytes(),
        "gathered_peak_bytes": eng.scheduler.gathered_peak_bytes,
        "full_model_param_bytes": full_params,
        "units": len(eng.units),
        "persistent_units": sum(u.persistent for u in eng.units),
        "trace_changes": eng.scheduler.trace_changes,
        # gradients that arrived after their group was reduced ([Note: late gradients])
        "late_gradients": eng.scheduler.late.arrivals,
        "reductions_in_flight_peak": eng.scheduler.inflight_peak,
        "units_kept_for_backward": eng.scheduler.kept,  # [Note: reuse distance]
        # fp32 gradient sums of a layer-major pass held at once ([Note: layer-major
        # schedule]): the root's groups and the unit in backward
        "layer_major_accum_peak_bytes": eng.scheduler.sums.peak_bytes,
        # where its unit-boundary tensors waited ([Note: boundary tensors])
        "layer_major_boundary": eng.scheduler.boundary_stats.as_dict(),
        "loss_scale": eng.loss_scaler.scale if eng.loss_scaler else None,
        "skipped_steps": eng.skipped_steps,
        # offload: the tier manager's bytes per tier, peaks, moved bytes (None: no offload)
        "tiers": eng.store.tier_report(),
        "activations_to_host": dataclasses.asdict(eng.activation_stats),
        "optimizer_step": eng.step_driver.stats(),
    }


def wall_counters(eng: ZeroEngine) -> dict[str, float]:
    """Cumulative seconds the wall-clock log reports per step (logging.wall_clock_breakdown)."""
    times = eng.optimizer_times()
    stall = (eng.store.tier_report() or {}).get("stall_s", 0.0)
    return {"gathers": eng.scheduler.gather_s, "deferred-update waits": times.update_wait_s,
            "optimizer hidden": times.hidden_s,
            "io stall": float(stall) if isinstance(stall, (int, float)) else 0.0}
