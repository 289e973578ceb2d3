"""The pipelined optimizer step over shards on another tier (host tensors, swap.SwapStore)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tierzero import swap
from tierzero.offload import (
    AdamHyper,
    AdamThreads,
    HostShardStore,
    ShardBuffers,
    ShardLayout,
    ShardStore,
    SwapShardStore,
    Transfer,
    adam_update,
    pipelined_step,
)

HYPER = AdamHyper(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)
NUMELS = (1000, 0, 4097, 33, 70_000, 5, 2048)


Grads = list[list[torch.Tensor]]  # [step][shard]


def _data(numels: tuple[int, ...], steps: int) -> tuple[list[torch.Tensor], Grads]:
    """Initial masters per shard and gradients per step and shard."""
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=gen) for n in numels]
    grads = [[torch.randn(n, generator=gen) for n in numels] for _ in range(steps)]
    return masters, grads


def _expected(layout: ShardLayout, steps: int) -> list[dict[str, torch.Tensor]]:
    """Reference: the flat kernel applied shard by shard, no pipeline."""
    masters, grads = _data(layout.numels, steps)
    out = []
    for i, p in enumerate(masters):
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        shadow = torch.empty(p.numel(), dtype=layout.param16_dtype or torch.bfloat16)
        for step in range(1, steps + 1):
            adam_update(p, m, v, grads[step - 1][i].to(layout.grad_dtype), hyper=HYPER,
                        step=step, shadow=shadow)
        out.append({"master": p, "exp_avg": m, "exp_avg_sq": v, "param16": shadow})
    return out


@pytest.mark.parametrize("buffers", [3, 5])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_host_pipeline_equals_unpipelined_kernel(grad_dtype: torch.dtype, buffers: int) -> None:
    layout = ShardLayout(NUMELS, grad_dtype=grad_dtype, param16_dtype=torch.bfloat16)
    order = [3, 0, 6, 1, 4, 2, 5]
    masters, grads = _data(NUMELS, 3)
    store = HostShardStore(layout)
    for shard, m in zip(store.tensors, masters, strict=True):
        shard["master"].copy_(m)
    with AdamThreads(2) as threads:
        for step in range(1, 4):
            for shard, g in zip(store.tensors, grads[step - 1], strict=True):
                shard["grad"].copy_(g)
            pipelined_step(store, hyper=HYPER, step=step, order=order, buffers=buffers,
                           threads=threads)
    want = _expected(layout, 3)
    for i, (got, exp) in enumerate(zip(store.tensors, want, strict=True)):
        for name in ("master", "exp_avg", "exp_avg_sq", "param16"):
            assert torch.equal(got[name], exp[name]), f"shard {i} {name}"
    store.close()


def test_swap_pipeline_equals_host_pipeline(tmp_path: Path) -> None:
    layout = ShardLayout(NUMELS, grad_dtype=torch.bfloat16, param16_dtype=torch.bfloat16)
    host = HostShardStore(layout)
    masters, _ = _data(NUMELS, 0)
    for shard, m in zip(host.tensors, masters, strict=True):
        shard["master"].copy_(m)
    with swap.SwapStore(tmp_path, block_size=1 << 16, threads=2) as ss:
        store = SwapShardStore(ss, layout)
        for i, shard in enumerate(host.tensors):
            for f in store.init_shard(i, shard["master"]):
                f.result()
        for step in range(1, 4):
            gen = torch.Generator().manual_seed(100 + step)
            for i, shard in enumerate(host.tensors):
                shard["grad"].copy_(torch.randn(shard["grad"].numel(), generator=gen))
                store.put(i, "grad", shard["grad"]).result()
            pipelined_step(host, hyper=HYPER, step=step)
            stats = pipelined_step(store, hyper=HYPER, step=step, buffers=4)
            assert stats.shards == len(NUMELS)
        for i, shard in enumerate(host.tensors):
            for name in ("master", "exp_avg", "exp_avg_sq", "param16"):
                got = store.get(i, name).result()
                assert torch.equal(got, shard[name]), f"shard {i} {name}"
    host.close()


class DelayStore:
    """Wraps a store: every fetch/store takes `delay` seconds longer, off the caller's thread.

    Records how many transfers are in flight at once.
    """

    def __init__(self, inner: HostShardStore, delay: float, fail_fetch: int | None = None,
                 ) -> None:
        self.inner = inner
        self.delay = delay
        self.fail_fetch = fail_fetch
        self.pool = ThreadPoolExecutor(max_workers=8)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.allocated = 0

    @property
    def layout(self) -> ShardLayout:
        return self.inner.layout

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.allocated += 1
        return self.inner.empty(numel, dtype)

    def _later(self, op: Callable[[], Transfer], fail: bool) -> Future[None]:
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

        def run() -> None:
            try:
                time.sleep(self.delay)
                if fail:
                    raise OSError("injected fetch failure")
                op().wait()
            finally:
                with self.lock:
                    self.in_flight -= 1

        return self.pool.submit(run)

    def fetch(self, index: int, into: ShardBuffers) -> Transfer:
        fut = self._later(lambda: self.inner.fetch(index, into), index == self.fail_fetch)
        return Transfer("fetch", index, into, [fut])

    def store(self, index: int, source: ShardBuffers) -> Transfer:
        return Transfer("store", index, source,
                        [self._later(lambda: self.inner.store(index, source), False)])


def test_fetch_update_store_overlap_with_bounded_buffers() -> None:
    n_shards, delay = 8, 0.05
    layout = ShardLayout((20_000,) * n_shards)
    inner = HostShardStore(layout)
    store = DelayStore(inner, delay)
    assert isinstance(store, ShardStore)
    stats = pipelined_step(store, hyper=HYPER, step=1, buffers=3)
    serial = n_shards * 2 * delay  # each shard: one fetch and one store, done one after another
    # Overlapped, fetch i+1 and store i-1 run together: about half of serial. 0.75 is generous.
    assert stats.total_s < 0.75 * serial, (stats, serial)
    assert store.allocated == 3 * 4  # 3 buffer sets of master, exp_avg, exp_avg_sq, grad
    assert store.max_in_flight <= 3  # never more transfers than buffer sets
    assert stats.compute_s < stats.total_s
    inner.close()


def test_failed_fetch_names_shard_and_leaves_nothing_in_flight() -> None:
    layout = ShardLayout((1000,) * 6)
    inner = HostShardStore(layout)
    store = DelayStore(inner, 0.01, fail_fetch=3)
    with pytest.raises(RuntimeError, match="fetch of shard 3 failed: injected fetch failure"):
        pipelined_step(store, hyper=HYPER, step=1, buffers=4)
    assert store.in_flight == 0
    inner.close()


def test_reused_buffer_sets_across_steps() -> None:
    layout = ShardLayout((100, 300, 200))
    store = HostShardStore(layout)
    sets = [ShardBuffers.allocate(store, 300) for _ in range(3)]
    for step in (1, 2):
        pipelined_step(store, hyper=[HYPER, AdamHyper(), HYPER], step=step, buffer_sets=sets)
    with pytest.raises(ValueError, match=r"too small: \[0\]"):
        small = [ShardBuffers.allocate(store, 200), *sets[1:]]
        pipelined_step(store, hyper=HYPER, step=3, buffer_sets=small)
    store.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"buffers": 2}, "buffers=2"),
        ({"order": [0, 0, 1]}, "distinct shards in 0..2"),
        ({"order": [0, 3]}, "distinct shards in 0..2"),
        ({"hyper": [HYPER]}, "got 1 AdamHyper for 3 shards"),
        ({"step": 0}, "step=0"),
    ],
)
def test_bad_arguments_named(kwargs: dict[str, Any], match: str) -> None:
    store = HostShardStore(ShardLayout((10, 20, 30)))
    args: dict[str, Any] = {"hyper": HYPER, "step": 1}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        pipelined_step(store, **args)
    store.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"numels": (3, -1)}, r"\(1, -1\)"), ({"numels": (3,), "grad_dtype": torch.float64},
                                            "grad_dtype=torch.float64"),
     ({"numels": (3,), "param16_dtype": torch.float32}, "param16_dtype=torch.float32")],
)
def test_bad_layout_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShardLayout(**kwargs)
