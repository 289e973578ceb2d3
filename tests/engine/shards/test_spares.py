"""Gather buffers handed to the next gather on a CPU device ([Note: gather buffers kept for
the next gather] in engine/shards/spares.py): the memory moves, the results do not change,
and the gathered bytes plus the spares' never exceed the most ever gathered at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    full_params,
    make_batches,
    make_config,
    make_model,
    needs_storage_swap,
    offload_config,
    train_steps,
)

from tierzero import engine
from tierzero.engine.shards import spares as spares_mod
from tierzero.engine.shards.spares import GatherSpares, spares_supported

# torch >= 2.3 is supported; the storage swap the spares use is private and may be missing:
# a gather allocates as before (test_no_spares_where_torch_lacks_the_swap covers that)
needs_swap = needs_storage_swap("no spares")


def _filled(nbytes: int, value: int) -> torch.Tensor:
    return torch.full((nbytes,), value, dtype=torch.uint8)


@needs_swap
def test_keep_moves_the_memory_and_take_hands_it_back() -> None:
    spares = GatherSpares()
    buf = _filled(4096, 7)
    ptr = buf.data_ptr()
    view = buf[100:200]  # as autograd keeps a view of a gathered buffer
    spares.keep(buf.untyped_storage())
    assert buf.untyped_storage().nbytes() == 0  # emptied, as resize_(0) leaves it
    assert view.untyped_storage().nbytes() == 0
    assert (len(spares), spares.nbytes, spares.kept) == (1, 4096, 1)

    other = torch.empty(4096, dtype=torch.uint8)
    other.untyped_storage().resize_(0)
    assert spares.take(other.untyped_storage(), 4096)
    assert other.data_ptr() == ptr  # the same memory, not a new allocation
    assert bool((other == 7).all())  # not zeroed or copied: the pages as they were
    assert (len(spares), spares.nbytes, spares.reused) == (0, 0, 1)


@needs_swap
def test_take_picks_the_newest_of_its_size() -> None:
    spares = GatherSpares()
    a, b, c = _filled(4096, 1), _filled(8192, 2), _filled(4096, 3)
    for t in (a, b, c):
        spares.keep(t.untyped_storage())
    out = torch.empty(4096, dtype=torch.uint8)
    out.untyped_storage().resize_(0)
    assert spares.take(out.untyped_storage(), 4096)
    assert bool((out == 3).all())
    assert (len(spares), spares.nbytes) == (2, 4096 + 8192)


@needs_swap
def test_a_miss_frees_every_spare_before_the_caller_allocates() -> None:
    spares = GatherSpares()
    for v in (1, 2):
        spares.keep(_filled(4096, v).untyped_storage())
    out = torch.empty(0, dtype=torch.uint8)
    assert not spares.take(out.untyped_storage(), 12288)
    assert (len(spares), spares.nbytes, spares.reused) == (0, 0, 0)


@needs_swap
def test_take_refuses_a_storage_that_holds_memory() -> None:
    spares = GatherSpares()
    spares.keep(_filled(4096, 1).untyped_storage())
    with pytest.raises(ValueError, match="holds 4096 bytes"):
        spares.take(_filled(4096, 2).untyped_storage(), 4096)
    assert len(spares) == 1  # nothing moved


@needs_swap
def test_supported_on_cpu_only_and_where_torch_swaps(monkeypatch: pytest.MonkeyPatch) -> None:
    assert spares_supported(torch.device("cpu"))
    assert not spares_supported(torch.device("meta"))
    monkeypatch.setattr(spares_mod, "_SWAP", "_no_such_method_")
    assert not spares_supported(torch.device("cpu"))


def _run(cfg: Any, steps: int, *, checkpointed: bool = False, frozen: bool = False,
         watch: bool = False) -> dict[str, Any]:
    """Train `steps` steps of the tiny LM on the CPU; losses, params, the spares' counters
    and (`watch`) every gather's and release's gathered + spare bytes against the peak."""
    model = make_model()
    model.checkpointed = checkpointed
    if frozen:  # each block: a frozen group and a trainable one, of other sizes
        for block in model.blocks:
            block.up.requires_grad_(False)
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    sched = eng.scheduler
    over: list[tuple[str, int, int, int]] = []
    between: list[int] = []
    if watch:
        def check(what: str) -> None:
            held = sched.spares.nbytes if sched.spares is not None else 0
            if sched.gathered_bytes() + held > sched.gathered_peak_bytes:
                over.append((what, sched.gathered_bytes(), held, sched.gathered_peak_bytes))

        gather, release = sched.ensure_gathered, sched.release

        def ensure_gathered(unit: Any) -> None:
            gather(unit)
            check(f"gather {unit.label}")

        def release_(unit: Any) -> None:
            release(unit)
            check(f"release {unit.label}")

        sched.ensure_gathered, sched.release = ensure_gathered, release_
    losses: list[float] = []
    for batch in make_batches(steps):
        losses += train_steps(eng, [batch])
        if sched.spares is not None:
            between.append(sched.spares.nbytes)
    spares = sched.spares
    out = {"losses": losses, "params": full_params(eng, model), "over": over,
           "between": between,
           "reused": None if spares is None else spares.reused,
           "kept": None if spares is None else spares.kept}
    eng.close()
    assert spares is None or len(spares) == 0  # close frees them
    return out


def _without_spares(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tierzero.engine.unit_build.spares_supported", lambda device: False)


@needs_swap
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", [  # (offload device, checkpointed, frozen)
    ("cpu", False, False), ("nvme", False, False), ("nvme", True, False),
    ("cpu", False, True)])
def test_same_bits_with_and_without_spares(case: tuple[str, bool, bool], precision: str,
                                           tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An offloaded shard is copied into its unit's buffer (a shard on the device is viewed
    instead, with no buffer to keep); activation checkpointing reads the buffers again in
    backward; a frozen group beside a trainable one gives spares of two sizes."""
    offload, checkpointed, frozen = case
    # an NVMe shard's gather views the pool's buffer instead ([Note: a gather viewing the
    # pool's buffer], tested in test_lent.py): here it copies, into spares
    monkeypatch.setattr("tierzero.engine.shards.flat.lending_supported", lambda device: False)
    cfg = offload_config(make_config(precision, clip=1.0), offload,
                         tmp_path if offload == "nvme" else None)
    kw = {"checkpointed": checkpointed, "frozen": frozen}
    got = _run(cfg, 3, watch=True, **kw)
    # released buffers were handed on, within the bound, and none held between steps
    assert got["kept"] > 0 and got["reused"] > 0, got
    assert got["over"] == [], got["over"]
    assert got["between"] == [0, 0, 0]
    with monkeypatch.context() as m:
        _without_spares(m)
        want = _run(cfg, 3, **kw)
    assert want["reused"] is None  # the reference ran without any
    assert got["losses"] == want["losses"]
    for k, v in want["params"].items():
        assert torch.equal(got["params"][k], v), k


def _offloaded() -> Any:
    return offload_config(make_config(), "cpu", None)


@needs_swap
def test_gathered_parameters_between_steps_keeps_nothing() -> None:
    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=_offloaded())
    ids, tg = make_batches(1)[0]
    eng.backward(eng(ids, tg))
    eng.step()
    with engine.GatheredParameters(list(model.blocks[1].parameters())):
        pass
    assert eng.scheduler.spares is not None and len(eng.scheduler.spares) == 0
    eng.close()


@needs_swap
def test_a_forward_that_fails_keeps_nothing() -> None:
    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=_offloaded())

    def fail(module: Any, args: Any, output: Any) -> None:
        raise RuntimeError("failed in block 2")

    handle = model.blocks[2].register_forward_hook(fail)
    ids, tg = make_batches(1)[0]
    with pytest.raises(RuntimeError, match="failed in block 2"):
        eng(ids, tg)  # blocks 0 and 1 were released on the way: spares, until the abort
    assert eng.scheduler.spares is not None
    assert eng.scheduler.spares.kept > 0
    assert len(eng.scheduler.spares) == 0
    handle.remove()
    eng.backward(eng(ids, tg))  # the engine goes on
    eng.step()
    eng.close()


def test_no_spares_where_torch_lacks_the_swap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spares_mod, "_SWAP", "_no_such_method_")
    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=_offloaded())
    assert eng.scheduler.spares is None
    ids, tg = make_batches(1)[0]
    eng.backward(eng(ids, tg))
    eng.step()
    eng.close()
