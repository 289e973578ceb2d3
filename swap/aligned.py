"""Page-aligned CPU tensors for O_DIRECT I/O.

O_DIRECT needs the buffer address, the file offset and the length to be
multiples of the device's logical block size. We align to ALIGN (4 KiB, the
page size on x86-64 and the largest logical block size of common NVMe drives),
so a tensor from `aligned_empty` can be read into or written from directly.

How: over-allocate a uint8 tensor by ALIGN bytes and slice at the first aligned
address. The slice is a view, so its storage (and the memory) lives exactly as
long as the tensor. We prefer this to an anonymous mmap + `torch.frombuffer`:
it needs no mmap object to outlive the tensor, works unchanged for pinned
memory (`pin_memory=True`), and costs at most ALIGN - 1 bytes per tensor. For
large sizes both come from the kernel as fresh zero pages (glibc serves big
mallocs with mmap), and neither is slower than plain torch.empty
(`benchmarks/swap_bench.py --aligned`; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

__all__ = ["ALIGN", "aligned_empty", "is_aligned"]

ALIGN: int = max(4096, mmap.PAGESIZE)  # bytes; O_DIRECT address/offset/length unit


def _shape_of(numel_or_shape: int | Sequence[int] | torch.Size) -> tuple[int, ...]:
    if isinstance(numel_or_shape, bool):
        raise TypeError("aligned_empty: numel_or_shape must be an int or a shape, not a bool")
    if isinstance(numel_or_shape, int):
        shape: tuple[int, ...] = (numel_or_shape,)
    else:
        shape = tuple(int(d) for d in numel_or_shape)
    bad = [d for d in shape if d < 0]
    if bad:
        raise ValueError(
            f"aligned_empty: shape {shape} has negative sizes {bad}; sizes must be >= 0"
        )
    return shape


def aligned_empty(
    numel_or_shape: int | Sequence[int] | torch.Size,
    dtype: torch.dtype = torch.uint8,
    *,
    pin_memory: bool = False,
) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose first byte is ALIGN-aligned.

    `numel_or_shape` is a number of elements (1-D result) or a shape.
    `pin_memory=True` allocates page-locked memory (needs CUDA).
    """
    shape = _shape_of(numel_or_shape)
    itemsize = dtype.itemsize
    nbytes = math.prod(shape) * itemsize
    base = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    skip = (-base.data_ptr()) % ALIGN
    flat = base[skip : skip + nbytes]
    return flat.view(dtype).view(shape)


def is_aligned(tensor: torch.Tensor, align: int = ALIGN) -> bool:
    """True when the tensor's first byte sits on an `align`-byte boundary."""
    return tensor.data_ptr() % align == 0
