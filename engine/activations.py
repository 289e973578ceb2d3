"""Saved activations in host memory (config `activations.cpu_offload`).

Under `HostActivations` every tensor autograd saves for backward during the
engine's forward is copied to pinned host memory at save time and copied back
to the device when backward unpacks it, so activations do not hold device
memory between forward and backward. With non-reentrant
`torch.utils.checkpoint` the inputs of each checkpointed block are saved
this way too (torch saves them through the active saved-tensor hooks; the
block's inner tensors are recomputed, not saved), so a checkpointed model
keeps only its block boundaries, on the host.

Parameters (and views of them) are left alone: they are the engine's gathered
copies, re-gathered for backward by the scheduler, and copying them to the
host would only add traffic. On a CPU-only machine the device tier is host
memory already, so the engine does not install the hooks (logged once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

_Packed = torch.Tensor | tuple[torch.device, torch.Tensor]


@dataclass
class HostActivationStats:
    """What the hooks did since the engine was built."""

    packed_tensors: int = 0  # saved tensors copied to host memory
    packed_bytes: int = 0
    pinned_tensors: int = 0  # of those, copies in pinned memory
    kept_parameters: int = 0  # saved tensors left in place: parameters and their views


class HostActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that park activations in (pinned) host memory until backward.

    `moved_from`: device types whose saved tensors are copied (the engine passes
    ("cuda",); a test may pass ("cpu",) to drive the same path on a CPU machine)."""

    def __init__(self, stats: HostActivationStats, *, pin_memory: bool,
                 moved_from: tuple[str, ...] = ("cuda",)) -> None:
        pin = pin_memory and torch.cuda.is_available()

        def pack(x: torch.Tensor) -> _Packed:
            base = x._base if x._base is not None else x
            if isinstance(base, nn.Parameter) or isinstance(x, nn.Parameter):
                stats.kept_parameters += 1
                return x
            if x.device.type not in moved_from:
                return x
            host = torch.empty(x.size(), dtype=x.dtype, layout=x.layout, pin_memory=pin)
            host.copy_(x, non_blocking=pin)  # device -> pinned host, asynchronous
            stats.packed_tensors += 1
            stats.packed_bytes += x.numel() * x.element_size()
            stats.pinned_tensors += int(host.is_pinned())
            return (x.device, host)

        def unpack(packed: _Packed) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=pin)

        super().__init__(pack, unpack)
