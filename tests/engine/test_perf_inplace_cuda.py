"""The in-place CPU Adam begun during backward with a CUDA device ([Note: in-place early
step]): backward runs on the GPU while the worker thread updates each final unit's host
state, then writes its param to the GPU (params "none") or to host memory (params
"cpu"); overlap on must be bit-identical to off, and match plain PyTorch AdamW on the
same GPU.

Tolerances: as tests/engine/test_perf_cuda.py (params 1e-4 absolute, losses 1e-5 relative: the
CPU parity bounds with 10x margin for GPU reduction kernels).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from engine_helpers import in_place_of, make_batches, make_config
from test_engine_cuda import _engine, _reference

from tierzero.engine.config import Config
from tierzero.engine.config.schema import OffloadConfig, OptimizerOffloadConfig, ParamOffloadConfig
from tierzero.engine.step.offloaded import OffloadedStep

pytestmark = pytest.mark.cuda
STEPS = 6


def _config(params: str, overlap: bool, precision: str = "fp32", gas: int = 2) -> Config:
    return dataclasses.replace(make_config(precision=precision, gas=gas), offload=OffloadConfig(
        params=ParamOffloadConfig(device=params),  # type: ignore[arg-type]
        optimizer=OptimizerOffloadConfig(device="cpu", overlap_step=overlap)))


def _record_threads(opt: OffloadedStep) -> set[str]:
    """Names of the threads the in-place kernel runs on from now on."""
    step = in_place_of(opt)
    assert step is not None
    names: set[str] = set()
    real = step.update

    def spy(key: str, *args: object) -> float:
        names.add(threading.current_thread().name)
        return real(key, *args)  # type: ignore[arg-type]

    step.update = spy  # type: ignore[method-assign, assignment]
    return names


@pytest.mark.parametrize("params", ["none", "cpu"])
def test_cuda_in_place_step_during_backward_is_exact(params: str) -> None:
    gas = 2
    batches = make_batches(STEPS * gas)
    ref_losses, ref = _reference(_config(params, True), batches)
    runs = {}
    for overlap in (True, False):
        losses, got, eng = _engine(_config(params, overlap), batches)
        try:
            opt = eng.step_driver
            assert isinstance(opt, OffloadedStep) and in_place_of(opt) is not None
            if overlap:
                names = _record_threads(opt)
                ids, tg = batches[0]
                for _ in range(gas):
                    eng.backward(eng(ids, tg))
                    if eng.is_gradient_accumulation_boundary():
                        assert opt.step_open  # begun during this backward
                    eng.step()
                assert not opt.step_open
                assert any(n.startswith("tierzero-adam-early") for n in names), names
        finally:
            eng.close()
        runs[overlap] = (losses, got)
    (on_l, on_p), (off_l, off_p) = runs[True], runs[False]
    assert on_l == off_l
    for k in off_p:
        assert torch.equal(on_p[k], off_p[k]), k
    torch.testing.assert_close(torch.tensor(on_l), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for k, want in ref.items():
        torch.testing.assert_close(on_p[k], want, rtol=0, atol=1e-4, msg=k)


def test_cuda_in_place_bf16_overlap_is_bit_identical() -> None:
    batches = make_batches(STEPS)
    out = []
    for overlap in (True, False):
        losses, got, eng = _engine(_config("none", overlap, "bf16", gas=1), batches)
        eng.close()
        out.append((losses, got))
    assert out[0][0] == out[1][0]
    for k in out[1][1]:
        assert torch.equal(out[0][1][k], out[1][1][k]), k
