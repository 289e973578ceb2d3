"""Compressed Adam moments (offload/state_codec.py, tz_adam_step_q in _adam_kernel.c).

Exact: the kernel's stored codes and scales equal the PyTorch reference's bit for bit
(set up so the new moments are known exactly: beta1 = beta2 = 0 makes m = g and v = g*g;
g = decoded m keeps m), for tail sizes and block boundaries, whatever the threads' split.
Tolerance of the update against the fp32 kernel, 50 steps, gradients of per-element
scales spread over e^(+-6): max |p - p_fp32| <= 0.25 * lr * steps for int8 (measured
0.10) and <= 0.02 * lr * steps for bf16 (measured 0.004); the first step is identical
(its stored moments are zero, and the update uses the unrounded new moments).
"""

from __future__ import annotations

import pytest
import torch

from tierzero.offload import AdamHyper, AdamThreads, adam_update, kernel_status
from tierzero.offload import state_codec as sc
from tierzero.offload.adam_build import compiled_kernel

HAS_KERNEL = compiled_kernel() is not None
needs_kernel = pytest.mark.skipif(not HAS_KERNEL,
                                  reason=f"C kernel unavailable here: {kernel_status()}")
SIZES = [1, 7, 255, 256, 257, 511, 512, 1000, 3 * 256 + 5]
PRECISIONS = ["bf16", "int8"]


def _wide(n: int, seed: int) -> torch.Tensor:
    """Values over many orders of magnitude, both signs, a few exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(4 * torch.randn(n, generator=gen))
    x[::17] = 0.0
    return x


def _zeros(n: int, prec: str) -> torch.Tensor:
    return torch.zeros(sc.moment_nbytes(n, prec), dtype=torch.uint8)


def test_sizes_and_bytes_per_param() -> None:
    assert sc.moment_nbytes(1000, "fp32") == 4000
    assert sc.moment_nbytes(1000, "bf16") == 2000
    assert sc.moment_nbytes(1000, "int8") == 1000 + 4 * 4
    assert sc.moment_nbytes(257, "int8") == 260 + 4 * 2  # codes padded to 4 bytes
    assert sc.bytes_per_param("fp32") == 8
    assert sc.bytes_per_param("bf16") == 4
    assert sc.bytes_per_param("int8") == pytest.approx(2 + 8 / 256)
    with pytest.raises(ValueError, match="allowed: fp32, bf16, int8"):
        sc.moment_nbytes(4, "int4")


@needs_kernel
@pytest.mark.parametrize("n", SIZES)
def test_int8_kernel_encodes_like_the_reference(n: int) -> None:
    """beta1 = beta2 = 0: the new m is g and the new v is fl(g*g) exactly, so the stored
    bytes must be the reference encoding of those, bit for bit."""
    g = _wide(n, n)
    p, m, v = torch.randn(n), _zeros(n, "int8"), _zeros(n, "int8")
    adam_update(p, m, v, g, hyper=AdamHyper(beta1=0.0, beta2=0.0), step=1,
                backend="compiled", state="int8")
    want_m, want_v = _zeros(n, "int8"), _zeros(n, "int8")
    sc.encode_m(g, want_m)
    sc.encode_v(g * g, want_v)
    assert torch.equal(m, want_m)
    assert torch.equal(v, want_v)


@needs_kernel
@pytest.mark.parametrize("n", SIZES)
def test_int8_kernel_decodes_like_the_reference(n: int) -> None:
    """m: with g = decoded m, lerp keeps m exactly, so the codes come back unchanged (the
    reference's round trip too). v: with g = 0 and beta2 = 0.5, v halves exactly."""
    x = _wide(n, n + 1)
    raw_m, raw_v = _zeros(n, "int8"), _zeros(n, "int8")
    sc.encode_m(x, raw_m)
    sc.encode_v(x * x, raw_v)
    m_dec, v_dec = torch.empty(n), torch.empty(n)
    sc.decode_m(raw_m, m_dec)
    sc.decode_v(raw_v, v_dec)
    again = _zeros(n, "int8")
    sc.encode_m(m_dec, again)
    assert torch.equal(again, raw_m)  # decode -> encode gives the codes back

    m = raw_m.clone()
    adam_update(torch.randn(n), m, raw_v.clone(), m_dec, hyper=AdamHyper(beta1=0.9), step=3,
                backend="compiled", state="int8")
    assert torch.equal(m, raw_m)

    v = raw_v.clone()
    adam_update(torch.randn(n), raw_m.clone(), v, torch.zeros(n),
                hyper=AdamHyper(beta2=0.5), step=3, backend="compiled", state="int8")
    want = _zeros(n, "int8")
    sc.encode_v(v_dec * 0.5, want)
    assert torch.equal(v, want)


@needs_kernel
@pytest.mark.parametrize("n", [1, 255, 1000])
def test_bf16_kernel_rounds_like_the_reference(n: int) -> None:
    """bf16 moments are rounded stochastically with the step's counter-based bits."""
    g = _wide(n, 5)
    p, m, v = torch.randn(n), _zeros(n, "bf16"), _zeros(n, "bf16")
    adam_update(p, m, v, g, hyper=AdamHyper(beta1=0.0, beta2=0.0), step=7,
                backend="compiled", state="bf16")
    want_m, want_v = _zeros(n, "bf16"), _zeros(n, "bf16")
    sc.encode("exp_avg", g, want_m, "bf16", seed=sc.step_seed(7))
    sc.encode("exp_avg_sq", g * g, want_v, "bf16", seed=sc.step_seed(7))
    assert torch.equal(m, want_m)
    assert torch.equal(v, want_v)
    # stochastic: neither always down nor always up, and a bf16 value stays as it is
    up = m.view(torch.bfloat16).float().abs() > g.abs()
    nonzero = g != 0
    if n > 100:
        assert 0 < int((up & nonzero).sum()) < int(nonzero.sum())
    exact = g.to(torch.bfloat16).float()
    kept = _zeros(n, "bf16")
    sc.encode("exp_avg", exact, kept, "bf16", seed=123)
    assert torch.equal(kept.view(torch.bfloat16).float(), exact)


@pytest.mark.parametrize("prec", PRECISIONS)
def test_round_trip_is_exact(prec: str) -> None:
    n = 1000
    raw = _zeros(n, prec)
    sc.encode("exp_avg_sq", _wide(n, 3).abs(), raw, prec, seed=1)
    dec = torch.empty(n)
    sc.decode("exp_avg_sq", raw, dec, prec)
    again = _zeros(n, prec)
    sc.encode("exp_avg_sq", dec, again, prec, seed=99)
    assert torch.equal(again, raw)


def test_nonfinite_block_decodes_to_nan() -> None:
    x = torch.ones(600)
    x[300] = float("inf")
    raw = _zeros(600, "int8")
    sc.encode_m(x, raw)
    out = torch.empty(600)
    sc.decode_m(raw, out)
    assert torch.isnan(out[256:512]).all()
    assert torch.equal(out[:256], x[:256]) and torch.equal(out[512:], x[512:])


def _run(prec: str, backend: str, n: int, steps: int, *, threads: AdamThreads | None = None,
         gdtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    scales = torch.exp(2 * torch.randn(n, generator=gen))
    if prec == "fp32":
        m, v = torch.zeros(n), torch.zeros(n)
    else:
        m, v = _zeros(n, prec), _zeros(n, prec)
    shadow = torch.empty(n, dtype=torch.bfloat16)
    hyper = AdamHyper(lr=1e-3, weight_decay=0.01)
    first = None
    for step in range(1, steps + 1):
        g = (torch.randn(n, generator=gen) * scales).to(gdtype)
        adam_update(p, m, v, g, hyper=hyper, step=step, backend=backend, shadow=shadow,
                    threads=threads, state=prec)
        if step == 1:
            first = p.clone()
    assert first is not None
    return p, m, v, shadow, first


@needs_kernel
@pytest.mark.parametrize("prec", PRECISIONS)
def test_update_tracks_fp32_within_tolerance(prec: str) -> None:
    n, steps, lr = 4096 + 3, 50, 1e-3
    p, _, _, shadow, first = _run(prec, "compiled", n, steps)
    ref, _, _, _, ref_first = _run("fp32", "compiled", n, steps)
    assert torch.equal(first, ref_first)
    bound = (0.25 if prec == "int8" else 0.02) * lr * steps
    diff = float((p - ref).abs().max())
    assert diff <= bound, f"{prec}: max |p - p_fp32| = {diff:.3g} > {bound:.3g}"
    assert diff > 0  # the moments were rounded: something must differ
    assert torch.equal(shadow, p.to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("prec", PRECISIONS)
def test_threads_and_torch_fallback_agree(prec: str) -> None:
    """The threads split int8 shards on block boundaries: bit-identical to one thread. The
    PyTorch fallback (decode, torch's ops, encode) differs from the kernel by an ulp where
    ATen's sqrt does ([Note: Adam operation order]), which can move a code by one."""
    n = 70000 + 13  # above two threads' minimum, not a multiple of the block
    threads = AdamThreads(2)
    try:
        a = _run(prec, "compiled", n, 3, threads=threads, gdtype=torch.bfloat16)
    finally:
        threads.close()
    b = _run(prec, "compiled", n, 3, gdtype=torch.bfloat16)
    c = _run(prec, "torch", n, 3, gdtype=torch.bfloat16)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    for kind, x, y in (("exp_avg", a[1], c[1]), ("exp_avg_sq", a[2], c[2])):
        assert float((x != y).float().mean()) < 1e-3, kind
        dx, dy = torch.empty(n), torch.empty(n)
        sc.decode(kind, x, dx, prec)
        sc.decode(kind, y, dy, prec)
        torch.testing.assert_close(dx, dy, rtol=0.07, atol=0)  # at most one code apart
    torch.testing.assert_close(a[0], c[0], rtol=0, atol=1e-6)


def test_bad_moment_buffers_are_refused() -> None:
    n = 300
    p, g = torch.zeros(n), torch.zeros(n)
    with pytest.raises(ValueError, match="exp_avg has 300 elements; 308 expected"):
        adam_update(p, torch.zeros(n, dtype=torch.uint8), _zeros(n, "int8"), g,
                    hyper=AdamHyper(), step=1, state="int8")
    with pytest.raises(ValueError, match=r"exp_avg_sq has dtype torch.float32; allowed \(state"):
        adam_update(p, _zeros(n, "bf16"), torch.zeros(n), g, hyper=AdamHyper(), step=1,
                    state="bf16")
    with pytest.raises(ValueError, match="state precision 'fp8' is unknown"):
        adam_update(p, torch.zeros(n), torch.zeros(n), g, hyper=AdamHyper(), step=1,
                    state="fp8")
