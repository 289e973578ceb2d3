"""Adam hyper-parameters, their per-step scalars, and the pure-PyTorch update.

The PyTorch path is the fallback when the C kernel cannot be built, and the
reference for it: the same operations in the same order as
``torch.optim.Adam``'s single-tensor path (see [Note: Adam operation order] in
_adam_kernel.c). It works in chunks of ``TORCH_CHUNK`` elements so the
temporaries of the six ops stay in cache and memory is swept about once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .state_codec import moment_nbytes

LOW_PRECISION = (torch.bfloat16, torch.float16)
GRAD_DTYPES = (torch.float32, *LOW_PRECISION)
# 64 Ki elements: 256 KiB per fp32 operand, so the working set of one chunk
# (p, m, v, g and two temporaries) fits in a 2 MiB L2: the fastest of the chunk sizes
# tried (benchmarks/RESULTS.md, "Measurements behind design choices").
TORCH_CHUNK = 1 << 16


@dataclass(frozen=True)
class AdamHyper:
    """Hyper-parameters of one Adam/AdamW update (validated on construction)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw: bool = True  # True: decoupled weight decay (AdamW); False: L2 added to the gradient

    def __post_init__(self) -> None:
        checks = (
            ("lr", self.lr, self.lr >= 0.0, ">= 0"),
            ("beta1", self.beta1, 0.0 <= self.beta1 < 1.0, "in [0, 1)"),
            ("beta2", self.beta2, 0.0 <= self.beta2 < 1.0, "in [0, 1)"),
            ("eps", self.eps, self.eps >= 0.0, ">= 0"),
            ("weight_decay", self.weight_decay, self.weight_decay >= 0.0, ">= 0"),
        )
        for name, value, ok, allowed in checks:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
                raise ValueError(
                    f"Adam {name}={value!r} is invalid; it must be finite and {allowed}"
                )


@dataclass(frozen=True)
class StepScalars:
    """The per-step scalars, computed in double exactly as torch's single-tensor Adam does."""

    step_size: float  # lr / (1 - beta1**step)
    bc2_sqrt: float  # (1 - beta2**step) ** 0.5
    decay: float  # 1 - lr * weight_decay


def step_scalars(hyper: AdamHyper, step: float) -> StepScalars:
    if not (math.isfinite(step) and step >= 1):
        raise ValueError(f"Adam step={step!r} is invalid; it counts this update and must be >= 1")
    bc1 = 1 - hyper.beta1**step
    bc2 = 1 - hyper.beta2**step
    return StepScalars(
        step_size=hyper.lr / bc1,
        bc2_sqrt=bc2**0.5,
        decay=1 - hyper.lr * hyper.weight_decay,
    )


def check_storage(name: str, t: torch.Tensor) -> None:
    """ValueError unless `t`'s storage holds its numel() elements from its data pointer.

    The C kernel trusts data_ptr() + numel() elements; a tensor whose storage was
    shrunk (resize_ on a shared storage, set_) would let it run past the end.
    """
    n = t.numel()
    if n and (t.storage_offset() + n) * t.element_size() > t.untyped_storage().nbytes():
        raise ValueError(
            f"{name} views {n} elements at offset {t.storage_offset()} of a "
            f"{t.untyped_storage().nbytes()}-byte storage; it runs past its storage"
        )


def check_flat(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    shadow: torch.Tensor | None,
    *,
    state: str = "fp32",
) -> None:
    """Raise ValueError naming the operand unless all are flat-compatible.

    Flat-compatible: contiguous CPU tensors of one numel, each within its storage, fp32
    master (or bf16: [Note: bf16 master weights] in bf16_master.py), grad fp32/bf16/fp16;
    the moments fp32 of that numel, or with a compressed ``state`` precision flat uint8
    tensors of state_codec.moment_nbytes(numel) bytes. Runs before every kernel call (see
    run_prepared): the C kernel touches exactly n elements (bytes) from each data pointer
    and nothing checks after.
    """
    n = master.numel()
    moment = torch.float32 if state == "fp32" else torch.uint8
    moment_numel = n if state == "fp32" else moment_nbytes(n, state)
    named: list[tuple[str, torch.Tensor, tuple[torch.dtype, ...]]] = [
        ("master", master, (torch.float32, torch.bfloat16)),  # bf16: bf16_master.py
        ("exp_avg", exp_avg, (moment,)),
        ("exp_avg_sq", exp_avg_sq, (moment,)),
        ("grad", grad, GRAD_DTYPES),
    ]
    if shadow is not None:
        named.append(("shadow", shadow, LOW_PRECISION))
    for name, t, dtypes in named:
        if not t.is_cpu:  # (cheaper than building t.device)
            raise ValueError(f"Adam {name} is on {t.device}; the CPU Adam needs CPU tensors")
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d) for d in dtypes)
            what = f" (state precision {state})" if state != "fp32" else ""
            raise ValueError(f"Adam {name} has dtype {t.dtype}; allowed{what}: {allowed}")
        if state != "fp32" and name.startswith("exp_avg"):
            if t.numel() != moment_numel:
                raise ValueError(f"Adam {name} has {t.numel()} elements; {moment_numel} "
                                 f"expected for a master of {n} ({state} moments)")
        elif t.numel() != n:
            raise ValueError(f"Adam {name} has {t.numel()} elements; master has {n}")
        if not t.is_contiguous():
            raise ValueError(f"Adam {name} is not contiguous; pass a contiguous (flat) tensor")
        check_storage(f"Adam {name}", t)
        if t.requires_grad and t.is_leaf is False:
            raise ValueError(f"Adam {name} is part of an autograd graph; pass .detach()ed tensors")
    for a, b in ((master, exp_avg), (master, exp_avg_sq), (exp_avg, exp_avg_sq)):
        if n and a.data_ptr() == b.data_ptr():
            raise ValueError("Adam master, exp_avg and exp_avg_sq must be distinct buffers")


@torch.no_grad()
def torch_update(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    hyper: AdamHyper,
    step: float,
    grad_scale: float = 1.0,
    shadow: torch.Tensor | None = None,
) -> None:
    """One Adam/AdamW update with PyTorch ops, in place; flat tensors already checked."""
    s = step_scalars(hyper, step)
    p_all, m_all, v_all = master.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    g_all = grad.view(-1)
    o_all = shadow.view(-1) if shadow is not None else None
    n = p_all.numel()
    for lo in range(0, n, TORCH_CHUNK):
        hi = min(n, lo + TORCH_CHUNK)
        p, m, v = p_all[lo:hi], m_all[lo:hi], v_all[lo:hi]
        g = g_all[lo:hi].float()
        if grad_scale != 1.0:
            g = g * grad_scale
        if hyper.weight_decay != 0:
            if hyper.adamw:
                p.mul_(s.decay)
            else:
                g = g.add(p, alpha=hyper.weight_decay)
        m.lerp_(g, 1 - hyper.beta1)
        v.mul_(hyper.beta2).addcmul_(g, g, value=1 - hyper.beta2)
        denom = (v.sqrt() / s.bc2_sqrt).add_(hyper.eps)
        p.addcdiv_(m, denom, value=-s.step_size)
        if o_all is not None:
            o_all[lo:hi].copy_(p)
