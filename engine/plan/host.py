"""The host memory a run holds at its peak: `tierzero plan`'s predicted host peak.

[Note: plan host peak] The dry run (dry_run.py) counts what the tier manager holds; a
real run's resident memory holds more, and the plan adds it up per phase of the run,
each from what that phase really allocates (benchmarks/scale_bench.py measures the same
phases and splits them; RESULTS.md has the comparison). The figure is the peak RSS
growth over the process's imports, on one rank:

  build       the model as `tierzero train` builds it. With zero.stage 3 it builds
              under engine.Init: this rank's slice of every parameter (in host memory,
              or for offload.params.device nvme only the staging writes in flight) +
              zero.init_live_bytes of whole parameters being initialised
              (init_build_bytes). Otherwise every parameter and buffer materialised at
              its dtype (fp32 from a Hugging Face config.json).
  initialize  what the build holds (each flat group's tensors, or Init slices, are
              forgotten once the group is placed, so they and the homes placed so far
              overlap) + the tier
              manager's host bytes at the end of placement (and the CPU Adam ring
              when it is allocated by then) + one flat group's initial values being
              placed.
  train       the tier manager's host peak (shards homed or cached in host memory, the
              staging pool) + its device peak when the device tier is host memory (the
              CPU stand-in) + the CPU Adam stream's pipeline buffers (allocated by the
              engine outside the tier manager, counted against the same host budget)
              + the gathered units at their most (the root, the persistent units, the
              units kept for backward and the one being gathered: the scheduler's
              gathered_peak_bytes in the dry run, [Note: reuse distance] in reuse.py;
              the released buffers kept for the next gather stay within it: [Note:
              gather buffers kept for the next gather] in shards/spares.py; a unit
              whose gather views the staging pool's buffer is counted too, though its
              memory is the pool's, so the plan is over by up to two units' bytes
              there: [Note: a gather viewing the pool's buffer] in shards/lent.py)
              + the tensors autograd saves in one forward (counted on meta tensors by
              a saved-tensor hook; parameters excluded, they are the gathered copies
              above) + one unit's gradients in the compute dtype and their fp32 reduction
              (autograd's output before the reduce path copies it to the shard); for the
              root, one of its groups' (each is reduced as soon as its gradients are
              complete, the head's first in backward, the embedding's last). The
              gathered units, the saved tensors and the gradients are host memory only
              when the device tier is (no CUDA).

The peak is the largest phase. What no phase counts (the allocator's free lists, thread
stacks, torch's per-op scratch) is the residual the benchmark reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from tierzero.offload.settings import Tier

PHASES = ("build", "initialize", "train")


@dataclass(frozen=True)
class HostPeak:
    """Predicted RSS growth per phase of a run ([Note: plan host peak]), bytes per rank."""

    build: int
    initialize: int
    train: int
    parts: dict[str, int] = field(default_factory=dict)  # the terms, by name

    @property
    def peak(self) -> int:
        return max(self.build, self.initialize, self.train)

    @property
    def phase(self) -> str:
        return max(PHASES, key=lambda p: int(getattr(self, p)))

    def as_dict(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "peak": self.peak, "phase": self.phase}


def model_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer at its dtype (what building the model allocates;
    `module` may live on meta)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the tensors autograd saves for backward while active (meta tensors work:
    only shapes and dtypes are read). Parameters and their views are left out (the
    engine's gathered copies, counted by the tier manager); a tensor saved twice, or two
    views of one base, count once."""

    def __init__(self) -> None:
        self.nbytes = 0
        self._seen: dict[int, torch.Tensor] = {}  # id -> base, held so ids stay unique

        def pack(x: torch.Tensor) -> torch.Tensor:
            base = x._base if x._base is not None else x
            if isinstance(base, nn.Parameter) or isinstance(x, nn.Parameter):
                return x
            if id(base) not in self._seen:
                self._seen[id(base)] = base
                self.nbytes += base.numel() * base.element_size()
            return x

        super().__init__(pack, lambda x: x)

    def clear(self) -> None:
        self._seen.clear()


@contextmanager
def saved_bytes() -> Iterator[SavedBytes]:
    hooks = SavedBytes()
    try:
        with hooks:
            yield hooks
    finally:
        hooks.clear()


def init_build_bytes(model: int, *, world_size: int, max_live: int, params_on_nvme: bool
                     ) -> int:
    """Host bytes a build under engine.Init holds at its peak ([Note: Init partitioning] in
    engine/init/context.py): the rank's slices of `model` bytes of parameters (host
    memory), or only the NVMe staging writes in flight, + `max_live` bytes of whole
    parameters (zero.init_live_bytes; never more than the model)."""
    from tierzero.engine.init.staging import INFLIGHT_BYTES

    slices = INFLIGHT_BYTES if params_on_nvme else -(-model // world_size)
    return min(slices, model) + min(max_live, model)


def predict(*, model: int, init_peak: Mapping[Tier, int], peak: Mapping[Tier, int],
            pipeline: int, init_outside: int = 0,
            saved: int, largest_unit: int, largest_group: int, compute_bytes: int,
            device_is_host: bool, init_build: int | None = None, gathered: int = 0
            ) -> HostPeak:
    """[Note: plan host peak] from a dry run's counts (dry_run.DryRun's fields).

    `init_peak`, `peak`: the tier manager's per-tier peaks after placement and over the
    steps; `pipeline`: the CPU Adam ring at its peak, `init_outside`: the part of it
    already allocated when placement ends; `saved`: bytes autograd saved in one forward;
    `largest_unit`: elements of the most gradients held before their reduction (a block
    unit's, or one root group's: DryRun.largest_unit); `largest_group`: of the
    largest flat group (a root is cut into several); `compute_bytes`: bytes per
    element of the compute dtype; `device_is_host`: the device tier is host memory (no
    CUDA), so its bytes, the saved tensors and the gradients count here too;
    `init_build`: the build's bytes under engine.Init (init_build_bytes), None when the
    model is built whole (`model` bytes); `gathered`: the most gathered parameter bytes at
    once (dry_run.DryRun.gathered_peak)."""
    device = peak.get("device", 0) if device_is_host else 0
    init_device = init_peak.get("device", 0) if device_is_host else 0
    built = model if init_build is None else init_build
    # initialize: flat groups are placed one by one (shards.flat.build_group): the group's
    # fp32 initial values and their compute-dtype copy are made, its host homes filled,
    # then the model's own tensors of that group forgotten; so the model and the homes
    # placed so far overlap by at most the larger of the two
    staging = largest_group * (4 + compute_bytes)
    initialize = max(built, init_peak.get("host", 0)) + init_device + init_outside + staging
    on_host = device_is_host
    grads = largest_unit * (compute_bytes + 4) if on_host else 0
    parts = {"tier_host": peak.get("host", 0), "tier_device": device, "adam_pipeline": pipeline,
             "gathered_units": gathered if on_host else 0,
             "saved_activations": saved if on_host else 0, "unit_gradients": grads}
    return HostPeak(build=built, initialize=initialize, train=sum(parts.values()),
                    parts={**parts, "model": built, "init_staging": staging})
