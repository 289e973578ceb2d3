"""The offloaded step as the engine runs it with a GPU: bf16 grads come down into pinned
host memory, CPUAdam's kernel updates fp32 state and writes a pinned bf16 shadow, which
goes back up with a non-blocking copy. Checked against torch.optim.AdamW on the GPU.

Tolerance 1e-6 relative to the largest reference value: the CUDA AdamW kernels and
our CPU kernel each round every operation in fp32 (order as in torch's Adam); the
remaining differences are single-ulp (fma placement), far below a real error.
"""

from __future__ import annotations

import pytest
import torch

from tierzero.offload import AdamHyper, AdamThreads, CPUAdam, adam_update

pytestmark = pytest.mark.cuda


def test_offloaded_step_round_trip_matches_gpu_adamw() -> None:
    dev = torch.device("cuda")
    n, steps = 3_000_017, 20
    gen = torch.Generator(device=dev).manual_seed(0)
    master0 = torch.randn(n, device=dev, generator=gen)
    ref = master0.clone().requires_grad_()
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    master = master0.cpu().pin_memory()
    m = torch.zeros(n).pin_memory()
    v = torch.zeros(n).pin_memory()
    grad_host = torch.empty(n, dtype=torch.bfloat16).pin_memory()
    shadow_host = torch.empty(n, dtype=torch.bfloat16).pin_memory()
    param = torch.empty(n, dtype=torch.bfloat16, device=dev)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    copy_stream = torch.cuda.Stream()  # the D2H/H2D copies, as the engine's copy stream
    with AdamThreads() as threads:
        for step in range(1, steps + 1):
            g16 = (torch.randn(n, device=dev, generator=gen) * 1e-2).to(torch.bfloat16)
            ref.grad = g16.float()
            ref_opt.step()
            copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(copy_stream):
                grad_host.copy_(g16, non_blocking=True)
            copy_stream.synchronize()
            adam_update(master, m, v, grad_host, hyper=hyper, step=step, shadow=shadow_host,
                        threads=threads)
            with torch.cuda.stream(copy_stream):
                param.copy_(shadow_host, non_blocking=True)
            copy_stream.synchronize()
    torch.cuda.synchronize()
    want = ref.detach()
    diff = (master.to(dev) - want).abs().max().item()
    assert diff <= 1e-6 * want.abs().max().item(), diff
    st = ref_opt.state[ref]
    for name, got in (("exp_avg", m), ("exp_avg_sq", v)):
        d = (got.to(dev) - st[name]).abs().max().item()
        assert d <= 1e-6 * st[name].abs().max().item(), (name, d)
    want16 = master.to(dev).to(torch.bfloat16)
    assert torch.equal(param.view(torch.int16), want16.view(torch.int16))


def test_cpuadam_pinned_shadow_feeds_gpu_copy() -> None:
    p = torch.randn(100_000).pin_memory().requires_grad_()
    opt = CPUAdam([p], lr=1e-2)
    shadow = torch.empty(100_000, dtype=torch.float16).pin_memory()
    opt.attach_shadow(p, shadow)
    on_gpu = torch.empty(100_000, dtype=torch.float16, device="cuda")
    for _ in range(3):
        p.grad = torch.randn(100_000)
        opt.step()
        on_gpu.copy_(shadow, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.cpu().view(torch.int16), p.detach().half().view(torch.int16))
    opt.close()
