"""SwapFuture: one read or write, holding its buffer and its completion together."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Literal

import torch

__all__ = ["SwapFuture"]

Op = Literal["read", "write"]


class SwapFuture(Future[torch.Tensor]):
    """The pending result of `SwapStore.write` or `SwapStore.read`.

    It keeps a reference to the caller's tensor (`tensor`) until the I/O is
    over, so the buffer cannot be freed while the kernel may still touch it.
    The caller must not write into a tensor being written, nor read a tensor
    being read into, before `wait()` returns: the bytes are in flight.

    `wait()` returns the tensor (for a read, now holding the data) or raises
    `SwapError`; `done()` and `result(timeout)` are the usual Future methods.
    """

    def __init__(self, op: Op, key: str, tensor: torch.Tensor) -> None:
        super().__init__()
        self.op: Op = op
        self.key = key
        self.tensor = tensor  # the caller's buffer; contiguous CPU

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Block until the I/O is over; return the tensor or raise its SwapError."""
        return self.result(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"SwapFuture({self.op} {self.key!r}, {self.tensor.nbytes} bytes, {state})"
