"""`tierzero plan`'s table of offload.optimizer.state_precision choices.

A compressed choice changes one thing ([Note: 8-bit moment codes] in
offload/state_codec.py): the bytes of exp_avg and exp_avg_sq on their home tier, and so,
where that home is NVMe, the bytes the step reads and writes for them (each moment is read
once and written once per step by the CPU Adam stream). Its bytes can also change where
things go: moments that only fit in host memory compressed are placed there.

So each row has its own placement, by the engine's placement code with that precision's
moment sizes (state_codec.moment_nbytes, as the shard store declares them). The run's own
precision (`tierzero plan --state-precision`, default fp32) is the one whose step the dry
run counts; another precision's NVMe bytes are that count with the moments' NVMe bytes
exchanged, which holds when every other class sits where it sits in the counted plan
(otherwise the row leaves them out). No compressed choice is recommended unless the user
set it: compressed moments change the numbers a run computes.

Each counted row also gets a predicted step ([Note: plan step time] in planner.py): the
counted step's phases with the moments' NVMe bytes exchanged in the phase where the CPU
Adam runs (it reads and writes them there), timed by that layout's CPU Adam rate as
`tierzero bench` measured it (Machine.adam_rates): compressed moments move fewer bytes
but cost the CPU more per element, so on a machine whose drive is fast next to its cores
the smaller row need not be the faster one.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierzero.engine.bench.measure import adam_state_key
from tierzero.engine.plan.dry_run import Traffic
from tierzero.engine.plan.planner import ChoicePlan, Machine, plan_choice, step_time
from tierzero.engine.plan.shapes import ModelShape
from tierzero.offload.settings import MOMENT_CLASSES, TENSOR_CLASSES, TIERS
from tierzero.offload.state_codec import STATE_PRECISIONS, bytes_per_param


@dataclass(frozen=True)
class PrecisionRow:
    choice: str  # the offload choice (cpu, nvme, auto)
    precision: str  # fp32, bf16, int8
    bytes_per_param: float  # both moments, on their home tier
    fits: bool  # this precision's placement fits the machine
    moments: int  # bytes of both moments (this rank); 0 when it does not fit
    moments_tier: str  # where they live: "host", "nvme", "host+nvme"; "-" when it does not fit
    nvme_read: int | None  # per step; None: not counted (see the module docstring)
    nvme_written: int | None  # per step
    step_s: float | None = None  # predicted step; None: not counted, or a speed unknown

    @property
    def written_per_1000(self) -> int | None:
        return None if self.nvme_written is None else 1000 * self.nvme_written


def _moments_on(p: ChoicePlan) -> dict[str, int]:
    return {t: sum(p.by_tier.get(t, {}).get(c, 0) for c in MOMENT_CLASSES)
            for t in ("host", "nvme")}


def _same_homes_but_moments(a: ChoicePlan, b: ChoicePlan) -> bool:
    return all(a.by_tier.get(t, {}).get(c, 0) == b.by_tier.get(t, {}).get(c, 0)
               for t in TIERS for c in TENSOR_CLASSES if c not in MOMENT_CLASSES)


def precision_placements(shape: ModelShape, machine: Machine, plans: list[ChoicePlan], *,
                         world_size: int, precision: str, nvme_path: str | None,
                         max_in_cpu_bytes: int, chosen: str,
                         grad_accum: int = 1, master_precision: str = "fp32"
                         ) -> dict[tuple[str, str], ChoicePlan]:
    """The placement of every (choice that runs the CPU Adam, precision other than
    `chosen`): `plans` hold `chosen`'s (all with the run's `master_precision`)."""
    return {(p.choice, prec): plan_choice(shape, p.choice, machine, world_size=world_size,
                                          precision=precision, nvme_path=nvme_path,
                                          max_in_cpu_bytes=max_in_cpu_bytes,
                                          state_precision=prec, grad_accum=grad_accum,
                                          master_precision=master_precision)
            for p in plans if p.choice != "none" for prec in STATE_PRECISIONS if prec != chosen}


def precision_rows(plans: list[ChoicePlan], placements: dict[tuple[str, str], ChoicePlan],
                   chosen: str, machine: Machine | None = None, master: str = "fp32"
                   ) -> list[PrecisionRow]:
    """One row per (choice that runs the CPU Adam, state precision); `plans` are the
    counted plans of precision `chosen`, `placements` the others' (precision_placements);
    `machine`: the speeds that time each row's step, `master` the run's master_precision
    (the rows' layouts are its)."""
    rows: list[PrecisionRow] = []
    for p in plans:
        if p.choice == "none":
            continue
        counted = p.fits and not p.traffic_error and bool(p.phases)
        for prec in STATE_PRECISIONS:
            q = p if prec == chosen else placements.get((p.choice, prec))
            if q is None:
                continue
            if not q.fits:
                rows.append(PrecisionRow(p.choice, prec, bytes_per_param(prec), False, 0, "-",
                                         None, None))
                continue
            tiers = _moments_on(q)
            where = "+".join(t for t in ("host", "nvme") if tiers[t]) or "-"
            read = written = step = None
            if counted and (q is p or _same_homes_but_moments(p, q)):
                delta = tiers["nvme"] - _moments_on(p)["nvme"]  # read once, written once
                read, written = p.nvme_read + delta, p.nvme_written + delta
                if machine is not None:
                    step = _step(p, delta, machine, prec == chosen,
                                 machine.adam_rate(adam_state_key(prec, master)))
            rows.append(PrecisionRow(p.choice, prec, bytes_per_param(prec), True,
                                     sum(tiers.values()), where, read, written, step))
    return rows


def _step(p: ChoicePlan, delta: int, machine: Machine, own: bool, rate: float | None
          ) -> float | None:
    """The counted step `p` with `delta` more moment bytes read and written in the phase
    where the CPU Adam runs, timed by `rate` (the run's own row: the machine's rate, as the
    traffic table times it)."""
    if own:
        return p.step_s
    if rate is None:
        return None
    phases = dict(p.phases)
    adam = max(phases, key=lambda ph: phases[ph].adam_params)
    phases[adam] = phases[adam] + Traffic(nvme_read=delta, nvme_written=delta)
    return step_time(phases, machine, rate)
