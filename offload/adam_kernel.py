"""`adam_update`: one Adam/AdamW step over a flat shard, in one pass over memory.

Inputs are contiguous CPU tensors of equal length: fp32 ``master``,
``exp_avg`` and ``exp_avg_sq`` (updated in place), a gradient in fp32, bf16 or
fp16 (read only, multiplied by ``grad_scale`` on the fly for loss scaling or
clipping), and optionally a bf16/fp16 ``shadow`` that receives the new master
rounded to nearest even, bit-identical to ``master.to(shadow.dtype)``. A bf16
``master`` (offload.optimizer.master_precision bf16) is updated in fp32 and written
back rounded stochastically with the bits of ``master_key`` ([Note: bf16 master
weights] in bf16_master.py); it takes no shadow: it is the compute copy itself.

Backends: ``"compiled"`` is the C kernel (offload/_adam_kernel.c, built at
first use, see adam_build.py); ``"torch"`` is the same arithmetic in PyTorch
ops (adam_math.torch_update); ``"auto"`` takes the compiled kernel when it
could be built and otherwise the PyTorch path (the reason is logged once).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from .adam_build import CompiledKernel, HyperParams, compiled_kernel, kernel_status
from .adam_math import AdamHyper, check_flat, check_storage, step_scalars, torch_update
from .adam_threads import MIN_PER_THREAD, AdamThreads
from .bf16_master import round_bf16_stochastic
from .state_codec import (
    BLOCK,
    SKIND,
    check_precision,
    decode,
    encode,
    split_int8,
    step_seed,
)

Backend = Literal["auto", "compiled", "torch"]
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def resolve_backend(backend: Backend) -> CompiledKernel | None:
    """The compiled kernel to use, or None for the PyTorch path; errors on an unknown name."""
    if backend == "torch":
        return None
    if backend not in ("auto", "compiled"):
        raise ValueError(
            f"Adam backend={backend!r} is unknown; allowed: 'auto', 'compiled', 'torch'"
        )
    kernel = compiled_kernel()
    if kernel is None and backend == "compiled":
        raise RuntimeError(f"Adam backend='compiled' requested but unavailable: {kernel_status()}")
    return kernel


def _hyper_struct(hyper: AdamHyper, step: float, grad_scale: float) -> HyperParams:
    # Every scalar is computed in double as torch does, then rounded to fp32 once, as
    # ATen does when it turns a Python scalar into the op's compute type.
    s = step_scalars(hyper, step)
    w = 1 - hyper.beta1
    small = abs(w) < 0.5
    w32 = ctypes.c_float(w).value
    return HyperParams(
        grad_scale=grad_scale,
        decay=s.decay,
        wd=hyper.weight_decay,
        w=w,
        # ATen's vector lerp computes weight - 1 in fp32 from the fp32 weight.
        w_coeff=w32 if small else ctypes.c_float(w32 - 1.0).value,
        w_small=int(small),
        beta2=hyper.beta2,
        one_minus_beta2=1 - hyper.beta2,
        bc2_sqrt=s.bc2_sqrt,
        eps=hyper.eps,
        neg_step_size=-s.step_size,
        decoupled=int(hyper.adamw),
        apply_decay=int(hyper.weight_decay != 0),
        apply_scale=int(grad_scale != 1.0),
    )


@dataclass(frozen=True)
class PreparedStep:
    """The scalars of one (hyper, step, grad_scale) and the backend, reusable for many tensors.

    `adam_update` builds one per call; a caller updating many tensors with the same
    scalars (CPUAdam, one group) builds it once with `prepare_step`.
    """

    hyper: AdamHyper
    step: float
    grad_scale: float
    kernel: CompiledKernel | None  # None: the PyTorch path
    struct: HyperParams | None  # the C argument block, when compiled


def prepare_step(hyper: AdamHyper, step: float, grad_scale: float = 1.0,
                 backend: Backend = "auto") -> PreparedStep:
    if not isinstance(grad_scale, (int, float)) or not math.isfinite(grad_scale):
        raise ValueError(f"Adam grad_scale={grad_scale!r} is invalid; pass a finite float")
    step_scalars(hyper, step)  # validates step
    kernel = resolve_backend(backend)
    struct = _hyper_struct(hyper, step, grad_scale) if kernel is not None else None
    return PreparedStep(hyper, step, grad_scale, kernel, struct)


def adam_update(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    hyper: AdamHyper,
    step: float,
    grad_scale: float = 1.0,
    shadow: torch.Tensor | None = None,
    threads: AdamThreads | None = None,
    backend: Backend = "auto",
    state: str = "fp32",
    offset: int = 0,
    master_key: int | None = None,
) -> None:
    """Apply one Adam/AdamW update in place; `step` counts this update (1 on the first).

    `threads` spreads the work over a pool's workers (one thread when None). `state`: how
    the moments are stored (offload/state_codec.py): "fp32" tensors, or "bf16" / "int8"
    flat uint8 tensors of state_codec.moment_nbytes(numel) bytes, decoded and re-encoded
    in the same pass. `offset`: the tensors' first element within their shard (a piece of
    it), which bf16's stochastic rounding draws its bits by. `master_key`: with a bf16
    master, the key of its stochastic rounding (bf16_master.master_key of the step and
    shard).
    """
    if master.is_meta:  # a dry run (tierzero plan): no data, nothing to compute
        return
    prepared = prepare_step(hyper, step, grad_scale, backend)
    run_prepared(prepared, master, exp_avg, exp_avg_sq, grad, shadow=shadow, threads=threads,
                 state=state, offset=offset, master_key=master_key)


def run_prepared(
    prepared: PreparedStep,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    shadow: torch.Tensor | None = None,
    threads: AdamThreads | None = None,
    state: str = "fp32",
    offset: int = 0,
    master_key: int | None = None,
) -> None:
    """`adam_update` with scalars prepared once for many tensors.

    Every call checks every operand (check_flat: dtype, device, contiguity, numel and
    storage size), so no caller can make the kernel touch memory it was not given.
    """
    check_precision(state)
    check_flat(master, exp_avg, exp_avg_sq, grad, shadow, state=state)
    n = master.numel()
    if master.dtype == torch.bfloat16:
        if shadow is not None or master_key is None:
            raise ValueError("Adam with a bf16 master takes no shadow (the master is the "
                             "compute copy) and needs master_key (its stochastic rounding)")
        if n:
            _run_bf16_master(prepared, master, exp_avg, exp_avg_sq, grad, threads=threads,
                             state=state, offset=offset, key=master_key)
        return
    if n == 0:
        return
    if state != "fp32":
        _run_compressed(prepared, master, exp_avg, exp_avg_sq, grad, shadow=shadow,
                        threads=threads, state=state, offset=offset)
        return
    hyper, step, grad_scale = prepared.hyper, prepared.step, prepared.grad_scale
    if prepared.kernel is None or prepared.struct is None:
        if threads is None:
            torch_update(master, exp_avg, exp_avg_sq, grad, hyper=hyper, step=step,
                         grad_scale=grad_scale, shadow=shadow)
            return

        def torch_part(lo: int, hi: int) -> None:
            torch_update(master.view(-1)[lo:hi], exp_avg.view(-1)[lo:hi],
                         exp_avg_sq.view(-1)[lo:hi], grad.view(-1)[lo:hi], hyper=hyper,
                         step=step, grad_scale=grad_scale,
                         shadow=None if shadow is None else shadow.view(-1)[lo:hi])

        threads.run(n, torch_part)
        return

    hp_ref = ctypes.byref(prepared.struct)
    ptrs = (master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr())
    gkind = _KIND[grad.dtype]
    out_ptr = shadow.data_ptr() if shadow is not None else None
    okind = _KIND[shadow.dtype] if shadow is not None else 0
    step_fn = prepared.kernel.step

    def part(lo: int, hi: int) -> None:
        rc = step_fn(ptrs[0], ptrs[1], ptrs[2], ptrs[3], gkind, out_ptr, okind, lo, hi, hp_ref)
        if rc != 0:
            raise RuntimeError(
                f"tz_adam_step rejected its arguments (rc={rc}, kinds {gkind}/{okind})"
            )

    if threads is None:
        part(0, n)
    else:
        threads.run(n, part)


def _run_compressed(prepared: PreparedStep, master: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, grad: torch.Tensor, *,
                    shadow: torch.Tensor | None, threads: AdamThreads | None, state: str,
                    offset: int) -> None:
    """`run_prepared` with moments stored in ``state`` (bf16 / int8 bytes, checked)."""
    n = master.numel()
    if prepared.kernel is None or prepared.struct is None:
        # The PyTorch path: decode, the fp32 update, encode (three passes; the fallback only)
        m = torch.empty(n, dtype=torch.float32)
        v = torch.empty(n, dtype=torch.float32)
        decode("exp_avg", exp_avg, m, state)
        decode("exp_avg_sq", exp_avg_sq, v, state)
        torch_update(master, m, v, grad, hyper=prepared.hyper, step=prepared.step,
                     grad_scale=prepared.grad_scale, shadow=shadow)
        seed = step_seed(prepared.step)
        encode("exp_avg", m, exp_avg, state, seed=seed, offset=offset)
        encode("exp_avg_sq", v, exp_avg_sq, state, seed=seed, offset=offset)
        return
    hp_ref = ctypes.byref(prepared.struct)
    skind = SKIND[state]
    seed = step_seed(prepared.step)
    mp, vp = exp_avg.data_ptr(), exp_avg_sq.data_ptr()
    ms = vs = None
    if state == "int8":
        ms = split_int8(exp_avg, n)[1].data_ptr()
        vs = split_int8(exp_avg_sq, n)[1].data_ptr()
    pp, gp = master.data_ptr(), grad.data_ptr()
    gkind = _KIND[grad.dtype]
    out_ptr = shadow.data_ptr() if shadow is not None else None
    okind = _KIND[shadow.dtype] if shadow is not None else 0
    step_q = prepared.kernel.step_q

    def part(lo: int, hi: int) -> None:
        rc = step_q(pp, mp, ms, vp, vs, gp, gkind, out_ptr, okind, skind, lo, hi, hp_ref, seed,
                    offset)
        if rc != 0:
            raise RuntimeError(f"tz_adam_step_q rejected its arguments (rc={rc}, kinds "
                               f"{gkind}/{okind}/{skind}, range {lo}:{hi})")

    _split(n, state, threads, part)


def _split(n: int, state: str, threads: AdamThreads | None,
           part: Callable[[int, int], None]) -> None:
    """`part(lo, hi)` over the element range [0, n), on `threads` when given. int8: the
    kernel's ranges start on block boundaries, so threads split whole blocks."""
    unit = BLOCK if state == "int8" else 1

    def blocks(lo: int, hi: int) -> None:
        part(lo * unit, min(n, hi * unit))

    units = -(-n // unit)
    if threads is None:
        blocks(0, units)
    else:
        threads.run(units, blocks, max(1, MIN_PER_THREAD // unit))


def _run_bf16_master(prepared: PreparedStep, master: torch.Tensor, exp_avg: torch.Tensor,
                     exp_avg_sq: torch.Tensor, grad: torch.Tensor, *,
                     threads: AdamThreads | None, state: str, offset: int, key: int) -> None:
    """`run_prepared` with a bf16 master (checked): tz_adam_step_b, or its PyTorch
    reference (upcast, the fp32 update, stochastic rounding with the same bits)."""
    n = master.numel()
    if prepared.kernel is None or prepared.struct is None:
        p = master.float()
        m, v = exp_avg, exp_avg_sq
        if state != "fp32":
            m, v = torch.empty(n), torch.empty(n)
            decode("exp_avg", exp_avg, m, state)
            decode("exp_avg_sq", exp_avg_sq, v, state)
        torch_update(p, m, v, grad, hyper=prepared.hyper, step=prepared.step,
                     grad_scale=prepared.grad_scale)
        round_bf16_stochastic(p, master, key, offset)
        if state != "fp32":
            seed = step_seed(prepared.step)
            encode("exp_avg", m, exp_avg, state, seed=seed, offset=offset)
            encode("exp_avg_sq", v, exp_avg_sq, state, seed=seed, offset=offset)
        return
    hp_ref = ctypes.byref(prepared.struct)
    skind = SKIND.get(state, 0)
    seed = step_seed(prepared.step)
    ms = vs = None
    if state == "int8":
        ms = split_int8(exp_avg, n)[1].data_ptr()
        vs = split_int8(exp_avg_sq, n)[1].data_ptr()
    pp, mp, vp, gp = master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr()
    gkind = _KIND[grad.dtype]
    step_b = prepared.kernel.step_b

    def part(lo: int, hi: int) -> None:
        rc = step_b(pp, mp, ms, vp, vs, gp, gkind, skind, lo, hi, hp_ref, seed, offset, key)
        if rc != 0:
            raise RuntimeError(f"tz_adam_step_b rejected its arguments (rc={rc}, kinds "
                               f"{gkind}/{skind}, range {lo}:{hi})")

    _split(n, state, threads, part)


def to_low_precision(src: torch.Tensor, dst: torch.Tensor, threads: AdamThreads | None = None,
                     backend: Backend = "auto") -> None:
    """dst = src rounded to dst's dtype (bf16/fp16, nearest even), for refreshing a shadow copy."""
    if src.dtype != torch.float32 or dst.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"to_low_precision needs fp32 -> bf16/fp16, got {src.dtype} -> {dst.dtype}"
        )
    if src.numel() != dst.numel() or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("to_low_precision needs contiguous tensors with the same numel")
    if src.device.type != "cpu" or dst.device.type != "cpu":
        raise ValueError(f"to_low_precision needs CPU tensors, got {src.device} -> {dst.device}")
    check_storage("to_low_precision src", src)
    check_storage("to_low_precision dst", dst)
    kernel = resolve_backend(backend)
    if kernel is None:
        dst.view(-1).copy_(src.view(-1))
        return
    to16 = kernel.to_16
    sp, dp, ok = src.data_ptr(), dst.data_ptr(), _KIND[dst.dtype]

    def part(lo: int, hi: int) -> None:
        to16(sp, dp, ok, lo, hi)

    if threads is None:
        part(0, src.numel())
    else:
        threads.run(src.numel(), part)
