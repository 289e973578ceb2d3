"""`tierzero plan`'s table of offload.optimizer.state_precision choices.

The dry run counts the step with fp32 moments (the default). Every compressed choice
changes exactly one thing ([Note: 8-bit moment codes] in offload/state_codec.py): the
bytes of exp_avg and exp_avg_sq on their home tier, and so, where that home is NVMe,
the bytes the step reads and writes for them (each moment is read once and written once
per step by the CPU Adam stream). The rows scale the counted fp32 numbers by that;
nothing else moves differently. No choice is recommended: compressed moments change
the numbers a run computes, so they are the user's to allow (set the key).
"""

from __future__ import annotations

from dataclasses import dataclass

from tierzero.engine.plan.planner import ChoicePlan
from tierzero.offload.state_codec import STATE_PRECISIONS, bytes_per_param


@dataclass(frozen=True)
class PrecisionRow:
    choice: str  # the offload choice (cpu, nvme, auto)
    precision: str  # fp32, bf16, int8
    bytes_per_param: float  # both moments, on their home tier
    moments: int  # bytes of both moments (this rank)
    moments_tier: str  # where they live: "host", "nvme" or "host+nvme"
    nvme_read: int  # per step
    nvme_written: int  # per step

    @property
    def written_per_1000(self) -> int:
        return 1000 * self.nvme_written


def precision_rows(plans: list[ChoicePlan]) -> list[PrecisionRow]:
    """One row per (fitting choice that runs the CPU Adam, state precision)."""
    rows: list[PrecisionRow] = []
    for p in plans:
        if not p.fits or p.choice == "none" or p.traffic_error or not p.phases:
            continue
        tiers = {t: p.by_tier.get(t, {}).get("exp_avg", 0) + p.by_tier.get(t, {}).get(
            "exp_avg_sq", 0) for t in ("host", "nvme")}
        fp32 = sum(tiers.values())
        if not fp32:
            continue
        where = "+".join(t for t in ("host", "nvme") if tiers[t])
        for prec in STATE_PRECISIONS:
            ratio = bytes_per_param(prec) / bytes_per_param("fp32")
            saved = int(tiers["nvme"] * (1 - ratio))  # read once and written once per step
            rows.append(PrecisionRow(p.choice, prec, bytes_per_param(prec), int(fp32 * ratio),
                                     where, p.nvme_read - saved, p.nvme_written - saved))
    return rows
