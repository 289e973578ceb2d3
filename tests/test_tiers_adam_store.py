"""The pipelined CPU Adam over the tier manager (offload/tier_store.py) gives
bitwise the same state as over plain host tensors (HostShardStore)."""

from __future__ import annotations

from pathlib import Path

import torch
from tiers_util import cpu_settings

from tierzero.offload import (
    AdamHyper,
    HostShardStore,
    ShardLayout,
    ShardSpec,
    TierManager,
    TierShardStore,
    pipelined_step,
)
from tierzero.swap import SwapStore

NUMELS = (1000, 0, 4097, 33, 7000, 5)
HYPER = AdamHyper(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)
# state on NVMe and host, grads on host, param16 on NVMe: every path of the store
HOMES = {"master": "nvme", "exp_avg": "nvme", "exp_avg_sq": "cpu", "grad": "cpu",
         "param16": "nvme"}
DTYPES = {"master": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32,
          "grad": torch.bfloat16, "param16": torch.bfloat16}


def test_tier_store_matches_host_store(tmp_path: Path) -> None:
    layout = ShardLayout(NUMELS, grad_dtype=torch.bfloat16, param16_dtype=torch.bfloat16)
    keys = [{c: f"{c}/{i}" for c in DTYPES} if n else {} for i, n in enumerate(NUMELS)]
    specs = [ShardSpec(k[c], c, n, DTYPES[c])  # type: ignore[arg-type]
             for k, n in zip(keys, NUMELS, strict=True) if n for c in DTYPES]
    host = HostShardStore(layout)
    gen = torch.Generator().manual_seed(0)
    with SwapStore(tmp_path, block_size=1 << 16) as ss, TierManager(
            specs, cpu_settings(HOMES, device=1 << 20, host=16 << 20), swap=ss) as mgr:
        for i, n in enumerate(NUMELS):
            if not n:
                continue
            host.tensors[i]["master"].copy_(torch.randn(n, generator=gen))
            for c in DTYPES:
                mgr.place(keys[i][c], host.tensors[i][c]).wait()
        store = TierShardStore(mgr, keys, layout)
        for step in range(1, 4):
            for i, n in enumerate(NUMELS):
                if not n:
                    continue
                g = torch.randn(n, generator=gen).to(torch.bfloat16)
                host.tensors[i]["grad"].copy_(g)
                mgr.fetch(keys[i]["grad"], "host", writable=True).wait().copy_(g)
                mgr.release(keys[i]["grad"])
            pipelined_step(host, hyper=HYPER, step=step, order=[4, 0, 2, 1, 5, 3])
            stats = pipelined_step(store, hyper=HYPER, step=step, buffers=3)
            assert stats.shards == len(NUMELS)
        store.close()
        mgr.synchronize()
        mgr.audit()
        rep = mgr.memory_report()
        assert rep.moved["host_to_nvme"] > 0 and rep.pool_in_use == 0
        for i, n in enumerate(NUMELS):
            for c in ("master", "exp_avg", "exp_avg_sq", "param16") if n else ():
                got = mgr.fetch(keys[i][c], "host").wait()
                assert torch.equal(got, host.tensors[i][c]), f"shard {i} {c}"
                mgr.release(keys[i][c])
    host.close()
