"""Per-unit overhead of the gather/reduce path. The gradient accumulation into the fp32
shard (shards.flat.add_upcast) must give exactly the bits of PyTorch's mixed-dtype `add_`
(tolerance: none); a CPU-device gather of host-homed params copies nothing extra."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import make_batches, make_config, make_model

from tierzero import engine
from tierzero.engine.config.schema import OffloadConfig, OptimizerOffloadConfig, ParamOffloadConfig
from tierzero.engine.shards.flat import _UPCAST_CHUNK, add_upcast


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [7, _UPCAST_CHUNK, 3 * _UPCAST_CHUNK + 129])
def test_add_upcast_is_bitwise_mixed_dtype_add(dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    dst = torch.randn(n, generator=g) * 1e3
    src = (torch.randn(n, generator=g) * 10).to(dtype)
    src[:4] = torch.tensor([float("inf"), float("nan"), -0.0, 1e-30]).to(dtype)
    dst[4:6] = torch.tensor([-0.0, float("-inf")])
    want, got = dst.clone(), dst.clone()
    for _ in range(2):  # the second add sees the first one's result (accumulation)
        want.add_(src)
        add_upcast(got, src)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))

def test_add_upcast_into_a_view_leaves_the_rest_alone() -> None:
    base = torch.zeros(2 * _UPCAST_CHUNK + 10)
    src = torch.ones(_UPCAST_CHUNK + 5, dtype=torch.bfloat16)
    add_upcast(base[3:3 + src.numel()], src)
    assert float(base.sum()) == src.numel() and base[:3].eq(0).all()
    assert base[3 + src.numel():].eq(0).all()


def test_cpu_device_gathers_host_param_from_its_home() -> None:
    """Params homed in host memory with the CPU as compute device: a gather reads the
    shard where it lives (no copy into the "device" tier, which is host memory too);
    bit-identical results are checked by the offload parity tests."""
    cfg = dataclasses.replace(make_config(precision="bf16"), offload=OffloadConfig(
        params=ParamOffloadConfig(device="cpu"), optimizer=OptimizerOffloadConfig(device="cpu")))
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
    try:
        for ids, tg in make_batches(2):
            eng.backward(eng(ids, tg))
            eng.step()
        tiers = eng.memory_report()["tiers"]
        assert isinstance(tiers, dict)
        assert tiers["moved"].get("host_to_device", 0) == 0, tiers["moved"]
        assert eng.scheduler.gathers > 0
    finally:
        eng.close()
