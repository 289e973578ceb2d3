"""The C Adam kernel never touches memory it was not given: every operand is checked
before each call, and CPUAdam.load_state_dict checks and converts moments per parameter.

On the code before these checks, the short and expanded moments and the shrunk grad
crashed the process (the kernel ran past the buffers) and the non-contiguous state
loaded silently in the wrong layout. Numbers are compared with torch.optim.AdamW at the
tolerance of tests/offload/test_offload_adam_optimizer.py (1e-6 relative).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tierzero.offload import CPUAdam, kernel_status
from tierzero.offload.adam_build import compiled_kernel
from tierzero.offload.adam_kernel import adam_update, to_low_precision
from tierzero.offload.adam_math import AdamHyper

REL_TOL = 1e-6
BACKENDS = [
    pytest.param("compiled", marks=pytest.mark.skipif(
        compiled_kernel() is None, reason=f"C kernel unavailable here: {kernel_status()}")),
    "torch",
]


def _stepped(n: int = 64) -> tuple[torch.Tensor, CPUAdam]:
    p = torch.randn(n, requires_grad=True)
    opt = CPUAdam([p], lr=1e-2)
    p.grad = torch.randn(n)
    opt.step()
    return p, opt


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_short_moment_is_refused_at_load(key: str) -> None:
    p, opt = _stepped()
    saved = copy.deepcopy(opt.state_dict())  # state_dict() shares the live state dicts
    saved["state"][0][key] = torch.zeros(8)
    before = opt.state[p][key].clone()
    with pytest.raises(ValueError, match=rf"group 0 param 0 {key} has shape \(8,\).*\(64,\)"):
        opt.load_state_dict(saved)
    assert torch.equal(opt.state[p][key], before)  # nothing changed
    opt.step()


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_moment_is_copied_not_aliased(backend: str) -> None:
    # A stride-0 moment: every element aliases one float. Loaded as its values.
    p = torch.randn(64, requires_grad=True)
    ref = p.detach().clone().requires_grad_()
    opt = CPUAdam([p], lr=1e-2, backend=backend)  # type: ignore[arg-type]
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
    g = torch.randn(64)
    p.grad, ref.grad = g.clone(), g.clone()
    opt.step()
    ref_opt.step()
    saved = copy.deepcopy(opt.state_dict())  # state_dict() shares the live state dicts
    saved["state"][0]["exp_avg"] = torch.full((1,), 0.5).expand(64)
    saved["state"][0]["exp_avg_sq"] = torch.full((1,), 0.25).expand(64)
    opt.load_state_dict(saved)
    ref_opt.state[ref]["exp_avg"].fill_(0.5)
    ref_opt.state[ref]["exp_avg_sq"].fill_(0.25)
    assert opt.state[p]["exp_avg"].is_contiguous()
    p.grad, ref.grad = g.clone(), g.clone()
    opt.step()
    ref_opt.step()
    assert (p - ref).abs().max().item() <= REL_TOL * ref.abs().max().item()
    exp_avg = opt.state[p]["exp_avg"]
    assert (exp_avg - ref_opt.state[ref]["exp_avg"]).abs().max().item() <= REL_TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_of_a_non_contiguous_param_keeps_its_layout(backend: str) -> None:
    # AdamW keeps moments in the parameter's own strides; CPUAdam's parameter is
    # contiguous, so the moments must be copied by index, not reinterpreted.
    torch.manual_seed(0)
    ref = torch.randn(6, 4).t().requires_grad_()  # (4, 6), strides (1, 4)
    assert not ref.is_contiguous()
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
    grads = [torch.randn(4, 6) for _ in range(3)]
    for g in grads[:2]:
        ref.grad = g.clone()
        ref_opt.step()
    assert not ref_opt.state[ref]["exp_avg"].is_contiguous()
    p = ref.detach().contiguous().requires_grad_()
    opt = CPUAdam([p], lr=1e-2, backend=backend)  # type: ignore[arg-type]
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # no shared step tensor
    p.grad, ref.grad = grads[2].clone(), grads[2].clone()
    opt.step()
    ref_opt.step()
    assert (p - ref).abs().max().item() <= REL_TOL * ref.abs().max().item()
    for key in ("exp_avg", "exp_avg_sq"):
        diff = (opt.state[p][key] - ref_opt.state[ref][key]).abs().max().item()
        assert diff <= REL_TOL * ref_opt.state[ref][key].abs().max().item(), key


def test_bad_saved_values_are_named() -> None:
    _, opt = _stepped()
    for key, value, match in [
        ("exp_avg", None, r"param 0 has no tensor 'exp_avg'"),
        ("exp_avg_sq", torch.zeros(64, dtype=torch.int32), r"exp_avg_sq is torch\.int32"),
        ("step", torch.zeros(2), r"step is tensor"),
    ]:
        saved = copy.deepcopy(opt.state_dict())  # state_dict() shares the live state dicts
        saved["state"][0][key] = value
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(saved)


def test_low_precision_moment_is_converted_to_fp32() -> None:
    p, opt = _stepped()
    saved = copy.deepcopy(opt.state_dict())  # state_dict() shares the live state dicts
    exp_avg = saved["state"][0]["exp_avg"].clone()
    saved["state"][0]["exp_avg"] = exp_avg.to(torch.bfloat16)
    opt.load_state_dict(saved)
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert torch.equal(opt.state[p]["exp_avg"], exp_avg.to(torch.bfloat16).float())


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_shrunk_under_the_param_is_refused(backend: str) -> None:
    p = torch.randn(64, requires_grad=True)
    opt = CPUAdam([p], backend=backend)  # type: ignore[arg-type]
    p.grad = torch.randn(64)
    opt.step()
    p.grad.data = torch.randn(4)  # .data bypasses autograd's shape check
    with pytest.raises(ValueError, match=r"param 0: Adam grad has 4 elements; master has 64"):
        opt.step()


@pytest.mark.parametrize("backend", BACKENDS)
def test_operands_checked_on_every_kernel_call(backend: str) -> None:
    hyper = AdamHyper(lr=1e-3)
    n = 1000
    master, m, v, g = (torch.zeros(n) for _ in range(4))

    def run(**over: torch.Tensor) -> None:
        ops = {"master": master, "exp_avg": m, "exp_avg_sq": v, "grad": g, **over}
        adam_update(ops["master"], ops["exp_avg"], ops["exp_avg_sq"], ops["grad"],
                    hyper=hyper, step=1, backend=backend)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="exp_avg is not contiguous"):
        run(exp_avg=torch.zeros(1).expand(n))
    with pytest.raises(ValueError, match="exp_avg_sq has 999 elements"):
        run(exp_avg_sq=torch.zeros(n - 1))
    with pytest.raises(ValueError, match=r"grad has dtype torch\.float64"):
        run(grad=torch.zeros(n, dtype=torch.float64))
    shrunk = torch.zeros(n)
    view = shrunk[:]
    shrunk.untyped_storage().resize_(16)  # the view still claims n elements
    with pytest.raises(ValueError, match=r"master views 1000 elements.*runs past its storage"):
        run(master=view)
    short16 = torch.zeros(n, dtype=torch.bfloat16)
    view16 = short16[:]
    short16.untyped_storage().resize_(16)
    with pytest.raises(ValueError, match=r"dst views 1000 elements.*runs past its storage"):
        to_low_precision(torch.zeros(n), view16, backend=backend)  # type: ignore[arg-type]


def test_default_weight_decay_is_torchs() -> None:
    w = torch.zeros(3, requires_grad=True)
    assert CPUAdam([w]).defaults["weight_decay"] == torch.optim.AdamW([w]).defaults[
        "weight_decay"] == 0.01
    assert CPUAdam([w], adamw=False).defaults["weight_decay"] == torch.optim.Adam(
        [w]).defaults["weight_decay"] == 0
    p = torch.randn(32, requires_grad=True)
    ref = p.detach().clone().requires_grad_()
    opt, ref_opt = CPUAdam([p], lr=0.1), torch.optim.AdamW([ref], lr=0.1, foreach=False)
    for _ in range(3):
        p.grad, ref.grad = torch.ones(32), torch.ones(32)
        opt.step()
        ref_opt.step()
    assert (p - ref).abs().max().item() <= REL_TOL * ref.abs().max().item()
