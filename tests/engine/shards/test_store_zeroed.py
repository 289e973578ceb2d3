"""The stores keep the "gradient zeroed" rule ([Note: gradients zeroed on first use] in
engine/shards/store.py): zero_grad()'s mark writes nothing; the first use of a marked
shard sees zeros; a reduction is told to overwrite; a write-everything use and the deferred
update's read take or ignore the mark; on NVMe a marked shard is never read.

Exactness: the shards are compared bitwise (torch.equal); byte counts are the tier
manager's own (memory_report().moved), which count every transfer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from engine_helpers import make_config

from tierzero.engine.config import Config
from tierzero.engine.config.schema import (
    BudgetsConfig,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)
from tierzero.engine.shards.store import ShardStore
from tierzero.engine.shards.tiered import TieredShardStore

N = 4096


def plain(keys: tuple[str, ...] = ("a", "b")) -> ShardStore:
    store = ShardStore(torch.device("cpu"))
    for k in keys:
        store.add(k, torch.zeros(N), torch.float32, trainable=True)
        store.tensor(k, "grad").fill_(3.0)  # an old gradient
    return store


def test_mark_writes_nothing_and_first_use_sees_zeros() -> None:
    store = plain()
    view = store.tensor("a", "grad")
    store.mark_grads_zeroed(["a", "b"])
    assert store.grad_zeroed("a") and bool((view == 3.0).all())  # the mark wrote nothing
    with store.use("a", "grad") as g:
        assert not g.any()
    assert not view.any() and not store.grad_zeroed("a")  # written once, mark taken
    assert not store.tensor("b", "grad").any() and not store.grad_zeroed("b")


def test_a_reduction_is_told_to_overwrite_once() -> None:
    store = plain()
    store.mark_grads_zeroed(["a"])
    with store.use_grad_sum("a") as (g, fresh):
        assert fresh and bool((g == 3.0).all())  # not zeroed for it: it writes every element
        g.copy_(torch.full((N,), 2.0))
    with store.use_grad_sum("a") as (g, fresh):
        assert not fresh
        g.add_(1.0)
    assert bool((store.tensor("a", "grad") == 3.0).all())


def test_overwrite_takes_the_mark_and_as_reduced_ignores_it() -> None:
    store = plain()
    store.mark_grads_zeroed(["a", "b"])
    with store.use("a", "grad", overwrite=True) as g:  # a checkpoint load
        assert bool((g == 3.0).all())
        g.fill_(5.0)
    assert not store.grad_zeroed("a")
    with store.use("b", "grad", as_reduced=True) as g:  # the deferred update's read
        assert bool((g == 3.0).all())
    assert store.grad_zeroed("b")  # still marked: the next use sees zeros
    store.write_zeroed_grads(["a", "b"])
    assert bool((store.tensor("a", "grad") == 5.0).all())
    assert not store.tensor("b", "grad").any() and not store.grad_zeroed("b")


def nvme_grads(base: Config, path: Path) -> Config:
    where = str(path)
    return dataclasses.replace(base, offload=OffloadConfig(
        params=ParamOffloadConfig(device="none"),
        optimizer=OptimizerOffloadConfig(device="nvme", path=where,
                                         grad_device="nvme"),  # type: ignore[arg-type]
        budgets=BudgetsConfig(device_bytes=64 << 20, host_bytes=1 << 30)))


def test_a_marked_nvme_gradient_is_never_read(tmp_path: Path) -> None:
    store = TieredShardStore(torch.device("cpu"), nvme_grads(make_config(), tmp_path))
    try:
        for k in ("a", "b"):
            store.declare(k, N, torch.float32, True)
        store.finalize()
        for k in ("a", "b"):
            store.add(k, torch.zeros(N), torch.float32, True)
        for k in ("a", "b"):  # an old gradient, written down to NVMe
            with store.use(k, "grad", overwrite=True) as g:
                g.fill_(3.0)
            assert store.manager is not None
            store.manager.evict(f"{k}:grad")
        store.manager.synchronize()
        store.mark_grads_zeroed(["a", "b"])
        read0 = store.manager.memory_report().moved["nvme_to_host"]
        with store.use_grad_sum("a") as (g, fresh):  # a reduction: overwrites, reads nothing
            assert fresh
            g.fill_(1.0)
        with store.use("b", "grad") as g:  # a reader: zeros, read from nowhere
            assert not g.any()
        assert store.manager.memory_report().moved["nvme_to_host"] == read0
        store.manager.evict("a:grad")
        store.manager.synchronize()
        with store.use("a", "grad") as g:  # unmarked now: the value written, read back
            assert bool((g == 1.0).all())
        assert store.manager.memory_report().moved["nvme_to_host"] >= read0 + N * 4
    finally:
        store.close()
