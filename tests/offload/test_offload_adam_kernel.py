"""The flat Adam kernel (compiled C and PyTorch fallback) against torch.optim.Adam/AdamW.

Tolerance: after 100 steps every element of params, exp_avg and exp_avg_sq is
within 1e-6 * max|reference| of torch's single-tensor Adam. Why not 0: the C
kernel computes sqrt correctly rounded (IEEE), while ATen's vectorised CPU
sqrt is off by one ulp on ~0.6% of inputs, and ATen's scalar tail (n % 32
elements) does not fuse multiply-adds that its vector body fuses. One ulp
(6e-8 relative) per step, not systematically signed, stays far below 1e-6
after 100 steps (measured: <= 3e-7 relative); a real error (wrong operation
order, bias correction, decay placement) is orders of magnitude larger.
The PyTorch fallback does torch's own ops, so it is checked for equality.
"""

from __future__ import annotations

import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierzero.offload import AdamHyper, AdamThreads, adam_update, kernel_status, to_low_precision
from tierzero.offload.adam_build import compiled_kernel

REL_TOL = 1e-6
HAS_KERNEL = compiled_kernel() is not None
BACKENDS = [
    pytest.param("compiled", marks=pytest.mark.skipif(
        not HAS_KERNEL, reason=f"C kernel unavailable here: {kernel_status()}")),
    "torch",
]
HYPERS = {
    "adamw-default": AdamHyper(),
    "adamw-wd-eps-betas": AdamHyper(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1),
    "adam-l2": AdamHyper(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.05, adamw=False),
    "adamw-beta1-low": AdamHyper(lr=1e-2, beta1=0.3, beta2=0.9, weight_decay=0.01),  # lerp w>=0.5
}


def _reference(p0: torch.Tensor, hyper: AdamHyper) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    ref = p0.clone().requires_grad_()
    cls = torch.optim.AdamW if hyper.adamw else torch.optim.Adam
    opt = cls([ref], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
              weight_decay=hyper.weight_decay, foreach=False)
    return ref, opt


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    bound = REL_TOL * max(want.abs().max().item(), 1e-30)
    diff = (got - want).abs().max().item()
    assert diff <= bound, f"{name}: max abs diff {diff:.3g} > {bound:.3g} (1e-6 relative)"


def _run(n: int, hyper: AdamHyper, backend: str, gdtype: torch.dtype, *, steps: int = 100,
         grad_scale: float = 1.0, threads: AdamThreads | None = None) -> None:
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen)
    ref, opt = _reference(p0, hyper)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, steps + 1):
        g = (torch.randn(n, generator=gen) * 0.1).to(gdtype)
        ref.grad = g.float() * grad_scale if grad_scale != 1.0 else g.float()
        opt.step()
        adam_update(p, m, v, g, hyper=hyper, step=step, grad_scale=grad_scale, threads=threads,
                    backend=backend)  # type: ignore[arg-type]
    st = opt.state[ref]
    _close("param", p, ref.detach())
    _close("exp_avg", m, st["exp_avg"])
    _close("exp_avg_sq", v, st["exp_avg_sq"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hyper_name", sorted(HYPERS))
@pytest.mark.parametrize("n", [1, 7, 4097])
def test_matches_torch_fp32(n: int, hyper_name: str, backend: str) -> None:
    _run(n, HYPERS[hyper_name], backend, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hyper_name", ["adamw-wd-eps-betas", "adam-l2"])
def test_matches_torch_large_threaded(hyper_name: str, backend: str) -> None:
    with AdamThreads(2) as threads:
        _run(1_000_003, HYPERS[hyper_name], backend, torch.float32, threads=threads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gdtype", [torch.bfloat16, torch.float16])
def test_low_precision_grads(gdtype: torch.dtype, backend: str) -> None:
    _run(4097, HYPERS["adamw-wd-eps-betas"], backend, gdtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
def test_grad_scale_folded(gdtype: torch.dtype, backend: str) -> None:
    # e.g. 1/loss_scale * clip coefficient
    _run(4097, HYPERS["adam-l2"], backend, gdtype, grad_scale=0.37 / 1024)


def test_torch_backend_is_bit_identical() -> None:
    # a step of about 1e-9: the masters stay spread over their 13 decades
    hyper = AdamHyper(lr=1e-9, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)
    p0 = torch.randn(4097)
    ref, opt = _reference(p0, hyper)
    p, m, v = p0.clone(), torch.zeros(4097), torch.zeros(4097)
    for step in range(1, 21):
        g = torch.randn(4097)
        ref.grad = g.clone()
        opt.step()
        adam_update(p, m, v, g, hyper=hyper, step=step, backend="torch")
    assert torch.equal(p, ref.detach())
    assert torch.equal(m, opt.state[ref]["exp_avg"])
    assert torch.equal(v, opt.state[ref]["exp_avg_sq"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shadow_bit_exact(gdtype: torch.dtype, sdtype: torch.dtype, backend: str) -> None:
    n = 70_001
    p = torch.randn(n) * 3
    m, v = torch.zeros(n), torch.zeros(n)
    shadow = torch.empty(n, dtype=sdtype)
    with AdamThreads(2) as threads:
        for step in range(1, 4):
            g = torch.randn(n).to(gdtype)
            adam_update(p, m, v, g, hyper=HYPERS["adamw-default"], step=step, shadow=shadow,
                        threads=threads, backend=backend)  # type: ignore[arg-type]
            assert torch.equal(shadow.view(torch.int16), p.to(sdtype).view(torch.int16))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sdtype", [torch.bfloat16, torch.float16])
def test_low_precision_rounding_all_classes(sdtype: torch.dtype, backend: str) -> None:
    # Random bit patterns cover normals, subnormals, infinities, overflow to fp16 inf and
    # exact ties; NaNs must stay NaN (payload bits may differ, as they may in torch).
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), dtype=torch.int64).to(torch.int32)
    src = bits.view(torch.float32)
    ties = torch.tensor([1.00390625, 1.01171875, 65520.0, 65504.0, -0.0, 1e-45])
    src = torch.cat([src, ties, ties * 3.0517578125e-05])
    dst = torch.empty(src.numel(), dtype=sdtype)
    to_low_precision(src, dst, backend=backend)  # type: ignore[arg-type]
    want = src.to(sdtype)
    nan = torch.isnan(src)
    assert torch.equal(torch.isnan(dst), nan)
    assert torch.equal(dst[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_zero_elements_is_a_no_op() -> None:
    e = torch.empty(0)
    adam_update(e, e.clone(), e.clone(), e.clone(), hyper=AdamHyper(), step=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grad": torch.zeros(5)}, "grad has 5 elements; master has 4"),
        ({"grad": torch.zeros(4, dtype=torch.float64)}, "grad has dtype torch.float64"),
        ({"exp_avg": torch.zeros(4, dtype=torch.bfloat16)}, "exp_avg has dtype torch.bfloat16"),
        ({"master": torch.zeros(8)[::2]}, "master is not contiguous"),
        ({"shadow": torch.zeros(4)}, "shadow has dtype torch.float32"),
        ({"step": 0}, "step=0 is invalid"),
        ({"grad_scale": float("nan")}, "grad_scale=nan is invalid"),
        ({"backend": "avx"}, "backend='avx' is unknown"),
    ],
)
def test_bad_input_named(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "master": torch.zeros(4), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4),
        "grad": torch.zeros(4), "hyper": AdamHyper(), "step": 1,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        adam_update(**args)  # type: ignore[arg-type]


def test_shared_buffers_rejected() -> None:
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="distinct buffers"):
        adam_update(t, t, torch.zeros(4), torch.zeros(4), hyper=AdamHyper(), step=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"lr": -1.0}, "lr=-1.0"), ({"beta1": 1.0}, "beta1=1.0"), ({"beta2": -0.1}, "beta2"),
     ({"eps": float("inf")}, "eps=inf"), ({"weight_decay": -1e-3}, "weight_decay")],
)
def test_bad_hyper_named(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdamHyper(**kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(not HAS_KERNEL, reason="C kernel unavailable here")
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 3000),
    lr=st.floats(1e-5, 1e-1),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.5, 0.9999),
    eps=st.floats(1e-10, 1e-3),
    weight_decay=st.sampled_from([0.0, 1e-4, 0.1]),
    adamw=st.booleans(),
    grad_scale=st.sampled_from([1.0, 0.5, 3.0e-4]),
    gdtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    start_step=st.integers(1, 10_000),
)
def test_compiled_matches_fallback_property(  # noqa: PLR0917 - hypothesis passes by keyword
    n: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    adamw: bool, grad_scale: float, gdtype: torch.dtype, start_step: int,
) -> None:
    # Any hyper-parameters, either lerp branch, late steps (bias corrections ~1): the two
    # backends agree to 1e-6 relative after 3 steps (the fallback is torch's own ops).
    hyper = AdamHyper(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                      adamw=adamw)
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    state = {b: (p.clone(), m.clone(), v.clone(), torch.empty(n, dtype=torch.bfloat16))
             for b in ("compiled", "torch")}
    for step in range(start_step, start_step + 3):
        g = (torch.randn(n, generator=gen) * 1e-2).to(gdtype)
        for b, (pp, mm, vv, sh) in state.items():
            adam_update(pp, mm, vv, g, hyper=hyper, step=step, grad_scale=grad_scale,
                        shadow=sh, backend=b)  # type: ignore[arg-type]
    for i, name in enumerate(("param", "exp_avg", "exp_avg_sq")):
        _close(name, state["compiled"][i], state["torch"][i])
    c, t = state["compiled"], state["torch"]
    assert torch.equal(c[3].view(torch.int16), c[0].to(torch.bfloat16).view(torch.int16))
    assert torch.equal(t[3].view(torch.int16), t[0].to(torch.bfloat16).view(torch.int16))


@pytest.mark.skipif(not HAS_KERNEL, reason="C kernel unavailable here")
def test_subnormals_flushed_inside_kernel_only() -> None:
    # See [Note: subnormals] in offload/_adam_kernel.c.
    n = 1 << 16
    hyper = AdamHyper(lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen)
    m0 = torch.randn(n, generator=gen) * 1e-3
    v0 = torch.rand(n, generator=gen) * 1e-6
    m0[::2] = 3e-39  # half the moments subnormal, as after long runs of zero gradients
    v0[::2] = 2e-39
    g = torch.randn(n, generator=gen) * 1e-3
    g[::2] = 0.0
    ref, opt = _reference(p0, hyper)
    ref.grad = g.clone()
    opt.step()  # initialise torch's state, then overwrite it with ours
    ref.data.copy_(p0)
    st = opt.state[ref]
    st["exp_avg"].copy_(m0)
    st["exp_avg_sq"].copy_(v0)
    st["step"].fill_(500)
    opt.step()
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    adam_update(p, m, v, g, hyper=hyper, step=501, backend="compiled")
    _close("param", p, ref.detach())
    _close("exp_avg", m, st["exp_avg"])
    _close("exp_avg_sq", v, st["exp_avg_sq"])
    # The caller's floating-point mode is restored: torch still keeps subnormals here.
    assert (torch.tensor([3e-39]) * 1.0).item() != 0.0


@pytest.mark.skipif(not HAS_KERNEL, reason="C kernel unavailable here")
def test_fp16_subnormal_grads_are_not_flushed() -> None:
    n = 4097
    g = torch.full((n,), 3e-6).to(torch.float16)  # fp16 subnormal (< 6.1e-5)
    assert g[0].item() != 0.0
    p0 = torch.randn(n)
    ref, opt = _reference(p0, HYPERS["adamw-default"])
    ref.grad = g.float()
    opt.step()
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    adam_update(p, m, v, g, hyper=HYPERS["adamw-default"], step=1, backend="compiled")
    _close("exp_avg", m, opt.state[ref]["exp_avg"])
    _close("exp_avg_sq", v, opt.state[ref]["exp_avg_sq"])


@pytest.mark.skipif(not HAS_KERNEL, reason="C kernel unavailable here")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64", "i686", "i386"),
                    reason="flush-to-zero is set only on x86 ([Note: subnormals])")
def test_subnormal_state_is_flushed_so_it_costs_no_microcode_assists() -> None:
    # Without FTZ/DAZ a step over subnormal moments measured 17x slower here (a microcode
    # assist per operation; benchmarks/adam_bench.py measures it). What the kernel
    # guarantees, and what this checks without timing anything: subnormal moments are
    # read as zero and results that would be subnormal are written as zero, while
    # torch's ops (no FTZ) keep them.
    n = 4096
    p = torch.randn(n)
    m, v, g = torch.full((n,), 1e-40), torch.full((n,), 1e-40), torch.zeros(n)
    assert float(m[0]) != 0.0  # a subnormal float32, not already flushed
    ref_m, ref_v = m.clone(), v.clone()
    adam_update(p.clone(), m, v, g, hyper=AdamHyper(), step=1000, backend="compiled")
    adam_update(p.clone(), ref_m, ref_v, g.clone(), hyper=AdamHyper(), step=1000,
                backend="torch")
    assert torch.all(ref_m != 0) and torch.all(ref_v != 0)  # torch keeps subnormals
    assert torch.all(m == 0) and torch.all(v == 0)  # the kernel flushed them
    # normal values are untouched by the mode: the same step from 1e-20 matches torch
    m2, v2, rm2, rv2 = (torch.full((n,), 1e-20) for _ in range(4))
    q, rq = p.clone(), p.clone()
    adam_update(q, m2, v2, g, hyper=AdamHyper(), step=1000, backend="compiled")
    adam_update(rq, rm2, rv2, g.clone(), hyper=AdamHyper(), step=1000, backend="torch")
    _close("exp_avg", m2, rm2)
    _close("param", q, rq)


def _finite_fp16(n: int, seed: int) -> torch.Tensor:
    """n fp16 values of random bit patterns, every finite one likely: both signs, every
    exponent, subnormals and zeros included."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 0x7C00, (n,), generator=g, dtype=torch.int32)
    bits |= torch.randint(0, 2, (n,), generator=g, dtype=torch.int32) << 15
    return bits.to(torch.int16).view(torch.float16)


@pytest.mark.skipif(not HAS_KERNEL, reason="C kernel unavailable here")
@pytest.mark.parametrize("state", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("n", [1, 7, 513, 4099])
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("gdtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fp16_gradients_and_copies_are_their_fp32_values(state: str, n: int, workers: int,
                                                         gdtype: torch.dtype) -> None:
    """The update from an fp16 (or bf16) gradient equals, bit for bit, the update from the
    same values in fp32, and its fp16 copy out is torch's rounding of the new master:
    whichever way this build converts fp16 (in the loops, or a block at a time with F16C:
    [Note: fp16 through F16C] in offload/_adam_kernel.c), for lengths not a multiple of 8
    or of the F16C blocks' 512, split over threads. The gradients take every finite fp16 class,
    subnormals included; the masters span fp16's subnormals up past its overflow, so the
    longest run's copies hold subnormals (not flushed by the kernel's FTZ) and
    infinities."""
    from tierzero.offload import state_codec as sc

    g16 = _finite_fp16(n, seed=n).to(gdtype)  # bf16 and fp32: with fp16 copies out
    gen = torch.Generator().manual_seed(n + 1)
    mags = torch.pow(10.0, torch.empty(n).uniform_(-8.0, 5.0, generator=gen))
    p0 = torch.where(torch.rand(n, generator=gen) < 0.5, -mags, mags)
    # a step of about 1e-9: the masters stay spread over their 13 decades
    hyper = AdamHyper(lr=1e-9, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)

    def moments() -> tuple[torch.Tensor, torch.Tensor]:
        if state == "fp32":
            return torch.zeros(n), torch.zeros(n)
        nb = sc.moment_nbytes(n, state)
        return torch.zeros(nb, dtype=torch.uint8), torch.zeros(nb, dtype=torch.uint8)

    runs = {}
    with AdamThreads(workers) if workers > 1 else _no_pool() as pool:
        for kind in ("fp16", "fp32"):
            p, (m, v) = p0.clone(), moments()
            shadow = torch.empty(n, dtype=torch.float16) if kind == "fp16" else None
            for step in (1, 2):
                grad = g16 * (1 if step == 1 else -1)
                adam_update(p, m, v, grad if kind == "fp16" else grad.float(), hyper=hyper,
                            step=step, shadow=shadow, threads=pool, state=state,
                            backend="compiled")
            runs[kind] = (p, m, v, shadow)
    for a, b, name in zip(runs["fp16"][:3], runs["fp32"][:3], ("master", "exp_avg", "exp_avg_sq"),
                          strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    shadow = runs["fp16"][3]
    assert shadow is not None
    want = runs["fp32"][0].to(torch.float16)
    assert torch.equal(shadow.view(torch.int16), want.view(torch.int16))
    if n > 1000:
        assert bool((want.abs() < 6.1e-5).logical_and(want != 0).any())  # fp16 subnormals
        assert bool(want.isinf().any())


def test_fp16_to_fp32_conversion_is_exact_for_every_value() -> None:
    """Every finite fp16 value (all 63488 bit patterns) reaches the kernel's update as its
    exact fp32 value: with beta1 0, exp_avg after one step is the gradient itself."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32)
    g16 = bits.to(torch.int16).view(torch.float16)
    g16 = g16[torch.isfinite(g16)]
    n = g16.numel()
    assert n == 63488
    hyper = AdamHyper(lr=1e-3, beta1=0.0, beta2=0.999)
    m = torch.zeros(n)
    adam_update(torch.zeros(n), m, torch.zeros(n), g16, hyper=hyper, step=1)
    assert torch.equal(m.view(torch.int32), g16.float().view(torch.int32))


class _no_pool:
    """A context manager standing for no thread pool."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
