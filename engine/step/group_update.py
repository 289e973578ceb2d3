"""One trainable group's CPU Adam update where its state lives: the in-place step's unit of
work ([Note: in-place early step] in step/in_place.py), on whichever thread runs it."""

from __future__ import annotations

import contextlib
import time

import torch

from tierzero.engine.shards.tiered import TieredShardStore
from tierzero.offload import AdamHyper, AdamThreads, adam_update
from tierzero.offload.bf16_master import master_key
from tierzero.offload.settings import MOMENT_CLASSES
from tierzero.swap import trace


def update_group(store: TieredShardStore, key: str, hyper: AdamHyper, step: float, *,
                 grad_scale: float, threads: AdamThreads | None,
                 shadow: torch.dtype | None, as_reduced: bool) -> float:
    """Group `key` in place: master and moments where they live; param in host memory
    written as the kernel's low-precision `shadow`, on the device copied from the master
    after. A bf16 master ([Note: bf16 master weights] in offload/bf16_master.py) is the
    param itself, updated where it lives (through a host copy when that is the device) and
    rounded with this step's and group's bits. `as_reduced`: the gradient's bytes as its
    reduction left them (a deferred update reads the gradient its step measured, not the
    mark the zero_grad() after that step made: [Note: gradients zeroed on first use]).
    Returns the kernel's seconds."""
    bf16 = store.master_precision == "bf16"
    with contextlib.ExitStack() as held:
        p16: torch.Tensor | None = None
        if bf16:
            p16 = held.enter_context(store.use(key, "param", writable=True, compute=False))
            # (on the device: through a host copy; meta, a dry run: as it is)
            master = p16.cpu() if p16.device.type not in ("cpu", "meta") else p16
        else:
            master = held.enter_context(store.use(key, "master", writable=True))
        # compressed moments (offload.optimizer.state_precision) as their stored bytes:
        # the kernel decodes and encodes them in its pass
        exp_avg, exp_avg_sq = (held.enter_context(store.use(key, kind, writable=True, raw=True))
                               for kind in MOMENT_CLASSES)
        grad = held.enter_context(store.use(key, "grad", as_reduced=as_reduced))
        if p16 is None:
            p16 = held.enter_context(store.use(key, "param", writable=True, compute=False))
        out = p16 if not bf16 and shadow is not None and p16.device.type == "cpu" else None
        t = time.perf_counter()
        with trace.span("adam", key, numel=master.numel()):
            adam_update(master, exp_avg, exp_avg_sq, grad, hyper=hyper, step=step,
                        grad_scale=grad_scale, shadow=out, threads=threads,
                        state=store.state_precision,
                        master_key=master_key(step, store.layout.master_salt(key))
                        if bf16 else None)
        seconds = time.perf_counter() - t
        if out is None and master is not p16:
            p16.copy_(master)  # rounds to the compute dtype; host->device on CUDA
    return seconds
