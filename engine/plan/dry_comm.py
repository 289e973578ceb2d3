"""DryComm: the engine's collectives for a dry run of rank 0 of `world_size` ranks, on meta.

`tierzero plan` runs the real engine on meta tensors for a world size it does
not have. Shapes are checked exactly as Comm checks them; no data moves (meta
tensors have none) and no process group is needed. Rank 0 stands for every
rank: the ranks' shards differ by at most the last one's padding, which the
engine's layout gives every rank ([Note: flat layout] in engine/shards/flat.py).
"""

from __future__ import annotations

import torch

from tierzero.engine.collectives import Comm, PendingReduce


class DryComm(Comm):
    def __init__(self, world_size: int) -> None:
        super().__init__()
        if world_size < 1:
            raise ValueError(f"DryComm world_size {world_size}: allowed: >= 1")
        self.rank, self.world_size, self.backend = 0, world_size, "dry-run"

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, what: str = "") -> None:
        if out.numel() != shard.numel() * self.world_size:
            raise ValueError(f"all_gather: output has {out.numel()} elements, expected "
                             f"{shard.numel()} x world size {self.world_size}")

    def reduce_scatter_mean_async(
        self, out: torch.Tensor, full: torch.Tensor, accumulate_into: torch.Tensor | None = None,
        what: str = "",
    ) -> PendingReduce:
        if full.numel() != out.numel() * self.world_size:
            raise ValueError(f"reduce_scatter: input has {full.numel()} elements, expected "
                             f"{out.numel()} x world size {self.world_size}")
        return PendingReduce(None, full, out, accumulate_into, self.world_size, None)

    def all_reduce_sum(self, t: torch.Tensor, what: str = "a sum") -> None:
        return None

    def broadcast(self, t: torch.Tensor, src: int, what: str = "a tensor") -> None:
        return None

    def all_equal(self, values: list[int]) -> bool:
        return True
