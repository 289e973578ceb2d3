"""bf16/fp16 matrix products in fp32 on a CPU ([Note: low-precision matmul on CPU] in
engine/cpu_matmul.py).

Each op is checked against the same op on the fp32 upcasts: the forward is that op's
result rounded once (bit for bit: the same fp32 products), each gradient within one
rounding of the dtype (2**-8 relative for bf16, 2**-11 for fp16) of the fp32 autograd
gradient, at 1e-6 absolute for the elements near zero; the products computed in fp32 are
counted (forward and backward). Products computed in panels (a small `PANEL` makes small
products use them) are checked against the whole product within one rounding, with the
fp32 memory they allocate bounded by a panel and the smaller operand. The engine runs are
checked against a plain fp32 PyTorch reference with test_engine_parity's bf16/fp16
tolerance, and layer-major against micro-step bit for bit; in both, every product of
forward, backward and recomputation is counted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import make_batches, make_model, reference_train
from test_engine_parity import LOW_PRECISION_LOSS_ATOL
from test_layer_major import _assert_same, _config, _train
from torch.utils._python_dispatch import TorchDispatchMode

from tierzero import engine
from tierzero.engine import cpu_matmul
from tierzero.engine.config import ConfigError
from tierzero.engine.cpu_matmul import LowPrecisionMatmul, native_matmul_is_slow, upcast_matmul

ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
DTYPES = [torch.bfloat16, torch.float16]


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_()


def _count_products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of the products the mode computes in fp32."""
    calls = [0]
    orig = cpu_matmul._upcast

    def counted(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return orig(*args)

    monkeypatch.setattr(cpu_matmul, "_upcast", counted)
    return calls


def _check(op: Callable[..., torch.Tensor], inputs: list[torch.Tensor | None],
           dtype: torch.dtype, calls: list[int], products: int, *, sums: int = 1) -> None:
    """`op(*inputs)` under the mode against op on the fp32 upcasts: forward bit for bit
    after rounding, every gradient within one rounding; `products` of its forward and
    backward computed in fp32, and nothing saved for backward in fp32. `sums`: a gradient
    of a broadcast operand is the sum of that many rounded products, which autograd adds
    in the dtype: each term's rounding is allowed, against the largest element."""
    for t in inputs:
        if t is not None:
            t.grad = None
    saved: list[torch.dtype] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.dtype)
        return t

    calls[0] = 0
    g = torch.randn(2, generator=torch.Generator().manual_seed(99))  # replaced below
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), LowPrecisionMatmul(dtype):
        out = op(*inputs)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(dtype)
        out.backward(g)
    assert calls[0] == products
    assert out.dtype == dtype and saved and all(d == dtype for d in saved), saved

    ups = [None if t is None else t.detach().float().requires_grad_() for t in inputs]
    want = op(*ups)
    assert torch.equal(out, want.to(dtype))
    want.backward(g.float())
    for t, u in zip(inputs, ups, strict=True):
        if t is None:
            continue
        assert t.grad is not None and u is not None and u.grad is not None
        assert t.grad.dtype == dtype and t.grad.shape == t.shape
        atol = 1e-6 if sums == 1 else sums * ULP[dtype] * float(u.grad.abs().max())
        torch.testing.assert_close(t.grad.float(), u.grad, rtol=ULP[dtype], atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 8), (2, 5, 8), (2, 3, 5, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_is_the_fp32_product_rounded_once(monkeypatch: pytest.MonkeyPatch,
                                                 dtype: torch.dtype, shape: tuple[int, ...],
                                                 bias: bool) -> None:
    calls = _count_products(monkeypatch)
    x, w = _rand(*shape, dtype=dtype, seed=0), _rand(6, 8, dtype=dtype, seed=1)
    b = _rand(6, dtype=dtype, seed=2) if bias else None
    # forward, and backward's input and weight gradients
    _check(F.linear, [x, w, b], dtype, calls, 3)
    lin = torch.nn.Linear(8, 6, bias=bias)  # an nn.Linear calls the same function
    _check(lambda x, w, b: torch.func.functional_call(lin, {"weight": w, "bias": b}, (x,)),
           [x, w, b], dtype, calls, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a_shape,b_shape,sums", [
    ((5, 8), (8, 6), 1),
    ((3, 5, 8), (3, 8, 6), 1),
    ((2, 3, 5, 8), (8, 6), 1),  # b broadcast: the batch folds into one product
    ((5, 8), (2, 8, 6), 2),  # a broadcast over 2 batches: its gradient a sum of 2
    ((2, 1, 5, 8), (3, 8, 6), 3),  # both broadcast: sums of 3 and 2
])
def test_matmul_products_and_their_gradients(monkeypatch: pytest.MonkeyPatch,
                                             dtype: torch.dtype, a_shape: tuple[int, ...],
                                             b_shape: tuple[int, ...], sums: int) -> None:
    calls = _count_products(monkeypatch)
    a, b = _rand(*a_shape, dtype=dtype, seed=3), _rand(*b_shape, dtype=dtype, seed=4)
    _check(torch.matmul, [a, b], dtype, calls, 3, sums=sums)
    _check(lambda a, b: a @ b, [a, b], dtype, calls, 3, sums=sums)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mm_bmm_addmm_baddbmm(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    calls = _count_products(monkeypatch)
    a, b = _rand(5, 8, dtype=dtype, seed=5), _rand(8, 6, dtype=dtype, seed=6)
    _check(torch.mm, [a, b], dtype, calls, 3)
    c, d = _rand(3, 5, 8, dtype=dtype, seed=7), _rand(3, 8, 6, dtype=dtype, seed=8)
    _check(torch.bmm, [c, d], dtype, calls, 3)
    bias = _rand(6, dtype=dtype, seed=9)
    _check(torch.addmm, [bias, a, b], dtype, calls, 3)  # GPT-2's Conv1D
    _check(lambda i, x, y: torch.addmm(i, x, y, beta=0.5, alpha=2.0), [bias, a, b], dtype,
           calls, 3)
    base = _rand(3, 5, 6, dtype=dtype, seed=10)
    _check(lambda i, x, y: torch.baddbmm(i, x, y, alpha=0.5), [base, c, d], dtype, calls, 3)


@pytest.mark.parametrize("call", ["fp32", "mixed", "other_dtype", "out"])
def test_other_calls_pass_through(monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    """What the mode does not compute in fp32 reaches torch unchanged: its own result or
    error."""
    calls = _count_products(monkeypatch)
    bf = torch.bfloat16
    a, b = _rand(5, 8, dtype=bf, seed=0).detach(), _rand(8, 6, dtype=bf, seed=1).detach()
    with LowPrecisionMatmul(bf):
        if call == "fp32":
            assert torch.equal(torch.mm(a.float(), b.float()), a.float() @ b.float())
        elif call == "mixed":  # torch's own error for mixed dtypes
            with pytest.raises(RuntimeError):
                torch.mm(a, b.float())
        elif call == "other_dtype":  # the mode computes its own dtype only
            torch.mm(a.half(), b.half())
        else:  # an out= overload
            torch.mm(a, b, out=torch.empty(5, 6, dtype=bf))
    assert calls[0] == 0


def _count_panels(monkeypatch: pytest.MonkeyPatch, panel: int) -> list[int]:
    """Products over `panel` elements computed in panels of about that many; a counter."""
    monkeypatch.setattr(cpu_matmul, "PANEL", panel)
    calls = [0]
    orig = cpu_matmul._panels

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return orig(*args, **kwargs)

    monkeypatch.setattr(cpu_matmul, "_panels", counted)
    return calls


def _layout(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`t` itself, or the same values stored column-major (a transposed weight's layout)."""
    return t.t().contiguous().t() if transposed else t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mkn", [(5, 8, 40), (40, 8, 5), (13, 7, 29), (3, 0, 50), (1, 70, 3)])
@pytest.mark.parametrize("bias", [None, (-1,), (0, -1), (1, -1), (0, 1)])
@pytest.mark.parametrize("transposed", [False, True])
def test_products_in_panels_are_the_whole_product(monkeypatch: pytest.MonkeyPatch,
                                                  dtype: torch.dtype, mkn: tuple[int, int, int],
                                                  bias: tuple[int, ...] | None,
                                                  transposed: bool) -> None:
    """mm and addmm in panels of 64 elements (by columns where b is the larger operand, by
    rows where a is, the last panel ragged; K = 0; operands in either layout; addmm's
    bias in each broadcast shape, its beta and alpha): the fp32 product rounded once,
    within one rounding of the dtype of the whole product's."""
    panels = _count_panels(monkeypatch, 64)
    _mm_or_addmm(mkn, dtype, bias, transposed, seed=11)
    assert panels[0] == 1


def _mm_or_addmm(mkn: tuple[int, int, int], dtype: torch.dtype, bias: tuple[int, ...] | None,
                 transposed: bool, *, seed: int) -> None:
    """mm (no `bias`) or addmm with beta 0.5 and alpha 2 of [m, k] @ [k, n] under the mode,
    operands stored as `transposed` says, the bias shaped by `bias` (0: m, -1: n, 1: a
    broadcast 1): the result contiguous, within one rounding of the dtype of the fp32
    product's."""
    m, k, n = mkn
    a = _layout(_rand(m, k, dtype=dtype, seed=seed).detach(), transposed)
    b = _layout(_rand(k, n, dtype=dtype, seed=seed + 1).detach(), transposed)
    shape = None if bias is None else tuple(m if d == 0 else n if d == -1 else 1 for d in bias)
    i = None if shape is None else _rand(*shape, dtype=dtype, seed=seed + 2).detach()
    with LowPrecisionMatmul(dtype):
        got = torch.mm(a, b) if i is None else torch.addmm(i, a, b, beta=0.5, alpha=2.0)
    want = (a.float() @ b.float() if i is None
            else torch.addmm(i.float(), a.float(), b.float(), beta=0.5, alpha=2.0))
    assert got.dtype == dtype and got.shape == (m, n) and got.is_contiguous()
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=ULP[dtype], atol=1e-6)


@pytest.mark.parametrize("panel,column_major", [(64, False), (200, True), (None, True)])
def test_panels_ignore_the_bias_where_beta_is_zero(monkeypatch: pytest.MonkeyPatch,
                                                   panel: int | None,
                                                   column_major: bool) -> None:
    """addmm with beta 0 ignores its input, NaN included, in panels as in one product,
    with its fp32 results row-major (panels of 4 columns) or column-major (panels of 15
    columns, and the whole product: [Note: the product's larger operand on the left])."""
    if panel is None:
        monkeypatch.setattr(cpu_matmul, "PANEL", 1 << 40)
    else:
        panels = _count_panels(monkeypatch, panel)
    layouts = _record_layouts(monkeypatch)
    a, b = _rand(5, 8, dtype=torch.bfloat16, seed=0), _rand(8, 40, dtype=torch.bfloat16, seed=1)
    nan = torch.full((40,), float("nan"), dtype=torch.bfloat16)
    with LowPrecisionMatmul(torch.bfloat16), torch.no_grad():
        got = torch.addmm(nan, a, b, beta=0)
    if panel is not None:
        assert panels[0] == 1
    assert layouts and all(col == column_major for col in layouts), layouts
    torch.testing.assert_close(got.float(), (a.float() @ b.float()).bfloat16().float(),
                               rtol=ULP[torch.bfloat16], atol=1e-6)


def _record_layouts(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each fp32 result the mode's mm and addmm compute into is column-major."""
    seen: list[bool] = []
    orig = cpu_matmul._product

    def recorded(res: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        seen.append(res.stride(0) == 1 and res.stride(1) == res.shape[0] > 1)
        orig(res, *args, **kwargs)

    monkeypatch.setattr(cpu_matmul, "_product", recorded)
    return seen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [  # m, k, n: [m, k] @ [k, n]; whether column-major
    (3, 40, 200, True),  # a linear layer's forward or input gradient at few tokens
    (2, 5, 9, True),  # a short result with a longer reduction
    (40, 3, 200, False),  # a weight gradient: the reduction (tokens) is the short side
    (40, 40, 50, False),  # more than half as many rows as columns
    (3, 3, 200, False),  # as many rows as the reduction is long
])
@pytest.mark.parametrize("setup", [(p, t) for p in (None, 1000) for t in (False, True)])
@pytest.mark.parametrize("bias", [None, (-1,), (0, -1), (0, 1)])
def test_short_wide_results_take_the_larger_operand_on_the_left(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
        case: tuple[int, int, int, bool], setup: tuple[int | None, bool],
        bias: tuple[int, ...] | None) -> None:
    """[Note: the product's larger operand on the left]: mm and addmm whose result has at
    most half as many rows as columns and fewer rows than the reduction is long compute
    into a column-major fp32 result, whole or in panels of 1000 elements (the other
    shapes into a row-major one): the fp32 product rounded once, within one rounding of
    the dtype of the whole product's, returned contiguous, with operands in either layout
    and addmm's bias in each broadcast shape."""
    m, k, n, column_major = case
    panel, transposed = setup  # panels of that many elements (None: whole); operands' layout
    if panel is None:
        monkeypatch.setattr(cpu_matmul, "PANEL", 1 << 40)
    else:
        panels = _count_panels(monkeypatch, panel)
    layouts = _record_layouts(monkeypatch)
    _mm_or_addmm((m, k, n), dtype, bias, transposed, seed=21)
    big = max(m * k, k * n, m * n) > 1000
    if panel is not None:
        assert panels[0] == int(big)
    if panel is not None and big:
        assert layouts and all(col == column_major for col in layouts), layouts
    else:  # one product: column-major, or torch's own (nothing recorded)
        assert layouts == ([True] if column_major else []), layouts


def test_a_linear_at_few_tokens_computes_its_forward_and_input_gradient_column_major(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """F.linear at 2 tokens (x 2 x 64, weight 300 x 64): its forward and input gradient
    compute into column-major fp32 results and its weight gradient ([300, 2] @ [2, 64])
    into row-major ones, whole and in panels of 4096 elements (5 panels each: 62 of the
    forward's 300 columns, 13 of the input gradient's 64, 62 of the weight gradient's 300
    rows); the output and gradients within one rounding of fp32 autograd's."""
    for panel, forward, backward in ((1 << 40, [True], [True]),  # dW: torch's own mm
                                     (4096, [True] * 5, [False] * 5 + [True] * 5)):
        monkeypatch.setattr(cpu_matmul, "PANEL", panel)
        layouts = _record_layouts(monkeypatch)
        x = _rand(2, 64, dtype=torch.bfloat16, seed=0)
        w = _rand(300, 64, dtype=torch.bfloat16, seed=1)
        dy = torch.randn(2, 300, generator=torch.Generator().manual_seed(2)).bfloat16()
        with LowPrecisionMatmul(torch.bfloat16):
            y = F.linear(x, w)
            assert layouts == forward
            layouts.clear()
            y.backward(dy)
        assert sorted(layouts) == backward
        ups = [t.detach().float().requires_grad_() for t in (x, w)]
        want = F.linear(*ups)
        want.backward(dy.float())
        torch.testing.assert_close(y.float(), want.bfloat16().float(),
                                   rtol=ULP[torch.bfloat16], atol=1e-6)
        for t, u in zip((x, w), ups, strict=True):
            assert t.grad is not None and u.grad is not None
            torch.testing.assert_close(t.grad.float(), u.grad, rtol=ULP[torch.bfloat16],
                                       atol=1e-6)
        monkeypatch.undo()


class _Fp32Sizes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the element count of every fp32 tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sizes: list[int] = [0]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.sizes.append(t.numel())
        return out


@pytest.mark.parametrize("panel", [512, None])
def test_panels_bound_the_fp32_memory_of_a_linear(monkeypatch: pytest.MonkeyPatch,
                                                  panel: int | None) -> None:
    """A Linear's forward and backward (the weight read twice, its gradient written once)
    with a weight of 96 x 64 and 4 tokens: in panels of 512 elements no fp32 tensor is
    larger than a panel or an activation; upcast whole (no panels), the weight's own fp32
    copy is, and the gradients are the same."""
    if panel is not None:
        panels = _count_panels(monkeypatch, panel)
    else:
        monkeypatch.setattr(cpu_matmul, "PANEL", 1 << 40)
    monkeypatch.setattr(cpu_matmul, "_idle", [])  # no scratch to reuse
    x = _rand(4, 64, dtype=torch.bfloat16, seed=0)
    w = _rand(96, 64, dtype=torch.bfloat16, seed=1)
    dy = torch.randn(4, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    sizes = _Fp32Sizes()
    with sizes, LowPrecisionMatmul(torch.bfloat16):
        F.linear(x, w).backward(dy)
    ups = [t.detach().float().requires_grad_() for t in (x, w)]
    F.linear(*ups).backward(dy.float())
    for t, u in zip((x, w), ups, strict=True):
        assert t.grad is not None and u.grad is not None
        torch.testing.assert_close(t.grad.float(), u.grad, rtol=ULP[torch.bfloat16], atol=1e-6)
    if panel is None:
        assert max(sizes.sizes) == w.numel()
    else:
        assert panels[0] == 3  # the forward, the input and the weight gradient
        assert max(sizes.sizes) <= max(panel, 4 * 96) < w.numel(), sizes.sizes


def test_the_scratch_pool_keeps_one_buffer_per_product_running_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Panelled products on 8 threads, one after another (as layer-major's micro-batch
    threads take turns), leave one scratch buffer to reuse, not one per thread; a product
    while another holds a scratch leaves two."""
    panels = _count_panels(monkeypatch, 64)
    monkeypatch.setattr(cpu_matmul, "_idle", [])
    a = _rand(5, 8, dtype=torch.bfloat16, seed=0).detach()
    b = _rand(8, 40, dtype=torch.bfloat16, seed=1).detach()
    want = (a.float() @ b.float()).bfloat16()
    got: list[torch.Tensor] = []

    def product() -> None:
        with LowPrecisionMatmul(torch.bfloat16):
            got.append(torch.mm(a, b))

    def on_a_thread() -> None:
        t = threading.Thread(target=product)
        t.start()
        t.join()

    for _ in range(8):
        on_a_thread()
    assert len(cpu_matmul._idle) == 1
    with cpu_matmul._scratch_fp32(64):  # held, as by a product running meanwhile
        on_a_thread()
    assert len(cpu_matmul._idle) == 2
    assert panels[0] == 9 and len(got) == 9
    for t in got:
        torch.testing.assert_close(t.float(), want.float(), rtol=ULP[torch.bfloat16], atol=1e-6)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_which_engines_upcast() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    for dtype in DTYPES:
        assert upcast_matmul("fp32", cpu, dtype)
        assert not upcast_matmul("native", cpu, dtype)
        assert upcast_matmul("auto", cpu, dtype) == native_matmul_is_slow(dtype)
        assert not upcast_matmul("fp32", meta, dtype)  # a dry run; an accelerator alike
        with torch.backends.mkldnn.flags(enabled=False):  # oneDNN off: the scalar fallback
            assert native_matmul_is_slow(dtype)
            assert upcast_matmul("auto", cpu, dtype)
    assert not upcast_matmul("fp32", cpu, torch.float32)
    assert not native_matmul_is_slow(torch.float32)


def test_bad_setting_is_refused_with_its_key() -> None:
    with pytest.raises(ConfigError, match=r"precision\.cpu_matmul.*'fp64'.*auto.*native.*fp32"):
        engine.load_config({"precision": {"dtype": "bf16", "cpu_matmul": "fp64"}})


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("setting", ["fp32", "fp32-panels", "native"])
def test_engine_tracks_fp32_either_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       precision: str, setting: str) -> None:
    """An engine computing in fp32 products trains as the native one does: within the bf16
    and fp16 parity tolerance of plain fp32 PyTorch. With fp32 every product of every
    Linear (the head and two per block) is computed in fp32: its forward and its input
    and weight gradients, each micro-step; none with `native`. fp32-panels: the same,
    every product over 256 elements in panels."""
    calls = _count_products(monkeypatch)
    panels = _count_panels(monkeypatch, 256) if setting == "fp32-panels" else [0]
    setting = setting.removesuffix("-panels")
    steps = 4
    batches = make_batches(steps)
    cfg = engine.load_config({
        "precision": {"dtype": precision, "cpu_matmul": setting},
        "zero": {"stage": 3, "units": ["Block"], "persistence_threshold_bytes": 0},
        "optimizer": {"type": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": 0.1},
        "gradient_clipping": 0.5})
    ref = reference_train(make_model(), cfg, [batches], steps)
    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    losses = []
    for ids, tg in batches:
        loss = eng(ids, tg)
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
    assert eng.memory_report()["cpu_matmul"] == setting
    eng.close()
    diff = (torch.tensor(losses) - torch.tensor(ref.losses)).abs().max()
    assert float(diff) < LOW_PRECISION_LOSS_ATOL, (losses, ref.losses)
    assert calls[0] == (steps * 3 * (1 + 2 * len(model.blocks)) if setting == "fp32" else 0)
    assert (panels[0] > 0) == (cpu_matmul.PANEL == 256)


def test_layer_major_recomputes_under_the_same_products(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer-major recomputes each unit's forward in backward: with the products in fp32 it
    ends bit for bit where micro-step does, as with native products
    (test_layer_major_equals_micro_step_bit_for_bit), and every block's Linears ran
    in fp32 there too (on the micro-batch threads and in the recomputation)."""
    calls = _count_products(monkeypatch)
    steps, gas, blocks = 2, 4, len(make_model().blocks)
    batches = make_batches(steps * gas)
    extra = {"precision": {"dtype": "bf16", "cpu_matmul": "fp32"}}
    runs, counts = {}, {}
    for s in ("micro_step", "layer_major"):
        calls[0] = 0
        runs[s] = _train(make_model(), _config(tmp_path / s, schedule=s, clip=0.5, gas=gas,
                                               extra=extra), batches)
        counts[s] = calls[0]
    assert counts["micro_step"] == steps * gas * 3 * (1 + 2 * blocks)
    assert counts["layer_major"] == counts["micro_step"] + steps * gas * 2 * blocks, counts
    assert runs["layer_major"]["schedule"] == "layer_major"
    assert runs["layer_major"]["report"]["cpu_matmul"] == "fp32"
    _assert_same(runs["layer_major"], runs["micro_step"], exact=True)


def test_activation_checkpointing_recomputes_under_the_mode(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A model's own activation checkpointing recomputes its blocks inside backward():
    their products are computed in fp32 there too, and the run tracks fp32 PyTorch."""
    calls = _count_products(monkeypatch)
    steps = 2
    batches = make_batches(steps)
    cfg = engine.load_config({
        "precision": {"dtype": "bf16", "cpu_matmul": "fp32"},
        "zero": {"stage": 3, "units": ["Block"], "persistence_threshold_bytes": 0},
        "optimizer": {"type": "adamw", "lr": 1e-2}, "gradient_clipping": 0.5})
    ref = reference_train(make_model(), cfg, [batches], steps)
    model = make_model()
    model.checkpointed = True
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    losses = []
    # every block recomputed whole (early stop would end it after its last saved tensor)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        for ids, tg in batches:
            loss = eng(ids, tg)
            eng.backward(loss)
            eng.step()
            losses.append(float(loss.detach()))
    eng.close()
    blocks = len(model.blocks)
    assert calls[0] == steps * (3 * (1 + 2 * blocks) + 2 * blocks)
    diff = (torch.tensor(losses) - torch.tensor(ref.losses)).abs().max()
    assert float(diff) < LOW_PRECISION_LOSS_ATOL, (losses, ref.losses)
