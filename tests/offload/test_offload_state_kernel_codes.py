"""The C kernel's int8 codes against the reference codec, exhaustively (state_codec.py).

The kernel decodes codes by arithmetic on their bits with AVX-512 ([Note: int8 decode by
arithmetic] in _adam_kernel.c), through tables of its own filled by that arithmetic without
([Note: int8 decode through a table without AVX-512]), and encodes by rounding fp32 bits;
each must agree with state_codec bit for bit, through the real update loop:

- decode: every one of the 256 codes of each moment, at several block scales, in every
  vector lane position. Made observable exactly: one nonzero code per block, g = 0,
  beta1 = 0.5 (new m = m / 2 exactly) and beta2 = 0.25 (new sqrt(v) = u / 2 exactly,
  because sqrt(fl(u * u)) = u in round-to-nearest), so the block's new scale, its largest
  magnitude, is half the kernel's decoded value.
- encode: beta1 = beta2 = 0 (new m = g, new sqrt(v) = |g|) on a sweep of every fp32 bit
  pattern with its low 13 bits zero, and its neighbours one ulp away, over [2^-24, 2]:
  every code value, every tie between two codes (to even), the linear range and its ties,
  values that round to zero or to the top code; blocks whose maximum maps to the top code
  exactly and blocks with an inexact factor; zero, subnormal and non-finite blocks (NaN
  scale; their codes do not matter); a tail.
"""

from __future__ import annotations

import pytest
import torch

from tierzero.offload import AdamHyper, adam_update, kernel_status
from tierzero.offload import state_codec as sc
from tierzero.offload.adam_build import compiled_kernel

pytestmark = pytest.mark.skipif(compiled_kernel() is None,
                                reason=f"C kernel unavailable here: {kernel_status()}")
GDTYPES = [torch.float32, torch.bfloat16]  # separate compiled loops (grad kinds 0 and 1)


def _raw(n: int) -> torch.Tensor:
    return torch.zeros(sc.moment_nbytes(n, "int8"), dtype=torch.uint8)


def _one_code_per_block(scale: float) -> tuple[torch.Tensor, int]:
    """int8 bytes of 256 blocks: block c holds code c at lane (37 c) % 256, zeros elsewhere."""
    n = 256 * sc.BLOCK
    raw = _raw(n)
    codes, scales = sc.split_int8(raw, n)
    blocks = codes.view(256, sc.BLOCK)
    c = torch.arange(256)
    blocks[c, (37 * c) % sc.BLOCK] = c.to(torch.uint8)
    scales.fill_(scale)
    return raw, n


@pytest.mark.parametrize("gdtype", GDTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.3, 7.5e5, 1e-12])
def test_every_code_decodes_like_the_reference(scale: float, gdtype: torch.dtype) -> None:
    raw, n = _one_code_per_block(scale)
    m_ref, v_ref = torch.empty(n), torch.empty(n)
    sc.decode_m(raw, m_ref)
    sc.decode_v(raw, v_ref)
    u_ref = sc.U_TABLE[torch.arange(256)] * scale  # the decoded sqrt(v) of each code
    m, v = raw.clone(), raw.clone()
    adam_update(torch.zeros(n), m, v, torch.zeros(n, dtype=gdtype),
                hyper=AdamHyper(beta1=0.5, beta2=0.25), step=1, backend="compiled",
                state="int8")
    m_scale = sc.split_int8(m, n)[1]
    v_scale = sc.split_int8(v, n)[1]
    want_m = m_ref.view(256, sc.BLOCK).abs().amax(dim=1) * 0.5
    assert torch.equal(m_scale, want_m)
    assert torch.equal(v_scale, u_ref * 0.5)
    assert torch.equal(v_ref.view(256, sc.BLOCK).amax(dim=1), u_ref * u_ref)  # premise


def _sweep() -> torch.Tensor:
    """Positive fp32 values: bit patterns k << 13 over [2^-24, 2] and +-1 ulp of each."""
    lo = torch.tensor(2.0 ** -24).view(torch.int32).item() >> 13
    hi = torch.tensor(2.0).view(torch.int32).item() >> 13
    k = torch.arange(lo, hi + 1, dtype=torch.int32) << 13
    bits = torch.stack([k - 1, k, k + 1], dim=1).reshape(-1)
    return bits.view(torch.float32)


def _sweep_blocks(top: float, gen: torch.Generator) -> torch.Tensor:
    """The sweep in blocks of 255 values plus one block maximum `top` (so the factor that
    maps it to the top code is exactly 1), random signs, then special blocks and a tail."""
    vals = _sweep()
    vals = vals[vals <= top]
    per = sc.BLOCK - 1
    pad = -len(vals) % per
    vals = torch.cat([vals, torch.zeros(pad)]).view(-1, per)
    lane = torch.randint(0, sc.BLOCK, (vals.shape[0],), generator=gen)
    blocks = torch.empty(vals.shape[0], sc.BLOCK)
    for i in range(vals.shape[0]):  # the maximum at a random lane of each block
        j = int(lane[i])
        blocks[i] = torch.cat([vals[i, :j], torch.tensor([top]), vals[i, j:]])
    sign = torch.where(torch.rand(blocks.shape, generator=gen) < 0.5, -1.0, 1.0)
    exact = blocks * sign
    # the same values with inexact factors top / absmax (block scales over many decades)
    inexact = exact * torch.exp(8 * torch.randn(blocks.shape[0], 1, generator=gen))
    special = torch.zeros(4, sc.BLOCK)
    special[1] = 2.0 ** -130  # subnormal block: flushed, scale 0
    special[2, 5], special[2, 9] = float("inf"), 1.0  # non-finite: NaN scale
    special[3, ::2] = -3.0  # equal maxima, both signs
    special[3, 1::2] = 3.0
    tail = exact[0, :77] * 1.7
    return torch.cat([exact.view(-1), inexact.view(-1), special.view(-1), tail])


@pytest.mark.parametrize("gdtype", GDTYPES)
@pytest.mark.parametrize("kind", ["exp_avg", "exp_avg_sq"])
def test_dense_sweep_encodes_like_the_reference(kind: str, gdtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(17)
    top = sc.M_TOP if kind == "exp_avg" else sc.U_TOP
    g = _sweep_blocks(top, gen).to(gdtype)
    if kind == "exp_avg_sq":  # keep g * g normal (smaller squares flush to zero anyway)
        g = torch.where(g.float().abs() < 2.0 ** -60, 0.0, g.float()).to(gdtype)
    n = g.numel()
    m, v = _raw(n), _raw(n)
    adam_update(torch.zeros(n), m, v, g, hyper=AdamHyper(beta1=0.0, beta2=0.0), step=1,
                backend="compiled", state="int8")
    want = _raw(n)
    gf = g.float()
    if kind == "exp_avg":
        sc.encode_m(gf, want)
        got = m
    else:
        sc.encode_v(gf * gf, want)
        got = v
    codes, scales = sc.split_int8(got, n)
    want_codes, want_scales = sc.split_int8(want, n)
    # a non-finite block decodes to NaN whatever its codes are (the reference and the kernel
    # code a NaN differently), so its codes are not compared; its scale must be NaN
    finite = ~want_scales.isnan().repeat_interleave(sc.BLOCK)[:n]
    bad = ((codes != want_codes) & finite).nonzero().view(-1)
    assert bad.numel() == 0, (f"{bad.numel()} codes differ, first at {int(bad[0])}: "
                              f"g={float(gf[bad[0]])!r} kernel {int(codes[bad[0]])} "
                              f"reference {int(want_codes[bad[0]])}")
    assert torch.equal(scales.isnan(), want_scales.isnan())
    assert torch.equal(scales.nan_to_num(), want_scales.nan_to_num())
    # the sweep reached every code (exp_avg never stores 0x80, a negative zero)
    assert len(torch.unique(want_codes)) == (255 if kind == "exp_avg" else 256)
