"""bf16 master weights rounded stochastically: offload.optimizer.master_precision bf16.

[Note: bf16 master weights]
By default every trainable shard keeps an fp32 ``master`` beside its compute-dtype
``param``: the CPU Adam reads and writes the master (8 B/param per step on its tier) and
writes param rounded to nearest from it (2 B/param). With bf16 compute and
``master_precision: bf16`` the compute copy is the master: no fp32 master is stored, read
or written. The update reads each bf16 element, computes in fp32 exactly as the fp32-master
update does (moments in any state_precision), and writes the new value back as bf16
rounded *stochastically*: 16 random bits are added below the bf16 mantissa of the fp32
result and the low 16 bits truncated (torchao's ``bf16_stochastic_round``; Zamirai et al.,
"Revisiting BFloat16 Training"; Ozkara et al., AISTATS'25). Rounding to nearest would drop
every update smaller than half a bf16 ulp (2^-9 relative), which is most of Adam's late
updates; stochastic rounding keeps their expected value: E[round(x)] = x (exactly, for the
16-bit dither of a 32-bit float; the test checks the mean of many roundings).

The random bits are counter-based, as those of bf16 moments (state_codec.random_bits):
element i of a shard in step s gets ``fmix32((i * 0x9e3779b1) ^ master_key(s, salt))``,
where ``salt`` names the shard (the engine's group key and rank, ``shard_salt``). So a step
is reproducible bit for bit: the same however threads split the shard, whether it is
updated in one piece or streamed in pieces (the piece's first element is the index base),
and after a resume from a checkpoint (the step count is saved). Different shards and
different steps draw different bits; the moments' bits (keys of the step alone) differ
from the master's.

The C kernel (tz_adam_step_b in _adam_kernel.c) does this in its one pass;
``round_bf16_stochastic`` below is the same rounding in PyTorch, the kernel's reference.
"""

from __future__ import annotations

import zlib
from typing import Literal, get_args

import torch

from .state_codec import encode_bf16

MasterPrecision = Literal["fp32", "bf16"]
MASTER_PRECISIONS: tuple[str, ...] = get_args(MasterPrecision)
_MASK = 0xFFFFFFFF


def check_master(precision: str) -> None:
    if precision not in MASTER_PRECISIONS:
        raise ValueError(f"master precision {precision!r} is unknown; allowed: "
                         f"{', '.join(MASTER_PRECISIONS)}")


def master_nbytes(numel: int, precision: str) -> int:
    """Bytes of a shard's separate master on its tier: fp32 4 B/element, bf16 none (the
    compute copy is the master)."""
    check_master(precision)
    return 4 * numel if precision == "fp32" else 0


def _fmix32(h: int) -> int:
    """murmur3's finaliser on a Python int (the kernel's fmix32)."""
    h &= _MASK
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK
    return h ^ (h >> 16)


def shard_salt(name: str) -> int:
    """The 32-bit salt of the shard called ``name`` (the engine passes its group key and
    rank): stable across processes and runs, unlike Python's hash()."""
    return zlib.crc32(name.encode()) & _MASK


def master_key(step: float, salt: int) -> int:
    """The random-bit key of Adam step ``step`` (1 on the first update) for the shard with
    ``salt``; tz_adam_step_b takes it as key_p."""
    return _fmix32(_fmix32(salt ^ 0x6D617374) ^ ((int(step) * 2 + 3) & _MASK))


def round_bf16_stochastic(value: torch.Tensor, out: torch.Tensor, key: int,
                          offset: int = 0) -> None:
    """fp32 ``value`` -> bf16 ``out`` rounded stochastically with the bits of ``key`` for
    elements ``offset``.. (the kernel's f32_to_bf16_sr; NaN becomes 0x7fc0). A value bf16
    holds exactly is kept exactly, whatever the key."""
    if out.dtype != torch.bfloat16 or out.numel() != value.numel():
        raise ValueError(f"round_bf16_stochastic needs a bf16 output of {value.numel()} "
                         f"elements; got {out.dtype} with {out.numel()}")
    encode_bf16(value.reshape(-1), out.view(-1), key, offset)
