"""bf16 master weights rounded stochastically ([Note: bf16 master weights] in
offload/bf16_master.py; tz_adam_step_b in _adam_kernel.c).

Exact: the kernel's new bf16 master is, bit for bit, its fp32 update of the upcast master
followed by a plain PyTorch rounding written here (16 random bits of the same counter-based
generator added below the bf16 mantissa, then truncated), for every moment storage,
gradient dtype, thread split and piece offset; the PyTorch path is that reference with
adam_math.torch_update. Unbiased: the mean of many roundings of one value is that value
within five standard deviations of the mean (where rounding to nearest is off by far
more). Deterministic: the same step and salt give the same bits in every run; another step
or salt other bits. The streamed step (AdamStream, NVMe, shards in pieces) gives the
in-place update's bits and moves 2 B/param of master each way, no fp32 master.
"""

from __future__ import annotations

import itertools
import math
import zlib
from pathlib import Path

import pytest
import torch
from tiers_util import cpu_settings

from tierzero.offload import (
    AdamHyper,
    AdamStream,
    AdamThreads,
    ShardSpec,
    TierManager,
    adam_update,
    kernel_status,
)
from tierzero.offload import state_codec as sc
from tierzero.offload.adam_build import compiled_kernel
from tierzero.offload.adam_math import torch_update
from tierzero.offload.bf16_master import (
    master_key,
    master_nbytes,
    round_bf16_stochastic,
    shard_salt,
)
from tierzero.swap import SwapStore

needs_kernel = pytest.mark.skipif(compiled_kernel() is None,
                                  reason=f"C kernel unavailable here: {kernel_status()}")
HYPER = AdamHyper(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
MASK = 0xFFFFFFFF


def plain_sr(x: torch.Tensor, key: int, offset: int) -> torch.Tensor:
    """The rounding in plain PyTorch ops: fp32 bits + 16 random bits, top half kept."""
    bits = x.float().view(torch.int32).to(torch.int64) & MASK
    r = sc.random_bits(x.numel(), key, offset) & 0xFFFF
    top = ((bits + r) >> 16) & 0xFFFF
    top = torch.where(torch.isnan(x), 0x7FC0, top)
    return top.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def state(n: int, prec: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
    if prec == "fp32":
        return m, v
    raw_m = torch.zeros(sc.moment_nbytes(n, prec), dtype=torch.uint8)
    raw_v = raw_m.clone()
    sc.encode("exp_avg", m, raw_m, prec, seed=3)
    sc.encode("exp_avg_sq", v, raw_v, prec, seed=3)
    return raw_m, raw_v


def reference(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, prec: str,
              *, step: int, scale: float, key: int, offset: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upcast, the fp32 update, the plain stochastic rounding; moments as the codec does.
    Returns (new master, exp_avg, exp_avg_sq, the fp32 value before rounding)."""
    n = p.numel()
    p32 = p.float()
    m32, v32 = (m.clone(), v.clone()) if prec == "fp32" else (torch.empty(n), torch.empty(n))
    if prec != "fp32":
        sc.decode("exp_avg", m, m32, prec)
        sc.decode("exp_avg_sq", v, v32, prec)
    torch_update(p32, m32, v32, g, hyper=HYPER, step=step, grad_scale=scale)
    if prec == "fp32":
        return plain_sr(p32, key, offset), m32, v32, p32
    out_m, out_v = m.clone(), v.clone()  # (int8 code padding kept as it was)
    sc.encode("exp_avg", m32, out_m, prec, seed=sc.step_seed(step), offset=offset)
    sc.encode("exp_avg_sq", v32, out_v, prec, seed=sc.step_seed(step), offset=offset)
    return plain_sr(p32, key, offset), out_m, out_v, p32


@needs_kernel
@pytest.mark.parametrize("prec", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 255, 257, 70_000])
def test_kernel_rounds_like_the_plain_reference(prec: str, gdtype: torch.dtype, n: int) -> None:
    """Each backend's bf16-master update is, bit for bit, its own fp32-master update of the
    upcast master (same moments) followed by the plain rounding: the compiled kernel's and
    the PyTorch path's fp32 arithmetic may differ by an ulp in rare elements ([Note: Adam
    operation order] in _adam_kernel.c), the rounding may not."""
    gen = torch.Generator().manual_seed(n)
    p = (torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))).bfloat16()
    g = torch.randn(n, generator=gen).to(gdtype)
    m, v = state(n, prec, n)
    key = master_key(7, shard_salt("blk.3/bf16/trainable@rank0"))
    for backend, threads in (("compiled", None), ("compiled", AdamThreads(3)),
                             ("torch", None)):
        fp32 = (p.float(), m.clone(), v.clone())
        adam_update(*fp32, g, hyper=HYPER, step=7, grad_scale=0.5, backend=backend,  # type: ignore[arg-type]
                    state=prec, offset=4096)
        got = (p.clone(), m.clone(), v.clone())
        adam_update(*got, g, hyper=HYPER, step=7, grad_scale=0.5, backend=backend,  # type: ignore[arg-type]
                    threads=threads, state=prec, offset=4096, master_key=key)
        if threads is not None:
            threads.close()
        assert torch.equal(got[0], plain_sr(fp32[0], key, 4096)), (backend, threads)
        assert torch.equal(got[1], fp32[1]) and torch.equal(got[2], fp32[2]), (backend, threads)
    # and the PyTorch path is the plain reference written here (torch_update + plain_sr)
    want = reference(p, m, v, g, prec, step=7, scale=0.5, key=key, offset=4096)
    assert all(torch.equal(a, b) for a, b in zip(got, want[:3], strict=True))
    if n > 1000:  # stochastic: many elements land on the other side of nearest
        off_grid = want[3] != want[3].bfloat16().float()
        differs = (want[0] != want[3].bfloat16()) & off_grid
        assert 0.05 < float(differs.sum()) / float(off_grid.sum()) < 0.95


@needs_kernel
@pytest.mark.parametrize("prec", ["fp32", "bf16", "int8"])
def test_random_bits_past_two_to_the_32(prec: str) -> None:
    """The kernel counts an element's index for its random bits in 32 bits from each block's
    first element (rbits in _adam_kernel.c): a shard whose elements cross index 2^32 rounds
    its master as the plain reference does (which truncates the 64-bit index), and in
    pieces as in one."""
    n, offset = 1000, (1 << 32) - 300
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen).bfloat16()
    g = torch.randn(n, generator=gen)
    m, v = state(n, prec, 5)
    key = master_key(2, shard_salt("blk.0/bf16/trainable@rank0"))
    fp32 = (p.float(), m.clone(), v.clone())
    adam_update(*fp32, g, hyper=HYPER, step=2, backend="compiled", state=prec, offset=offset)
    whole = (p.clone(), m.clone(), v.clone())
    adam_update(*whole, g, hyper=HYPER, step=2, backend="compiled", state=prec, offset=offset,
                master_key=key)
    assert torch.equal(whole[0], plain_sr(fp32[0], key, offset))
    assert torch.equal(whole[1], fp32[1]) and torch.equal(whole[2], fp32[2])
    if prec == "int8":  # int8 moments round to nearest: no random bits in pieces to check
        return
    parts = (p.clone(), m.clone(), v.clone())
    per = 1 if prec == "fp32" else 2  # stored elements per element (bf16 moments: bytes)
    for lo, hi in ((0, 512), (512, n)):
        views = [parts[0][lo:hi], *(t[lo * per:hi * per] for t in parts[1:])]
        adam_update(*views, g[lo:hi], hyper=HYPER, step=2, backend="compiled", state=prec,
                    offset=offset + lo, master_key=key)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))


@needs_kernel
def test_a_shard_in_pieces_rounds_as_one() -> None:
    """Pieces updated with their first element as offset give the whole shard's bits."""
    n = 10_000
    gen = torch.Generator().manual_seed(1)
    p, g = torch.randn(n, generator=gen).bfloat16(), torch.randn(n, generator=gen)
    key = master_key(3, shard_salt("x"))
    whole = (p.clone(), *state(n, "fp32", 1))
    adam_update(*whole, g, hyper=HYPER, step=3, master_key=key)
    parts = (p.clone(), *state(n, "fp32", 1))
    for lo, hi in ((0, 1000), (1000, 6000), (6000, n)):
        adam_update(*(t[lo:hi] for t in parts), g[lo:hi], hyper=HYPER, step=3,
                    master_key=key, offset=lo)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))


@needs_kernel
def test_stochastic_rounding_is_unbiased() -> None:
    """AdamW with zero gradient and moments leaves p * (1 - lr * wd) (one fp32 multiply):
    1 - 2^-12 lies a sixteenth of a bf16 step below 1. The mean over N elements (each its
    own random bits) and over 8 steps is that value within 5 standard deviations of the
    mean, sd = ulp * sqrt(q (1 - q) / N); rounding to nearest gives 1.0, 80 sd away."""
    n = 1 << 16
    hyper = AdamHyper(lr=2.0 ** -12, weight_decay=1.0, eps=1e-8)
    x = 1.0 - 2.0 ** -12  # = fl(1 * (1 - lr * wd))
    ulp = 2.0 ** -8  # bf16 spacing just below 1
    q = (1.0 - x) / ulp  # probability of rounding down
    means = []
    for step in range(1, 9):
        p = torch.ones(n, dtype=torch.bfloat16)
        adam_update(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), hyper=hyper,
                    step=step, master_key=master_key(step, 5))
        assert set(p.float().unique().tolist()) <= {1.0, 1.0 - ulp}
        means.append(float(p.double().mean()))
    sd = ulp * math.sqrt(q * (1 - q) / (8 * n))
    mean = sum(means) / len(means)
    assert abs(mean - x) < 5 * sd, (mean, x, sd)
    assert abs(1.0 - x) > 50 * sd  # what rounding to nearest would be off by


def test_rounding_is_deterministic_per_step_and_shard() -> None:
    x = torch.randn(5000)
    a, b = torch.empty(5000, dtype=torch.bfloat16), torch.empty(5000, dtype=torch.bfloat16)
    round_bf16_stochastic(x, a, master_key(4, shard_salt("g@rank0")))
    round_bf16_stochastic(x, b, master_key(4, shard_salt("g@rank0")))
    assert torch.equal(a, b)
    for other in (master_key(5, shard_salt("g@rank0")), master_key(4, shard_salt("g@rank1")),
                  master_key(4, shard_salt("h@rank0"))):
        round_bf16_stochastic(x, b, other)
        assert not torch.equal(a, b)
    # keys are fixed numbers (a resume in another process draws the same bits), distinct
    # from the moments' keys of the same step
    assert shard_salt("g@rank0") == zlib.crc32(b"g@rank0")
    assert master_key(4, 0) not in sc.moment_keys(4)
    exact = torch.randn(100).bfloat16()
    kept = torch.empty_like(exact)
    round_bf16_stochastic(exact.float(), kept, 12345)
    assert torch.equal(kept, exact)  # a value bf16 holds stays as it is
    assert master_nbytes(10, "fp32") == 40 and master_nbytes(10, "bf16") == 0


def test_bad_arguments_name_the_fix() -> None:
    p = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs master_key"):
        adam_update(p, torch.zeros(8), torch.zeros(8), torch.zeros(8), hyper=HYPER, step=1)
    with pytest.raises(ValueError, match="takes no shadow"):
        adam_update(p, torch.zeros(8), torch.zeros(8), torch.zeros(8), hyper=HYPER, step=1,
                    shadow=torch.zeros(8, dtype=torch.bfloat16), master_key=1)
    with pytest.raises(ValueError, match=r"master has dtype torch\.float16"):
        adam_update(p.half(), torch.zeros(8), torch.zeros(8), torch.zeros(8), hyper=HYPER,
                    step=1, master_key=1)



NUMELS = (1000, 0, 4097, 33, 7000)


def _zeros(n: int, prec: str) -> torch.Tensor:
    """Zero moments as stored: zero fp32 values, or zero bytes (which decode to zero)."""
    if prec == "fp32":
        return torch.zeros(n)
    return torch.zeros(sc.moment_nbytes(n, prec), dtype=torch.uint8)


@pytest.mark.parametrize(("chunk", "prec"), [(1 << 20, "fp32"), (1024, "int8"), (333, "bf16")])
def test_stream_in_pieces_matches_the_in_place_update(tmp_path: Path, chunk: int,
                                                      prec: str) -> None:
    """Param, gradient and moments on NVMe; shards in one piece (the master in the ring) or
    several (the param read whole, updated piece by piece): equal to adam_update over host
    tensors, and per step exactly the param and the moments read and written once."""
    salts = [shard_salt(f"s{i}") for i in range(len(NUMELS))]
    whole = [{c: f"{c}/{i}" for c in ("grad", "param")} for i in range(len(NUMELS))]
    cuts = [[(lo, min(n, lo + chunk)) for lo in range(0, n, chunk)] if n > chunk else [(0, n)]
            for n in NUMELS]
    chunks = [[(lo, hi, {c: f"{c}/{i}@{lo}" for c in ("exp_avg", "exp_avg_sq")})
               for lo, hi in cs] for i, cs in enumerate(cuts)]
    specs = [ShardSpec(whole[i][c], c, n, torch.bfloat16)  # type: ignore[arg-type]
             for i, n in enumerate(NUMELS) if n for c in ("grad", "param")]
    specs += [ShardSpec(k[c], c, _zeros(hi - lo, prec).numel(),  # type: ignore[arg-type]
                        _zeros(1, prec).dtype)
              for i, n in enumerate(NUMELS) if n for lo, hi, k in chunks[i]
              for c in ("exp_avg", "exp_avg_sq")]
    homes = dict.fromkeys(("master", "exp_avg", "exp_avg_sq", "grad", "param"), "nvme")
    gen = torch.Generator().manual_seed(0)
    # the reference: each shard's param, and its moments per piece as the store keeps them
    ref = [{"param": torch.randn(n, generator=gen).bfloat16(),
            **{f"{c}@{lo}": _zeros(hi - lo, prec) for lo, hi in cs
               for c in ("exp_avg", "exp_avg_sq")}} for n, cs in zip(NUMELS, cuts, strict=True)]
    with SwapStore(tmp_path, block_size=1 << 16) as swap, TierManager(
            specs, cpu_settings(homes, device=1 << 20, host=16 << 20), swap=swap) as mgr:
        for i, n in enumerate(NUMELS):
            if n:
                mgr.place(whole[i]["param"], ref[i]["param"]).wait()
                mgr.place(whole[i]["grad"], torch.zeros(n, dtype=torch.bfloat16)).wait()
                for lo, hi, k in chunks[i]:
                    for c in ("exp_avg", "exp_avg_sq"):
                        mgr.place(k[c], _zeros(hi - lo, prec)).wait()
        stream = AdamStream(mgr, whole, NUMELS, buffer_bytes=0, shadow=None, chunks=chunks,
                            state=prec, master="bf16", salts=salts, consume_grads=True)
        moved = []
        try:
            for step in range(1, 4):
                for i, n in enumerate(NUMELS):
                    if not n:
                        continue
                    g = torch.randn(n, generator=gen).bfloat16()
                    mgr.fetch(whole[i]["grad"], "host", writable=True, discard=True
                              ).wait().copy_(g)
                    mgr.release(whole[i]["grad"], "host")
                    for lo, hi in cuts[i]:
                        adam_update(ref[i]["param"][lo:hi], ref[i][f"exp_avg@{lo}"],
                                    ref[i][f"exp_avg_sq@{lo}"], g[lo:hi], hyper=HYPER,
                                    step=step, grad_scale=0.5, state=prec, offset=lo,
                                    master_key=master_key(step, salts[i]))
                stream.step(HYPER, step, grad_scale=0.5)
                stream.wait_idle()
                r = mgr.memory_report().moved
                moved.append((r["nvme_to_host"], r["host_to_nvme"]))
            stream.flush()
            mgr.synchronize()
            for i, n in enumerate(NUMELS):
                if n:
                    got = mgr.fetch(whole[i]["param"], "host").wait().clone()
                    mgr.release(whole[i]["param"], "host")
                    assert torch.equal(got, ref[i]["param"]), i
        finally:
            stream.close()
    moments = sum(2 * _zeros(hi - lo, prec).nbytes for cs in cuts for lo, hi in cs if hi > lo)
    params = 2 * sum(NUMELS)
    for (r0, w0), (r1, w1) in itertools.pairwise(moved):
        assert w1 - w0 == moments + params  # no fp32 master, no separate param write
        # a param kept in host memory after its write ([Note: param kept in host memory])
        # is read from there
        assert moments <= r1 - r0 <= moments + params
