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

[Note: fp32 products in panels]
Upcasting a product's operands whole would make an fp32 copy of every weight it reads
(the forward's and the input gradient's products) and an fp32 result the size of the
weight (the weight gradient's product), each twice the weight's own size, allocated fresh
(page faults) and streamed through memory once more: at a 32000 x 2560 head, 330 MB and
330 MB again, which no host budget sees. A product with an operand or result over `PANEL`
elements is computed in panels instead: `a @ b` ([M, K] @ [K, N]) one block of N (or,
where a is the larger operand, of M) at a time, each panel of the larger operand converted
into a scratch buffer and multiplied with the smaller operand's fp32 upcast into the rest
of it, then rounded into its slice of the result. The reduction dimension K is never
split: each element is still one fp32 product rounded once. The fp32 memory a product
holds is then at most the smaller operand's upcast (an activation, for a linear layer's
three products) plus its scratch, about `PANEL` elements (16 MiB), which returns to a
shared pool after the product: the pool keeps one per product ever running at once, not
one per thread. The panels also stay in the caches, so the products take less time, most
at few tokens (benchmarks/RESULTS.md, "fp32 products in panels on an AVX2 CPU"). bmm and
baddbmm (attention's products of activations) are upcast whole.

[Note: the product's larger operand on the left]
Which of a product's operands the GEMM takes as its left one changes MKL's speed, not
the arithmetic. A linear layer's forward (`x @ W.T`) and input gradient (`dy @ W`) at few
tokens have a short, wide result ([tokens, out]) and a long reduction (the layer's width):
computed as the transposed product (`W @ x.T`, whose result is that one's transpose) they
ran faster on an AVX2 EPYC, most at the fewest tokens, and no slower at 1024
(benchmarks/RESULTS.md, "A linear layer's products with the weight on the left"). Giving
torch's mm an fp32 result laid out column-major makes it call the GEMM that way round
(`_fp32_result`); each element is still one fp32 dot product over the same K, rounded
once into the contiguous result the op returns. `_column_major` picks the results laid
out so: at most half as many rows as columns (a panel's result: as many as the panel has
columns) and fewer rows than the reduction is long. A weight gradient's product
([out, tokens] @ [tokens, in]: the reduction is the short side) keeps its row-major
result, which ran no faster the other way round, and slower in short panels.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

__all__ = ["PANEL", "PRODUCTS", "LowPrecisionMatmul", "native_matmul_is_slow", "upcast_matmul"]

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


# fp32 elements of a product's larger operand or result above which it is computed in
# panels of about this many ([Note: fp32 products in panels])
PANEL = 1 << 22

# fp32 scratch buffers of the products not running now, for the next ones to reuse
_idle: list[torch.Tensor] = []
_idle_lock = threading.Lock()


@contextlib.contextmanager
def _scratch_fp32(numel: int) -> Iterator[torch.Tensor]:
    """An fp32 scratch of at least `numel` elements for one product: an idle one (the
    smallest large enough) or a new one, kept for reuse after. The pool holds one buffer
    per product ever running at once, whatever the number of threads that ran one
    (layer-major runs each micro-batch on a thread of its own, one at a time)."""
    with _idle_lock:
        fits = [b for b in _idle if b.numel() >= numel]
        buf = min(fits, key=torch.Tensor.numel) if fits else None
        if buf is not None:
            _idle.remove(buf)
        elif _idle:  # none large enough: replace the largest idle one
            _idle.remove(max(_idle, key=torch.Tensor.numel))
    if buf is None:
        buf = torch.empty(numel, dtype=torch.float32)
    try:
        yield buf
    finally:
        with _idle_lock:
            _idle.append(buf)


def _fp32_view(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A view of `buf`'s first elements shaped as 2-D `like`, column-major where `like` is
    (a transposed weight), so that copying `like` into it is one pass in memory order."""
    rows, cols = like.shape
    if like.stride(0) == 1 and like.stride(1) != 1:
        return buf[:rows * cols].view(cols, rows).t()
    return buf[:rows * cols].view(rows, cols)


def _column_major(rows: int, cols: int, k: int) -> bool:
    """Whether a product's [rows, cols] fp32 result, over a reduction of `k`, is computed
    column-major ([Note: the product's larger operand on the left])."""
    return 2 * rows <= cols and rows < k


def _fp32_result(buf: torch.Tensor, rows: int, cols: int, k: int) -> torch.Tensor:
    """A [rows, cols] view of `buf`'s first elements for an fp32 product's result over a
    reduction of `k`, column-major where `_column_major` says so."""
    if _column_major(rows, cols, k):
        return buf[:rows * cols].view(cols, rows).t()
    return buf[:rows * cols].view(rows, cols)


def _product(res: torch.Tensor, lhs: torch.Tensor, rhs: torch.Tensor,
             bias: torch.Tensor | None, *, beta: Any, alpha: Any) -> None:
    """`res` = `lhs @ rhs`, or addmm's `beta * bias + alpha * (lhs @ rhs)` (the bias
    upcast, then beta and alpha in one GEMM; beta 0 ignores it), all fp32, in `res`'s
    layout."""
    if bias is None:
        torch.mm(lhs, rhs, out=res)
    else:
        res.copy_(bias)
        res.addmm_(lhs, rhs, beta=beta, alpha=alpha)


def _panels(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype,
            bias: torch.Tensor | None, *, beta: Any, alpha: Any) -> torch.Tensor:
    """`a @ b` (or `beta * bias + alpha * (a @ b)`, addmm's) in fp32, panel by panel
    ([Note: fp32 products in panels]), rounded to `dtype` once."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty(m, n, dtype=dtype)
    full = None if bias is None else bias.expand(m, n)
    by_cols = b.numel() >= a.numel()  # the panels cut the larger operand
    whole = a.float() if by_cols else b.float()
    cut, kept = (n, m) if by_cols else (m, n)  # the dimension cut, the other one of out
    step = max(1, PANEL // (k + kept))  # a panel and its result: step * (k + kept)
    with _scratch_fp32(step * (k + kept)) as buf:
        for lo in range(0, cut, step):
            hi = min(lo + step, cut)
            if by_cols:
                part = _fp32_view(buf, b[:, lo:hi])
                part.copy_(b[:, lo:hi])
                res = _fp32_result(buf[part.numel():], m, hi - lo, k)
                lhs, rhs, where = whole, part, (slice(None), slice(lo, hi))
            else:
                part = _fp32_view(buf, a[lo:hi])
                part.copy_(a[lo:hi])
                res = _fp32_result(buf[part.numel():], hi - lo, n, k)
                lhs, rhs, where = part, whole, (slice(lo, hi), slice(None))
            _product(res, lhs, rhs, None if full is None else full[where], beta=beta,
                     alpha=alpha)
            out[where].copy_(res)
    return out


def _upcast(func: Any, dtype: torch.dtype, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> torch.Tensor:
    """`func` on the fp32 upcasts of its operands, rounded to `dtype` once; mm and addmm
    with a large operand or result in panels ([Note: fp32 products in panels]), a short,
    wide result column-major ([Note: the product's larger operand on the left])."""
    if func is _aten.mm.default or func is _aten.addmm.default:
        a, b = args[-2:]
        m, n = a.shape[0], b.shape[1]
        bias = args[0] if func is _aten.addmm.default else None
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        if max(a.numel(), b.numel(), m * n) > PANEL:
            return _panels(a, b, dtype, bias, beta=beta, alpha=alpha)
        if _column_major(m, n, a.shape[1]):  # else torch's own, row-major, result
            res = torch.empty(n, m).t()  # column-major; the bias upcast as it is copied in
            _product(res, a.float(), b.float(), None if bias is None else bias.expand(m, n),
                     beta=beta, alpha=alpha)
            return torch.empty(m, n, dtype=dtype).copy_(res)
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
