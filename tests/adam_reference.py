"""The reference the streamed CPU Adam is compared to: every shard's state in plain host
tensors, updated in place by the same kernel (offload.adam_update), one shard after another.

The kernel is elementwise, so updating a shard in place gives the bits that any staging of
it (host ring, tier manager, NVMe) must reproduce: comparisons against this are torch.equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierzero.offload import AdamHyper, adam_update


class HostShards:
    """Per shard: fp32 master and moments, a gradient, and an optional low-precision copy."""

    def __init__(self, numels: Sequence[int], *, param_dtype: torch.dtype | None = None,
                 grad_dtype: torch.dtype = torch.float32) -> None:
        self.numels = tuple(numels)
        self.tensors: list[dict[str, torch.Tensor]] = []
        for n in self.numels:
            shard = {name: torch.zeros(n) for name in ("master", "exp_avg", "exp_avg_sq")}
            shard["grad"] = torch.zeros(n, dtype=grad_dtype)
            if param_dtype is not None:
                shard["param"] = torch.zeros(n, dtype=param_dtype)
            self.tensors.append(shard)

    def step(self, *, hyper: AdamHyper, step: float, grad_scale: float = 1.0) -> None:
        """One Adam step of every non-empty shard (the low-precision copy written from the
        new master in the same pass, as the engine's step does)."""
        for t in self.tensors:
            if t["master"].numel():
                adam_update(t["master"], t["exp_avg"], t["exp_avg_sq"], t["grad"],
                            hyper=hyper, step=step, grad_scale=grad_scale,
                            shadow=t.get("param"))
