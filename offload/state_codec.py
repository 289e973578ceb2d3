"""Compressed Adam moments: the storage formats, their sizes, and the PyTorch codec.

``offload.optimizer.state_precision`` chooses how exp_avg and exp_avg_sq are kept on
their home tier (host memory or NVMe) between steps; the master stays fp32:

    fp32   4 + 4 B/param   today's format, bit-identical results (the default)
    bf16   2 + 2 B/param   each moment rounded to nearest even bf16
    int8   1 + 1 B/param   8-bit codes in blocks of ``BLOCK`` elements with one fp32
           (+ 8 B per block)  scale per block and moment: 1.016 B/param each

A compressed moment piece of ``n`` elements is one flat uint8 tensor of
``moment_nbytes(n, precision)`` bytes (bf16: the 2n bytes of a bf16 tensor; int8:
the n codes, padded to 4 bytes, then ceil(n / BLOCK) fp32 scales). The C kernel
(_adam_kernel.c, ``tz_adam_step_q``) decodes, updates and re-encodes in its one pass;
this module is the same arithmetic in PyTorch, used as the kernel's reference in
tests, as the PyTorch fallback, and for whole-shard conversions off the step
(checkpoints, loading a checkpoint of another precision).

[Note: 8-bit moment codes]
Both moments use a small floating-point code relative to a per-block power-of-two
scale, the "dynamic" code idea of Dettmers et al. (8-bit Optimizers via Block-wise
Quantization, 2021): relative precision that stays constant over many orders of
magnitude, which Adam's second moment needs (a small v quantized to zero turns
m / (sqrt(v) + eps) into m / eps). Choices, and why:

- exp_avg: sign bit + 7-bit magnitude, 4 exponent bits and 3 mantissa bits with a
  linear (subnormal) range at the bottom. Normalised values y = |m| / scale in
  [0, 1.875]: code q = (e, f) is f * 2^-17 for e = 0, else (1 + f/8) * 2^(e - 15).
  Relative error <= 1/16 over 15 binades (4.5 decades), gradual underflow below.
- exp_avg_sq: stored as u = sqrt(v) (the kernel computes sqrt(v) for the update
  anyway) in an unsigned 8-bit code, 4 exponent and 4 mantissa bits: u / scale in
  [0, 1.9375], relative error of u <= 1/32 (of v <= 1/16); the sqrt halves the
  log-range, so 16 binades of u cover ~9.6 decades of v per block. Dettmers' code
  for v is unsigned and dynamic too; the sqrt domain is what lets 8 bits span it.
- Encoding rounds to the nearest code, ties to the even code, by integer arithmetic
  on the fp32 bits (vectorisable in C, identical in PyTorch); decoding is exact.
- The block scale is a power of two: the smallest 2^k with max|x| <= top * 2^k
  (top = 1.875 or 1.9375). Scaling by it is exact, so (a) the C kernel and this
  reference agree bit for bit, and (b) decode -> encode of decoded values gives back
  the same values (a block whose maximum decodes to exactly top/2 is re-expressed one
  binade up, value for value), which makes a checkpoint of decoded fp32 moments
  resume bit-exactly. A power-of-two scale costs at most one of the 15-16 binades of
  range and no relative precision (the code is floating-point).
- ``BLOCK`` = 256: the range a block needs is what the code's 15-16 binades give;
  smaller blocks would add scale bytes (4 / BLOCK per element) for no precision.
- The update uses the unrounded new moments of this step; only what is stored for
  the next step is rounded (as bitsandbytes' 8-bit Adam does).
- Non-finite moments: a block holding a NaN or inf gets a NaN scale, so every element
  of it decodes to NaN (visible, never silently finite).
- bf16 stores v itself (bf16 has fp32's exponent range); with beta2 = 0.999 a
  decaying v moves by less than half a bf16 ulp per step and so decays in steps, not
  smoothly (the int8 code's per-block rescaling does not have this: every element of
  a block moves with its scale). benchmarks/RESULTS.md measures both against fp32.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

StatePrecision = Literal["fp32", "bf16", "int8"]
STATE_PRECISIONS: tuple[str, ...] = get_args(StatePrecision)
BLOCK = 256  # elements per int8 block (one scale per block and moment)
SKIND = {"bf16": 1, "int8": 2}  # the C kernel's moment kinds (fp32 uses tz_adam_step)

# exp_avg: sign + e4m3 (bits 0-2 mantissa, 3-6 exponent); exp_avg_sq (as sqrt): e4m4
M_TOP = 1.875
U_TOP = 1.9375
_M_MANT, _U_MANT = 3, 4
_MIN_NORMAL_EXP = 113  # biased fp32 exponent of 2^-14, the codes' smallest normal value
_FLT_MIN = 2.0 ** -126


def check_precision(precision: str) -> None:
    if precision not in STATE_PRECISIONS:
        raise ValueError(f"state precision {precision!r} is unknown; allowed: "
                         f"{', '.join(STATE_PRECISIONS)}")


def moment_nbytes(numel: int, precision: str) -> int:
    """Bytes of one moment of ``numel`` elements stored in ``precision``."""
    check_precision(precision)
    if precision == "fp32":
        return 4 * numel
    if precision == "bf16":
        return 2 * numel
    return _codes_bytes(numel) + 4 * n_blocks(numel)


def bytes_per_param(precision: str) -> float:
    """Slow-tier bytes per parameter of both moments (large shards)."""
    return 2 * moment_nbytes(BLOCK * 1024, precision) / (BLOCK * 1024)


def n_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _codes_bytes(numel: int) -> int:
    return -(-numel // 4) * 4


def moment_dtype(precision: str) -> torch.dtype:
    """dtype of a stored moment tensor: fp32, else raw bytes (uint8)."""
    return torch.float32 if precision == "fp32" else torch.uint8


def split_int8(raw: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8[numel], scales fp32[n_blocks]) views of an int8 moment's bytes."""
    check_raw(raw, numel, "int8")
    off = _codes_bytes(numel)
    return raw[:numel], raw[off:off + 4 * n_blocks(numel)].view(torch.float32)


def check_raw(raw: torch.Tensor, numel: int, precision: str, name: str = "moment") -> None:
    want = moment_nbytes(numel, precision)
    if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() != want:
        raise ValueError(f"{precision} {name} of {numel} elements must be a flat uint8 "
                         f"tensor of {want} bytes; got {raw.dtype} {tuple(raw.shape)}")
    if not raw.is_contiguous():
        raise ValueError(f"{precision} {name} must be contiguous")


# ------------------------------------------------------------------ the codes
def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2.0 ** k as fp32 for integer k in [-126, 127] (exact, built from the bits)."""
    return ((k + 127).to(torch.int32) << 23).view(torch.float32)


def _block_scale(absmax: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1 / scale) of each block: the smallest power of two 2^k with absmax <= top * 2^k,
    k capped at 127 (moments beyond 2^127 clamp to the top code); (0, 0) for a zero or
    subnormal absmax (the C kernel runs with denormals-are-zero). Both are built from the
    exponent bits, so they are exact (1 / 2^127 is taken as 2^-126: no subnormal)."""
    bits = absmax.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    limit = 0x700000 if top == M_TOP else 0x780000  # 1.875 / 1.9375 as fp32 mantissas
    k = torch.clamp(exp - 127 + (mant > limit).to(torch.int32), -126, 127)
    zero = exp == 0
    scale = torch.where(zero, 0.0, _pow2(k))
    inv = torch.where(zero, 0.0, _pow2(torch.clamp(-k, min=-126)))
    return scale, inv


def _flush(x: torch.Tensor) -> torch.Tensor:
    """Subnormals as zero, as the C kernel's flush-to-zero / denormals-are-zero mode does."""
    return torch.where(x.abs() < _FLT_MIN, torch.zeros_like(x), x)


def _encode_mag(y: torch.Tensor, mant_bits: int) -> torch.Tensor:
    """Code (int32) of magnitudes y >= 0 (fp32, already divided by the scale): nearest code,
    ties to even, clamped to the top code. Subnormal y counts as 0 (as in the C kernel)."""
    top = (1 << (4 + mant_bits)) - 1
    bits = y.view(torch.int32)
    shift = 23 - mant_bits
    rounded = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift
    normal = rounded - ((_MIN_NORMAL_EXP - 1) << mant_bits)
    sub = torch.round(y * float(2 ** (14 + mant_bits))).to(torch.int32)
    q = torch.where(y < 2.0 ** -14, sub, normal)
    return torch.clamp(q, 0, top)


def _decode_mag(q: torch.Tensor, mant_bits: int) -> torch.Tensor:
    q = q.to(torch.int32)
    e = q >> mant_bits
    f = q & ((1 << mant_bits) - 1)
    normal = ((q + ((_MIN_NORMAL_EXP - 1) << mant_bits)) << (23 - mant_bits)).view(torch.float32)
    sub = f.to(torch.float32) * float(2.0 ** -(14 + mant_bits))
    return torch.where(e == 0, sub, normal)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x (1D fp32) padded with zeros to whole blocks, as [n_blocks, BLOCK]."""
    n = x.numel()
    pad = n_blocks(n) * BLOCK - n
    return torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)


def _nonfinite_blocks(b: torch.Tensor) -> torch.Tensor:
    return (~torch.isfinite(b)).any(dim=1)


def encode_m(m: torch.Tensor, out: torch.Tensor) -> None:
    """exp_avg (fp32, 1D) -> its int8 bytes ``out`` (see [Note: 8-bit moment codes])."""
    n = m.numel()
    codes, scales = split_int8(out, n)
    b = _flush(_blocks(m.detach().float()))
    absmax = b.abs().amax(dim=1)
    scale, inv = _block_scale(absmax, M_TOP)
    q = _encode_mag(_flush(b.abs() * inv[:, None]), _M_MANT)
    q = torch.where((b < 0) & (q > 0), q | 0x80, q)
    codes.copy_(q.view(-1)[:n].to(torch.uint8))
    scales.copy_(torch.where(_nonfinite_blocks(b), float("nan"), scale))


def decode_m(raw: torch.Tensor, out: torch.Tensor) -> None:
    """int8 bytes of exp_avg -> fp32 ``out``."""
    n = out.numel()
    codes, scales = split_int8(raw, n)
    q = codes.to(torch.int32)
    mag = _decode_mag(q & 0x7F, _M_MANT)
    val = torch.where(q >= 0x80, -mag, mag)
    out.copy_(_flush(_blocks(val) * scales[:, None]).view(-1)[:n])


def encode_v(v: torch.Tensor, out: torch.Tensor) -> None:
    """exp_avg_sq (fp32, 1D, >= 0) -> int8 bytes of sqrt(v)."""
    n = v.numel()
    codes, scales = split_int8(out, n)
    b = _blocks(torch.sqrt(_flush(v.detach().float())))
    absmax = b.amax(dim=1)
    scale, inv = _block_scale(absmax, U_TOP)
    q = _encode_mag(_flush(b * inv[:, None]), _U_MANT)
    codes.copy_(q.view(-1)[:n].to(torch.uint8))
    scales.copy_(torch.where(_nonfinite_blocks(b), float("nan"), scale))


def decode_v(raw: torch.Tensor, out: torch.Tensor) -> None:
    """int8 bytes of exp_avg_sq -> fp32 v = u * u (u the decoded sqrt(v), rounded once)."""
    n = out.numel()
    codes, scales = split_int8(raw, n)
    u = _flush(_blocks(_decode_mag(codes, _U_MANT)) * scales[:, None])
    out.copy_(_flush(u * u).view(-1)[:n])


def encode(kind: str, value: torch.Tensor, out: torch.Tensor, precision: str) -> None:
    """fp32 moment ``value`` of ``kind`` ("exp_avg" / "exp_avg_sq") -> stored bytes ``out``."""
    check_raw(out, value.numel(), precision, kind)
    if precision == "bf16":
        out.view(torch.bfloat16).copy_(value)
    elif kind == "exp_avg":
        encode_m(value, out)
    else:
        encode_v(value, out)


def decode(kind: str, raw: torch.Tensor, out: torch.Tensor, precision: str) -> None:
    """Stored bytes ``raw`` of moment ``kind`` -> fp32 ``out`` (exact)."""
    check_raw(raw, out.numel(), precision, kind)
    if precision == "bf16":
        out.copy_(raw.view(torch.bfloat16))
    elif kind == "exp_avg":
        decode_m(raw, out)
    else:
        decode_v(raw, out)
