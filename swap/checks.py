"""Argument checks of SwapStore: bad input is refused before any work, naming what was wrong."""

from __future__ import annotations

import torch

from tierzero.swap.header import MAX_KEY_BYTES, MAX_NDIM
from tierzero.swap.request import Entry

__all__ = ["check_int", "check_key", "check_matches", "check_tensor"]


def check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"SwapStore: {name} must be an int in [{lo}, {hi}], got {value!r}")


def check_key(key: object) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"swap key must be a non-empty str, got {key!r}")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"swap key {key[:40]!r}... is longer than {MAX_KEY_BYTES} utf-8 bytes")


def check_tensor(key: str, tensor: object, op: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"swap {op} of key {key!r}: expected a torch.Tensor, got {type(tensor)}")
    problems = []
    if tensor.device.type != "cpu":
        problems.append(f"device is {tensor.device} (must be cpu)")
    if tensor.layout != torch.strided or tensor.is_quantized:
        problems.append(f"layout {tensor.layout} (must be a dense strided tensor)")
    elif not tensor.is_contiguous():
        problems.append("not contiguous (call .contiguous() first)")
    if tensor.is_conj() or tensor.is_neg():
        problems.append("has a lazy conj/neg bit (call .resolve_conj()/.resolve_neg() first)")
    if tensor.dim() > MAX_NDIM:
        problems.append(f"{tensor.dim()} dims (at most {MAX_NDIM})")
    if problems:
        raise ValueError(f"swap {op} of key {key!r}: tensor " + "; ".join(problems))


def check_matches(key: str, out: torch.Tensor, stored: Entry) -> None:
    if out.dtype != stored.dtype or out.numel() * out.element_size() != stored.nbytes:
        raise ValueError(
            f"swap read of key {key!r}: out is {out.dtype} with {out.numel()} elements, "
            f"the stored tensor is {stored.dtype} of shape {stored.shape}; pass a buffer of "
            "that dtype and number of elements"
        )
