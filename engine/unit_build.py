"""Units built from their specs: flat groups declared to the shard store, then placed.

The engine builds its units here, in two passes ([Note: returning freed host memory] in
host_heap.py says why the second frees each unit's module tensors as it goes):
`declare_groups` tells the store every shard before any is created, so placement is
planned over the whole model; `build_unit` then makes one unit's flat groups, each
group's initial values placed as it is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tierzero.engine.collectives import Comm
from tierzero.engine.config.schema import ZeroConfig
from tierzero.engine.shards.flat import FlatGroup, build_group, shard_numel
from tierzero.engine.shards.spares import GatherSpares, spares_supported
from tierzero.engine.shards.store import ShardStore
from tierzero.engine.unit import Unit
from tierzero.engine.units import UnitSpec, check_parameters_supported, discover_units

Named = list[tuple[str, nn.Parameter]]


def cut(named: Named, cap: int) -> list[Named]:
    """Consecutive runs of `named` of at most `cap` elements (a larger parameter alone);
    cap 0: one run."""
    runs: list[Named] = [[]]
    size = 0
    for qname, p in named:
        if cap and runs[-1] and size + p.numel() > cap:
            runs.append([])
            size = 0
        runs[-1].append((qname, p))
        size += p.numel()
    return runs


def unit_specs(module: nn.Module, zero: ZeroConfig, comm: Comm) -> list[UnitSpec]:
    """The units of `module` under the zero settings, the same on every rank (checked
    before the first collective that depends on them: a mismatch would hang)."""
    check_parameters_supported(module)
    specs = discover_units(module, list(zero.units) or None, zero.unit_min_bytes,
                           list(zero.leaf_modules), zero.auto_leaf_moe)
    shape_sig = [len(specs)] + [sum(p.numel() for _, p in s.params) for s in specs]
    if not comm.all_equal(shape_sig):
        raise ValueError("ranks built different units (parameter counts per unit "
                         f"{shape_sig} on rank {comm.rank}); every rank must build the same "
                         "model with the same zero.units")
    return specs


@dataclass(frozen=True)
class UnitBuilder:
    """What every unit's groups are built with: the compute dtype, the ranks, the store,
    the device, the zero settings, and the root's group cap (the largest block unit's
    elements: see `group_plan`)."""

    dtype: torch.dtype
    comm: Comm
    store: ShardStore
    device: torch.device
    zero: ZeroConfig
    group_cap: int
    # every group's released buffer goes here on a CPU device ([Note: gather buffers kept
    # for the next gather] in shards/spares.py); None: freed
    spares: GatherSpares | None = None

    @classmethod
    def for_specs(cls, specs: Sequence[UnitSpec], *, dtype: torch.dtype, comm: Comm,
                  store: ShardStore, device: torch.device, zero: ZeroConfig) -> UnitBuilder:
        cap = max((sum(p.numel() for _, p in s.params) for s in specs if not s.is_root),
                  default=0)
        return cls(dtype, comm, store, device, zero, cap,
                   GatherSpares() if spares_supported(device) else None)

    def group_plan(self, spec: UnitSpec) -> list[tuple[str, bool, Named]]:
        """(store key, trainable, named params) of each flat group of a unit.

        The root's groups are cut, at parameter boundaries in module order, into pieces no
        larger than the largest block unit (`group_cap`): a root of untied embeddings and
        head is often several blocks' worth, and every per-shard buffer (the CPU Adam's
        ring, NVMe staging) is sized by the largest shard. Pieces after the first get a
        "#i" suffix; a root within the cap keeps one group per kind."""
        by_kind: dict[bool, Named] = {}
        for qname, p in spec.params:
            by_kind.setdefault(p.requires_grad, []).append((qname, p))
        label = spec.name or "<root>"
        dtype_name = str(self.dtype).removeprefix("torch.")
        out = []
        for trainable, named in sorted(by_kind.items(), reverse=True):
            key = f"{label}/{dtype_name}/{'trainable' if trainable else 'frozen'}"
            pieces = cut(named, self.group_cap) if spec.is_root else [named]
            out += [(key if i == 0 else f"{key}#{i}", trainable, piece)
                    for i, piece in enumerate(pieces)]
        return out

    def declare_groups(self, specs: Sequence[UnitSpec]) -> None:
        """Tell the store every shard before any is created, so placement is planned over
        the whole model and each group's initial values are placed as it is built."""
        for spec in specs:
            for key, trainable, named in self.group_plan(spec):
                numel = shard_numel(sum(p.numel() for _, p in named), self.comm.world_size)
                self.store.declare(key, numel, self.dtype, trainable)
        self.store.finalize()

    def build_unit(self, index: int, spec: UnitSpec) -> Unit:
        groups: list[FlatGroup] = [
            build_group(key, named, dtype=self.dtype, trainable=trainable, comm=self.comm,
                        store=self.store, device=self.device, spares=self.spares)
            for key, trainable, named in self.group_plan(spec)
        ]
        nbytes = sum(g.numel for g in groups) * torch.finfo(self.dtype).bits // 8
        # Stage 1/2: every unit, the root included, stays gathered between steps (as their
        # parameters do in DeepSpeed). Stage 3: blocks under the threshold; the root is
        # gathered around each forward and backward.
        persistent = self.zero.stage < 3 or (
            not spec.is_root and nbytes < self.zero.persistence_threshold_bytes)
        trainable = tuple(p for _, p in spec.params if p.requires_grad)
        return Unit(index, spec.name, spec.module, spec.is_root, persistent, groups,
                    trainable, has_frozen=len(trainable) < len(spec.params),
                    dynamic=spec.dynamic)
