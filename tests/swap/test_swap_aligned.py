"""aligned_empty: alignment, shape, dtype, lifetime."""

from __future__ import annotations

import gc

import pytest
import torch

from tierzero.swap import ALIGN, aligned_empty, is_aligned

DTYPES = [torch.uint8, torch.int8, torch.bool, torch.float16, torch.bfloat16, torch.float32,
          torch.float64, torch.int32, torch.int64, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 3, 4095, 4097, 1 << 20])
def test_aligned_empty_numel(dtype: torch.dtype, numel: int) -> None:
    t = aligned_empty(numel, dtype)
    assert t.shape == (numel,)
    assert t.dtype == dtype
    assert t.is_contiguous()
    assert t.device.type == "cpu"
    assert is_aligned(t), hex(t.data_ptr())
    assert t.data_ptr() % ALIGN == 0


def test_aligned_empty_shape_and_writable() -> None:
    t = aligned_empty((3, 5, 7), torch.float32)
    assert t.shape == (3, 5, 7) and is_aligned(t)
    t.copy_(torch.arange(105, dtype=torch.float32).view(3, 5, 7))
    assert torch.equal(t.flatten(), torch.arange(105, dtype=torch.float32))


def test_aligned_empty_many_stay_aligned_and_independent() -> None:
    tensors = [aligned_empty(n, torch.float32) for n in range(1, 200, 7)]
    for i, t in enumerate(tensors):
        t.fill_(float(i))
    gc.collect()
    for i, t in enumerate(tensors):
        assert is_aligned(t)
        assert bool((t == float(i)).all())


def test_aligned_empty_bad_input() -> None:
    with pytest.raises(ValueError, match="negative"):
        aligned_empty((2, -1), torch.float32)
    with pytest.raises(TypeError, match="bool"):
        aligned_empty(True, torch.float32)


@pytest.mark.cuda
def test_aligned_empty_pinned() -> None:
    t = aligned_empty(12345, torch.float16, pin_memory=True)
    assert t.is_pinned() and is_aligned(t)
