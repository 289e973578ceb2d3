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
Both moments use a small floating-point code relative to a per-block scale, the
"dynamic" code idea of Dettmers et al. (8-bit Optimizers via Block-wise Quantization,
2021): relative precision that stays constant over orders of magnitude, which Adam's
second moment needs (a small v quantized to zero turns m / (sqrt(v) + eps) into m / eps,
and Adam's update is scale-free per element, so every element needs the same relative
precision, not the same absolute one). Choices, and why:

- exp_avg: sign bit + 7-bit magnitude, 4 exponent and 3 mantissa bits with a linear
  (subnormal) range at the bottom: code (e, f) is f * 2^-17 for e = 0, else
  (1 + f/8) * 2^(e - 15), top 1.875. Relative error <= 1/16 over 15 binades, gradual
  underflow below.
- exp_avg_sq: stored as u = sqrt(v) (the kernel computes sqrt(v) for the update anyway)
  in an unsigned code with 4 exponent and 4 mantissa bits, top 1.9375: relative error
  of u <= 1/32; the sqrt halves the log-range, so 16 binades of u cover ~9.6 decades of
  v per block. Dettmers' code for v is unsigned and dynamic too; the sqrt domain is what
  lets 8 bits span it.
- The block scale is the block's largest magnitude (fp32), which maps to the top code:
  the block maximum is stored exactly each step, so what all elements of a block do
  together (v growing from zero after the start, decaying when gradients shrink) is
  tracked exactly and rounding only touches their ratios to the maximum. A power-of-two
  scale was tried first: it loses this, and v stalls wherever its per-step change
  (about (1 - beta2) = 0.1 %) is below half a code step (measured: v off by up to 84 %
  after 50 steps in the kernel test's setting, 64 % with the fp32 scale).
- Codes round to the nearest, ties to even, by integer arithmetic on the fp32 bits
  (vectorisable in C, identical in PyTorch); decoding is a table lookup times the scale
  (tables: code value / top value, so the top code decodes to the scale exactly; the C
  kernel computes the same values from the code's bits with AVX-512, [Note: int8 decode
  by arithmetic] in _adam_kernel.c, and through tables of its own filled by that
  arithmetic without, [Note: int8 decode through a table without AVX-512]). So
  (a) the C kernel and this module agree bit for bit, and (b) encoding decoded values
  gives back the same codes and scales (the maximum decodes exactly, every other value
  to within two ulps of its code), which makes decoded fp32 moments (a checkpoint from
  before checkpoints held the stored bytes) resume bit-exactly at the same block
  boundaries. Stochastic rounding was tried for int8 too: it is unbiased, but
  with beta2 = 0.999 its per-step noise (a code step) performs a random walk that the
  0.1 % pull of the average barely damps (v off by up to 146 % in the same test).
- ``BLOCK`` = 256: the range a block needs is what the code's 15-16 binades give;
  smaller blocks would add scale bytes (4 / BLOCK per element).
- The update uses the unrounded new moments of this step; only what is stored for
  the next step is rounded (as bitsandbytes' 8-bit Adam does).
- Non-finite moments: a block holding a NaN or inf gets a NaN scale, so every element
  of it decodes to NaN (visible, never silently finite).
- bf16 stores m and v themselves (bf16 has fp32's exponent range), rounded
  stochastically with counter-based random bits of (step, element index): round to
  nearest would freeze v once its per-step change is below half a bf16 ulp (0.2 %),
  e.g. after ~500 steps of a stationary gradient, while the bias correction keeps
  shrinking, so the update would grow. bf16's ulp is small enough that the random walk
  of stochastic rounding stays a few percent. Reproducible: the bits depend only on the
  step and the element's index in its piece (not on how threads split it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

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
def _code_values(mant_bits: int) -> torch.Tensor:
    """The value of each magnitude code (4 exponent bits): f * 2^-(14 + mant_bits) for
    e = 0, else (1 + f / 2^mant_bits) * 2^(e - 15); built from the fp32 bits, exact."""
    q = torch.arange(1 << (4 + mant_bits), dtype=torch.int32)
    e, f = q >> mant_bits, q & ((1 << mant_bits) - 1)
    normal = ((q + ((_MIN_NORMAL_EXP - 1) << mant_bits)) << (23 - mant_bits)).view(torch.float32)
    sub = f.to(torch.float32) * float(2.0 ** -(14 + mant_bits))
    return torch.where(e == 0, sub, normal)


# Decoded values relative to the block scale: code value / top code value (fp32 division),
# so the top code decodes to the block's maximum exactly. The kernel computes the same
# values ([Note: int8 decode by arithmetic], [Note: int8 decode through a table without
# AVX-512]; tests/offload/test_offload_state_kernel_codes.py).
M_TABLE = _code_values(_M_MANT) / M_TOP  # 128 exp_avg magnitudes
U_TABLE = _code_values(_U_MANT) / U_TOP  # 256 sqrt(exp_avg_sq) values


def _block_scale(absmax: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, factor) of each block: the scale is the block's largest magnitude (0 when it
    is zero or subnormal: the C kernel runs with denormals-are-zero), and y = |x| * factor
    maps it to the top code (factor = top / absmax in fp32, as the kernel computes it)."""
    ok = absmax >= _FLT_MIN
    scale = torch.where(ok, absmax, 0.0)
    inv = torch.where(ok, torch.tensor(top, dtype=torch.float32) / torch.where(ok, absmax, 1.0),
                      0.0)
    return scale, inv


def _flush(x: torch.Tensor) -> torch.Tensor:
    """Subnormals as zero, as the C kernel's flush-to-zero / denormals-are-zero mode does."""
    return torch.where(x.abs() < _FLT_MIN, torch.zeros_like(x), x)


def _encode_mag(y: torch.Tensor, mant_bits: int) -> torch.Tensor:
    """Code (int32) of magnitudes y >= 0 (fp32, already scaled): the nearest code, ties to
    the even code, by rounding the fp32 bits (as the kernel's enc_mag), clamped to the top
    code. Subnormal y must be flushed by the caller."""
    top = (1 << (4 + mant_bits)) - 1
    bits = y.view(torch.int32)
    shift = 23 - mant_bits
    rounded = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift
    normal = rounded - ((_MIN_NORMAL_EXP - 1) << mant_bits)
    sub = torch.round(y * float(2 ** (14 + mant_bits))).to(torch.int32)
    q = torch.where(y < 2.0 ** -14, sub, normal)
    return torch.clamp(q, 0, top)


_MASK = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on int64 tensors holding uint32 values (as fmix32 in the kernel)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK
    return h ^ (h >> 16)


def step_seed(step: float) -> int:
    """The stochastic-rounding seed of Adam step ``step`` (1 on the first update)."""
    return int(step) & _MASK


def moment_keys(seed: int) -> tuple[int, int]:
    """(exp_avg key, exp_avg_sq key) of a seed, as tz_adam_step_q derives them."""
    keys = _fmix32(torch.tensor([(seed * 2 + 1) & _MASK, (seed * 2 + 2) & _MASK]))
    return int(keys[0]), int(keys[1])


def random_bits(numel: int, key: int, offset: int = 0) -> torch.Tensor:
    """Elements offset..offset+numel-1's 32 random bits under ``key`` (int64 values in
    [0, 2^32)): the kernel's rbits(i, key). Counter-based, so a shard gets the same bits
    however the kernel's threads split it and however it is stored in pieces."""
    i = torch.arange(offset, offset + numel, dtype=torch.int64)
    return _fmix32(((i * 0x9E3779B1) & _MASK) ^ key)


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
    q = codes.to(torch.int64)
    mag = M_TABLE[q & 0x7F]
    val = torch.where(q >= 0x80, -mag, mag)
    out.copy_(_flush(_blocks(val) * scales[:, None]).view(-1)[:n])


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """fp32 sqrt correctly rounded, as the kernel's IEEE sqrtf: ATen's vectorised sqrt is
    not, and how often it is an ulp off depends on the CPU (AVX-512 on AMD: about one
    input in six), which would move codes by one from machine to machine. The fp64 root of
    an fp32 value rounded once to fp32 is the correctly rounded fp32 root."""
    return torch.sqrt(x.double()).float()


def encode_v(v: torch.Tensor, out: torch.Tensor) -> None:
    """exp_avg_sq (fp32, 1D, >= 0) -> int8 bytes of sqrt(v)."""
    n = v.numel()
    codes, scales = split_int8(out, n)
    b = _blocks(_sqrt(_flush(v.detach().float())))
    absmax = b.amax(dim=1)
    scale, inv = _block_scale(absmax, U_TOP)
    q = _encode_mag(_flush(b * inv[:, None]), _U_MANT)
    codes.copy_(q.view(-1)[:n].to(torch.uint8))
    scales.copy_(torch.where(_nonfinite_blocks(b), float("nan"), scale))


def decode_v(raw: torch.Tensor, out: torch.Tensor) -> None:
    """int8 bytes of exp_avg_sq -> fp32 v = u * u (u the decoded sqrt(v), rounded once)."""
    n = out.numel()
    codes, scales = split_int8(raw, n)
    u = _flush(_blocks(U_TABLE[codes.to(torch.int64)]) * scales[:, None])
    out.copy_(_flush(u * u).view(-1)[:n])


def encode_bf16(value: torch.Tensor, out: torch.Tensor, key: int, offset: int = 0) -> None:
    """fp32 -> bf16 bytes rounded stochastically (the kernel's f32_to_bf16_sr)."""
    bits = value.detach().float().contiguous().view(torch.int32).to(torch.int64) & _MASK
    r = random_bits(value.numel(), key, offset)
    rounded = ((bits + (r & 0xFFFF)) >> 16) & 0xFFFF
    nan = torch.isnan(value)
    rounded = torch.where(nan, 0x7FC0, rounded)
    out.view(torch.int16).copy_(rounded.to(torch.int32).to(torch.int16))


def encode(kind: str, value: torch.Tensor, out: torch.Tensor, precision: str, *,
           seed: int = 0, offset: int = 0) -> None:
    """fp32 moment ``value`` of ``kind`` ("exp_avg" / "exp_avg_sq") -> stored bytes ``out``;
    bf16 rounds stochastically with the bits of ``seed`` for elements from ``offset`` on (a
    value the format holds exactly is stored exactly, whatever the seed)."""
    check_raw(out, value.numel(), precision, kind)
    if precision == "bf16":
        encode_bf16(value, out, moment_keys(seed)[0 if kind == "exp_avg" else 1], offset)
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


# [Note: stored moment layout]
# One moment shard as the store keeps it and a checkpoint writes it ("stored form"): the
# shard's ``numel`` elements in pieces of ``piece_numel`` (the last one shorter; the tiered
# store's pieces, offload.optimizer.chunk_numel when streamed from NVMe), each piece
# ``moment_nbytes(its numel)`` bytes, the pieces' bytes concatenated in element order:
#   fp32  float32[numel]
#   bf16  bf16[numel] as bytes (2 * numel)
#   int8  per piece of n elements at byte b: codes uint8[n] at b, zero padding to a multiple
#         of 4 bytes, then fp32 scales[ceil(n / block)] at b + 4 * ceil(n / 4); block k of a
#         piece that starts at element lo covers elements lo + k * block .. + block - 1
# fp32 and bf16 are element-wise, so pieces change nothing and their layout is one piece;
# int8 blocks restart at every piece, so its bytes depend on where pieces (and shards) start.
# The same layout (precision, numel, piece_numel) means the same bytes mean the same values.
@dataclass(frozen=True)
class StoredLayout:
    """How a moment shard is stored ([Note: stored moment layout])."""

    precision: str
    numel: int
    piece_numel: int  # numel for fp32 / bf16 (element-wise) and for a shard in one piece

    @staticmethod
    def of(precision: str, numel: int, piece_numel: int | None = None) -> StoredLayout:
        check_precision(precision)
        whole = precision != "int8" or not piece_numel or piece_numel >= numel
        return StoredLayout(precision, numel, numel if whole else int(piece_numel or numel))

    @property
    def dtype(self) -> torch.dtype:
        return moment_dtype(self.precision)

    @property
    def stored_numel(self) -> int:
        """Elements of the stored tensor (fp32 values, or bytes)."""
        return self.numel if self.precision == "fp32" else self.nbytes

    @property
    def nbytes(self) -> int:
        return sum(b - a for _, _, a, b in self.pieces())

    def pieces(self) -> list[tuple[int, int, int, int]]:
        """(first element, end, first byte, end byte) of each piece."""
        out, pos = [], 0
        step = max(self.piece_numel, 1)
        for lo in range(0, self.numel, step):
            hi = min(self.numel, lo + step)
            nb = moment_nbytes(hi - lo, self.precision)
            out.append((lo, hi, pos, pos + nb))
            pos += nb
        return out

    def decode(self, kind: str, stored: torch.Tensor, out: torch.Tensor) -> None:
        """The stored form of moment ``kind`` -> fp32 ``out`` (numel elements; exact)."""
        if self.precision == "fp32":
            out.copy_(stored)
            return
        for lo, hi, a, b in self.pieces():
            decode(kind, stored[a:b], out[lo:hi], self.precision)

    def encode(self, kind: str, value: torch.Tensor, out: torch.Tensor, *, seed: int = 0) -> None:
        """fp32 ``value`` -> the stored form ``out`` (bf16 rounding bits of ``seed`` by each
        element's index in the shard, as the store encodes)."""
        if self.precision == "fp32":
            out.copy_(value)
            return
        for lo, hi, a, b in self.pieces():
            encode(kind, value[lo:hi], out[a:b], self.precision, seed=seed, offset=lo)

    def describe(self) -> str:
        if self.precision != "int8" or self.piece_numel == self.numel:
            return self.precision
        return f"{self.precision} in pieces of {self.piece_numel}"

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"precision": self.precision, "numel": self.numel,
                               "piece_numel": self.piece_numel, "nbytes": self.nbytes}
        if self.precision == "int8":
            out["block"] = BLOCK
        return out

    @staticmethod
    def from_json(d: dict[str, Any]) -> StoredLayout:
        """A saved layout, checked: a block size or byte count this codec does not produce
        means bytes it cannot decode (ValueError naming both)."""
        lay = StoredLayout.of(str(d["precision"]), int(d["numel"]), int(d["piece_numel"]))
        if lay.precision == "int8" and int(d.get("block", BLOCK)) != BLOCK:
            raise ValueError(f"int8 moments stored in blocks of {d['block']} elements; this "
                             f"tierzero decodes blocks of {BLOCK}")
        if int(d["nbytes"]) != lay.nbytes:
            raise ValueError(f"{lay.describe()} moments of {lay.numel} elements take "
                             f"{lay.nbytes} bytes; the layout says {d['nbytes']}")
        return lay
