"""offload.CPUAdam as a torch.optim.Optimizer, against torch.optim.AdamW / Adam.

Tolerance 1e-6 relative to the largest reference value per tensor, for the
reason given in tests/offload/test_offload_adam_kernel.py (one-ulp sqrt/fma differences per
step with the compiled kernel; the PyTorch backend is exact).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from tierzero.offload import AdamThreads, CPUAdam, kernel_status
from tierzero.offload.adam_build import compiled_kernel

REL_TOL = 1e-6
BACKENDS = [
    pytest.param("compiled", marks=pytest.mark.skipif(
        compiled_kernel() is None, reason=f"C kernel unavailable here: {kernel_status()}")),
    "torch",
]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(33, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 5))


def _set_grads(models: list[nn.Module], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for params in zip(*(m.parameters() for m in models), strict=True):
        g = torch.randn(params[0].shape, generator=gen)
        for p in params:
            p.grad = g.clone()


def _assert_close(a: nn.Module, b: nn.Module, oa: torch.optim.Optimizer,
                  ob: torch.optim.Optimizer) -> None:
    for i, (pa, pb) in enumerate(zip(a.parameters(), b.parameters(), strict=True)):
        pairs = [("param", pa.detach(), pb.detach())]
        if pb in ob.state:
            pairs += [(k, oa.state[pa][k], ob.state[pb][k]) for k in ("exp_avg", "exp_avg_sq")]
            assert float(oa.state[pa]["step"]) == float(ob.state[pb]["step"])
        for name, x, y in pairs:
            bound = REL_TOL * max(y.abs().max().item(), 1e-30)
            diff = (x - y).abs().max().item()
            assert diff <= bound, f"param {i} {name}: diff {diff:.3g} > {bound:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("adamw", [True, False])
def test_model_100_steps_matches_torch(adamw: bool, backend: str) -> None:
    ours, ref = _model(), _model()
    kw = {"lr": 2e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    opt = CPUAdam(ours.parameters(), adamw=adamw, threads=2, backend=backend, **kw)  # type: ignore[arg-type]
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = cls(ref.parameters(), foreach=False, **kw)  # type: ignore[arg-type]
    with opt:
        for step in range(100):
            _set_grads([ours, ref], step)
            opt.step()
            ref_opt.step()
    _assert_close(ours, ref, opt, ref_opt)


def test_param_groups_own_hyperparameters() -> None:
    ours, ref = _model(), _model()

    def groups(m: nn.Module) -> list[dict[str, object]]:
        layers = list(m.children())
        return [
            {"params": layers[0].parameters(), "lr": 5e-3, "weight_decay": 0.2},
            {"params": layers[1].parameters(), "betas": (0.5, 0.9), "weight_decay": 0.0},
            {"params": layers[3].parameters()},
        ]

    opt = CPUAdam(groups(ours), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-3, weight_decay=0.01, foreach=False)
    for step in range(30):
        _set_grads([ours, ref], step)
        opt.step()
        ref_opt.step()
    _assert_close(ours, ref, opt, ref_opt)
    assert [g["lr"] for g in opt.param_groups] == [5e-3, 1e-3, 1e-3]
    opt.close()


def test_group_may_switch_to_l2_with_adamw_key() -> None:
    ours, ref = _model(), _model()
    opt = CPUAdam([{"params": ours.parameters(), "adamw": False}], weight_decay=0.1)
    ref_opt = torch.optim.Adam(ref.parameters(), weight_decay=0.1, foreach=False)
    for step in range(10):
        _set_grads([ours, ref], step)
        opt.step()
        ref_opt.step()
    _assert_close(ours, ref, opt, ref_opt)
    assert opt.param_groups[0]["decoupled_weight_decay"] is False


def test_state_dict_layout_equals_adamw() -> None:
    ours, ref = _model(), _model()
    opt = CPUAdam(ours.parameters(), weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), weight_decay=0.01)
    _set_grads([ours, ref], 0)
    opt.step()
    ref_opt.step()
    a, b = opt.state_dict(), ref_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        assert sa.keys() == sb.keys()
        for name in sa:
            assert (sa[name].shape, sa[name].dtype) == (sb[name].shape, sb[name].dtype), name


@pytest.mark.parametrize("direction", ["adamw->cpuadam", "cpuadam->adamw"])
def test_load_state_dict_continues_trajectory(direction: str) -> None:
    # Train a first optimizer 10 steps, hand its state to the other kind, continue both 20
    # steps from identical params: same trajectory.
    kw = {"lr": 3e-3, "betas": (0.85, 0.98), "eps": 1e-7, "weight_decay": 0.05}
    first_model = _model()
    first: torch.optim.Optimizer
    if direction == "adamw->cpuadam":
        first = torch.optim.AdamW(first_model.parameters(), foreach=False, **kw)  # type: ignore[arg-type]
    else:
        first = CPUAdam(first_model.parameters(), **kw)  # type: ignore[arg-type]
    for step in range(10):
        _set_grads([first_model], step)
        first.step()
    saved = copy.deepcopy(first.state_dict())

    resumed_model = copy.deepcopy(first_model)
    second: torch.optim.Optimizer
    if direction == "adamw->cpuadam":
        second = CPUAdam(resumed_model.parameters(), lr=1.0)  # hyper-params come from the dict
    else:
        second = torch.optim.AdamW(resumed_model.parameters(), lr=1.0, foreach=False)
    second.load_state_dict(saved)
    assert second.param_groups[0]["lr"] == kw["lr"]
    for step in range(10, 30):
        _set_grads([first_model, resumed_model], step)
        first.step()
        second.step()
    _assert_close(resumed_model, first_model, second, first)


def test_shadow_updated_in_same_pass_bit_exact() -> None:
    model = _model()
    opt = CPUAdam(model.parameters(), lr=1e-2)
    shadows = [torch.empty(p.shape, dtype=torch.bfloat16) for p in model.parameters()]
    half = torch.empty(next(model.parameters()).shape, dtype=torch.float16)
    for p, s in zip(model.parameters(), shadows, strict=True):
        opt.attach_shadow(p, s)
        assert torch.equal(s.view(torch.int16), p.detach().to(torch.bfloat16).view(torch.int16))
    opt.attach_shadow(next(model.parameters()), half)  # replaces the bf16 one for the first
    for step in range(5):
        _set_grads([model], step)
        opt.step()
    params = list(model.parameters())
    assert torch.equal(half.view(torch.int16), params[0].detach().half().view(torch.int16))
    for p, s in zip(params[1:], shadows[1:], strict=True):
        assert torch.equal(s.view(torch.int16), p.detach().to(torch.bfloat16).view(torch.int16))


def test_grad_scale_and_closure() -> None:
    ours, ref = _model(), _model()
    opt = CPUAdam(ours.parameters(), weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), weight_decay=0.01, foreach=False)
    x = torch.randn(8, 33)
    scale = 1 / 512

    def closure() -> float:
        opt.zero_grad()
        loss = ours(x).square().mean() * 512  # "loss-scaled"
        loss.backward()
        return float(loss.detach())

    for _ in range(5):
        loss = opt.step(closure, grad_scale=scale)
        assert loss is not None
        ref_opt.zero_grad()
        (ref(x).square().mean() * 512).backward()
        for p in ref.parameters():
            assert p.grad is not None
            p.grad.mul_(scale)
        ref_opt.step()
    _assert_close(ours, ref, opt, ref_opt)


def test_params_without_grad_are_skipped() -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = CPUAdam(model.parameters())
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert len(opt.state) == 0


def test_shared_threads_and_pickle_roundtrip() -> None:
    model = _model()
    with AdamThreads(2) as threads:
        opt = CPUAdam(model.parameters(), threads=threads)
        _set_grads([model], 0)
        opt.step()
        opt.close()  # does not close the shared pool
        opt.step()
    clone = pickle.loads(pickle.dumps(opt))
    assert clone.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    twin = copy.deepcopy(opt)
    _set_grads([model], 1)
    twin.step()  # a fresh pool is created on demand
    twin.close()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: CPUAdam([torch.zeros(3, dtype=torch.float16)]), "param 0 is torch.float16"),
        (lambda: CPUAdam([torch.zeros(4, 4).t()]), "not contiguous"),
        (lambda: CPUAdam([{"params": [torch.zeros(3)], "amsgrad": True}]), "amsgrad=True"),
        (lambda: CPUAdam([torch.zeros(3)], betas=(0.9, 1.5)), "beta2=1.5"),
        (lambda: CPUAdam([torch.zeros(3)], lr=-1.0), "lr=-1.0"),
        (lambda: CPUAdam([torch.zeros(3)], backend="gpu"), "backend='gpu'"),  # type: ignore[arg-type]
        (lambda: CPUAdam([torch.zeros(3)], threads=0), "threads=0"),
    ],
)
def test_bad_construction_named(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        opt = make()  # type: ignore[operator]
        opt.step()


def test_bad_state_dict_and_shadow_named() -> None:
    p = torch.zeros(3, requires_grad=True)
    opt = CPUAdam([p])
    amsgrad = torch.optim.AdamW([torch.zeros(3, requires_grad=True)], amsgrad=True).state_dict()
    with pytest.raises(ValueError, match="state_dict param group 0: amsgrad=True"):
        opt.load_state_dict(amsgrad)
    with pytest.raises(ValueError, match="not in any of this optimizer's groups"):
        opt.attach_shadow(torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"shadow is torch\.float32"):
        opt.attach_shadow(p, torch.zeros(3))
    with pytest.raises(ValueError, match=r"shadow has shape \(4,\)"):
        opt.attach_shadow(p, torch.zeros(4, dtype=torch.bfloat16))


def test_rejected_group_is_not_added() -> None:
    opt = CPUAdam([torch.zeros(3, requires_grad=True)])
    with pytest.raises(ValueError, match=r"param group 1 param 1 is torch\.float64"):
        opt.add_param_group({"params": [torch.zeros(2), torch.zeros(2, dtype=torch.float64)]})
    with pytest.raises(ValueError, match=r"eps=-1\.0"):
        opt.add_param_group({"params": [torch.zeros(2)], "eps": -1.0})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": torch.zeros(2), "lr": 0.5})  # a lone tensor is accepted
    assert opt.param_groups[1]["lr"] == 0.5 and len(opt.param_groups[1]["params"]) == 1


def test_int_step_and_tensor_lr_from_a_foreign_state_dict() -> None:
    p = torch.randn(50, requires_grad=True)
    ref = p.detach().clone().requires_grad_()
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.0)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0, foreach=False)
    g = torch.randn(50)
    p.grad, ref.grad = g.clone(), g.clone()
    opt.step()
    ref_opt.step()
    saved = opt.state_dict()
    saved["state"][0]["step"] = 1  # DeepSpeed-style plain int
    saved["param_groups"][0]["lr"] = torch.tensor(1e-2)
    opt.load_state_dict(saved)
    p.grad, ref.grad = g.clone(), g.clone()
    opt.step()
    ref_opt.step()
    assert float(opt.state[p]["step"]) == 2.0
    assert (p - ref).abs().max().item() <= REL_TOL * ref.abs().max().item()


def test_param_swapped_after_adding_is_refused() -> None:
    p = torch.zeros(4, requires_grad=True)
    opt = CPUAdam([p])
    p.grad = torch.ones(4)
    opt.step()
    p.data = torch.zeros(8)  # the kernel would run past the 4-element state
    p.grad = torch.ones(8)
    with pytest.raises(ValueError, match=r"group 0 param 0 changed since it was added"):
        opt.step()
