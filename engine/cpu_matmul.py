"""bf16 and fp16 matrix products on a CPU without a fast kernel for them, computed in fp32.

[Note: low-precision matmul on CPU]
torch multiplies bf16 (or fp16) matrices on a CPU with oneDNN where the CPU has the
instructions for it (AVX-512, AMX; `torch.ops.mkldnn._is_mkldnn_bf16_supported()`).
Elsewhere (AVX2-only x86 CPUs, such as AMD Zen 1-3 and most laptops) it falls back to
a scalar triple loop: measured 0.1-11 GFLOP/s against fp32's 40-50 on an AVX2 EPYC, a
backward of the 25.5M default model 24x slower than fp32's (pytorch/pytorch#146508).
With compute on the CPU (the `device` tier of a machine without an accelerator), an
engine whose precision is bf16 or fp16 would spend nearly all its time there.

`LowPrecisionMatmul` is a TorchDispatchMode the engine enters while it runs the model
and its backward where `precision.cpu_matmul` resolves to fp32 (`upcast_matmul`). Below
autograd, it computes each matrix product whose operands are all CPU tensors of the
compute dtype (aten mm, addmm, bmm, baddbmm: what linear, matmul and `@` reach, forward
and backward) on their fp32 upcasts and rounds the result to the compute dtype once,
which is what the native kernel computes too: it accumulates in fp32 (opmath) and rounds
once at the end. Only the order of the fp32 sums differs, so results agree with the
native kernel's to the rounding of each product, not bit for bit.

Below autograd, the graph is the native one: it saves the same low-precision tensors (the
fp32 copies live only while one product runs), and activation hooks, layer-major's
recomputation and a model's own activation checkpointing see what they see without the
mode. A dispatch mode, unlike a TorchFunctionMode, is still active inside backward(),
where autograd runs the gradients' products and checkpointing recomputes its segments.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

__all__ = ["PRODUCTS", "LowPrecisionMatmul", "native_matmul_is_slow", "upcast_matmul"]

LOW = (torch.bfloat16, torch.float16)

_ONEDNN_CHECK = {torch.bfloat16: "_is_mkldnn_bf16_supported",
                 torch.float16: "_is_mkldnn_fp16_supported"}


def native_matmul_is_slow(dtype: torch.dtype) -> bool:
    """Whether torch multiplies CPU matrices of `dtype` (bf16 or fp16) with its scalar
    fallback: oneDNN is not built in, is turned off (`torch.backends.mkldnn.enabled`),
    or does not support the dtype on this CPU."""
    if dtype not in LOW:
        return False
    onednn = torch.backends.mkldnn
    if not (onednn.is_available() and onednn.enabled):  # type: ignore[no-untyped-call]
        return True
    check = getattr(torch.ops.mkldnn, _ONEDNN_CHECK[dtype], None)
    if check is None:  # a torch without the probe: oneDNN's low-precision GEMM needs AVX-512
        return not torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return not bool(check())


def upcast_matmul(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an engine computing in `dtype` on `device` multiplies matrices in fp32
    (precision.cpu_matmul: auto, native or fp32)."""
    if device.type != "cpu" or dtype not in LOW or setting == "native":
        return False
    return setting == "fp32" or native_matmul_is_slow(dtype)


# the products of aten's default overloads (out= variants pass through)
_aten = torch.ops.aten
PRODUCTS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
                      _aten.baddbmm.default})


def _operands_in(dtype: torch.dtype, args: tuple[Any, ...]) -> bool:
    """Every tensor operand a strided CPU tensor of `dtype`."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.dtype == dtype and t.device.type == "cpu"
                                 and t.layout == torch.strided for t in tensors)


def _upcast(func: Any, dtype: torch.dtype, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> torch.Tensor:
    """`func` on the fp32 upcasts of its operands, rounded to `dtype` once."""
    ups = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
    return func(*ups, **kwargs).to(dtype)  # type: ignore[no-any-return]


class LowPrecisionMatmul(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """See [Note: low-precision matmul on CPU]: matrix products of CPU tensors of `dtype`
    computed in fp32 while the mode is active; every other op passes through."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dtype = dtype

    @staticmethod
    def active() -> bool:
        """One is entered on this thread (a nested one would only add its overhead)."""
        return any(isinstance(m, LowPrecisionMatmul) for m in _get_current_dispatch_mode_stack())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in PRODUCTS and _operands_in(self.dtype, args):
            return _upcast(func, self.dtype, tuple(args), kwargs)
        return func(*args, **kwargs)
