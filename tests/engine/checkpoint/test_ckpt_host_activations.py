"""activations.cpu_offload: saved activations wait for backward in host memory.

Copies are exact, so the CPU comparisons are bit for bit (torch.equal): the same kernels
see the same values whether an activation waited on the device or on the host. The CUDA
tests (run on a GPU machine) allow 1e-6 for CUDA's order-nondeterministic atomics.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from engine_helpers import make_batches, make_config, make_model

from tierzero import engine
from tierzero.engine.activations import HostActivations, HostActivationStats
from tierzero.engine.config.schema import ActivationsConfig

STEPS = 3


def _config(cpu_offload: bool) -> engine.Config:
    return dataclasses.replace(make_config(clip=0.5), activations=(
        ActivationsConfig(cpu_offload=cpu_offload)))


def _train(cpu_offload: bool, device: str, *, force_cpu_hooks: bool = False
           ) -> tuple[list[float], dict[str, torch.Tensor], HostActivationStats]:
    model = make_model()
    model.checkpointed = True  # non-reentrant torch.utils.checkpoint around every block
    eng, _, _, _ = engine.initialize(model=model, config=_config(cpu_offload), device=device)
    if force_cpu_hooks:  # drive the CUDA path's hooks on a CPU machine (copies to host)
        eng._activation_hooks = lambda: HostActivations(  # type: ignore[method-assign]
            eng.activation_stats, pin_memory=False, moved_from=("cpu",))
    losses = []
    for ids, tg in make_batches(STEPS):
        loss = eng(ids, tg)
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
    with engine.GatheredParameters(list(model.parameters())):
        params = {k: v.detach().cpu().clone() for k, v in model.named_parameters()}
    stats = eng.activation_stats
    eng.close()
    return losses, params, stats


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_config_key() -> None:
    assert engine.load_config({}).activations.cpu_offload is False
    cfg = engine.load_config({"activations": {"cpu_offload": True}})
    assert cfg.activations.cpu_offload is True
    with pytest.raises(engine.ConfigError, match=r"activations.cpu_offload: 3 is "
                                                 r"not allowed; allowed: true or false"):
        engine.load_config({"activations": {"cpu_offload": 3}})


def test_deepspeed_cpu_checkpointing_maps_to_the_switch() -> None:
    cfg = engine.load_config({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {
        "cpu_checkpointing": True, "partition_activations": True, "number_checkpoints": 4}})
    assert cfg.activations.cpu_offload is True
    assert set(cfg.ignored_keys) >= {"activation_checkpointing.partition_activations",
                                     "activation_checkpointing.number_checkpoints"}


def test_cpu_device_is_a_logged_no_op(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tierzero.engine.engine")
    on = _train(True, "cpu")
    off = _train(False, "cpu")
    assert on[0] == off[0] and _same(on[1], off[1])
    assert on[2].packed_tensors == 0
    assert sum("cpu_offload" in r.getMessage() and "no-op" in r.getMessage()
               for r in caplog.records) == 1


def test_hooks_move_activations_and_keep_parameters_exact() -> None:
    """The hooks the engine installs on CUDA, run here over CPU tensors: checkpointed block
    inputs and the other saved activations go through host copies, gathered parameters stay
    put, and training is bit-identical."""
    on = _train(True, "cpu", force_cpu_hooks=True)
    off = _train(False, "cpu")
    assert on[0] == off[0] and _same(on[1], off[1])
    stats = on[2]
    assert stats.packed_tensors >= STEPS * 4  # at least each of 4 blocks' input, each step
    assert stats.kept_parameters > 0  # the head's weight (saved by its matmul) stayed put


def test_plain_pytorch_checkpoint_inputs_are_packed() -> None:
    """With non-reentrant checkpointing torch saves only the block inputs through the hooks
    (the blocks' insides are recomputed): fewer, not zero, tensors than without it."""
    counts = []
    for checkpointed in (False, True):
        model = make_model()
        model.checkpointed = checkpointed
        stats = HostActivationStats()
        ids, tg = make_batches(1)[0]
        with HostActivations(stats, pin_memory=False, moved_from=("cpu",)):
            loss = model(ids, tg)
        loss.backward()
        counts.append(stats.packed_tensors)
    assert 4 <= counts[1] < counts[0]


@pytest.mark.cuda
def test_cuda_saved_activations_are_in_pinned_host_memory() -> None:
    on = _train(True, "cuda")
    off = _train(False, "cuda")
    # Host copies are exact, but CUDA's embedding backward accumulates with atomics (order
    # not fixed), so two runs may differ in the last bits: 1e-6 allows that and nothing more.
    torch.testing.assert_close(torch.tensor(on[0]), torch.tensor(off[0]), rtol=1e-6, atol=0.0)
    for k, v in off[1].items():
        torch.testing.assert_close(on[1][k], v, rtol=0.0, atol=1e-6, msg=k)
    stats = on[2]
    assert stats.packed_tensors >= STEPS * 4
    assert stats.pinned_tensors == stats.packed_tensors  # every host copy is pinned
    assert off[2].packed_tensors == 0


@pytest.mark.cuda
def test_cuda_activations_leave_device_memory() -> None:
    """Between forward and backward the device holds less with the switch on (a wide batch
    so activations dominate)."""
    held = {}
    for on in (False, True):
        model = make_model()
        eng, _, _, _ = engine.initialize(model=model, config=_config(on), device="cuda")
        ids = torch.randint(0, 64, (256, 8))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = eng(ids, (ids * 5 + 1) % 64)
        torch.cuda.synchronize()
        held[on] = torch.cuda.memory_allocated() - before
        eng.backward(loss)
        eng.close()
    assert held[True] < held[False], held
