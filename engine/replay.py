"""What replaying a unit call needs: the generator states and the autocast state it ran
with ([Note: layer-major schedule] in layer_major.py recomputes each unit call in backward
exactly as it ran in forward)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class RngState:
    """The generator states a unit call ran with (CPU, and the CUDA device's)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: int | None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return cls(torch.get_rng_state(), torch.cuda.get_rng_state(index), index)
        return cls(torch.get_rng_state(), None, None)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None and self.device is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


@contextlib.contextmanager
def rng_as(state: RngState, device: torch.device) -> Iterator[None]:
    """Run with the generators at `state`; put them back afterwards."""
    before = RngState.capture(device)
    state.restore()
    try:
        yield
    finally:
        before.restore()


def autocast_state(device: torch.device) -> tuple[bool, torch.dtype]:
    """Whether autocast is on for `device`'s type, and its dtype (off where autocast has no
    such device: meta, in tierzero plan's dry run)."""
    if device.type not in ("cpu", "cuda"):
        return False, torch.float32
    return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


def autocast(device: torch.device, state: tuple[bool, torch.dtype]
              ) -> contextlib.AbstractContextManager[object]:
    on, dtype = state
    return torch.autocast(device.type, dtype=dtype) if on else contextlib.nullcontext()
