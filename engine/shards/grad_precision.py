"""The dtype of the gradient shards: the compute dtype where that is exact, else fp32.

[Note: gradient precision]
A trainable group's gradient shard (tensor class `grad`) holds what the reduction left
for the optimizer step. With one rank and one micro-batch per step, that is exactly the
compute-dtype gradient autograd produced, upcast: the reduction copies each parameter's
bf16/fp16 `.grad` into a fresh shard ([Note: gradients zeroed on first use] in
shards/store.py) and nothing is added to it. Its fp32 form carries 2 bytes of no
information per element, stored (host memory, NVMe) and moved (written down, read back
for clipping's norm and the update) every step. So in exactly that case

    world size 1, batch.gradient_accumulation_steps 1, precision.dtype bf16 or fp16,
    batch.schedule not layer_major, precision.grad_dtype auto (the default)

the store keeps the `grad` class in the compute dtype, on whichever store and tier it
lives (device, host, NVMe; offload none, cpu, nvme; every stage), and every reader
upcasts where it uses it: the CPU Adam kernel reads bf16/fp16 gradients and converts
each element exactly before the same fp32 arithmetic (offload/_adam_kernel.c); the norm
and overflow measurement upcasts the shard block by block (precision.grad_stat); the torch
optimizer over device-resident state gets fp32 copies for its step (step/device.py). An
exact upcast changes no value, so the results are bit for bit those of fp32 gradient
shards, and `tierzero plan`, memory_report() and the tier budgets count
the 2-byte shards (the tier manager's specs carry the dtype).

Everywhere else the shards are fp32: with several ranks the reduce-scatter averages in
fp32; with accumulation the shard sums micro-batches in fp32; with fp32 compute there
is nothing to save. The layer-major schedule sums in an fp32 buffer ([Note: layer-major
schedule] in layer_major.py): with several micro-batches anyway, and even with one it
folds the two parts of a tied weight there separately, an fp32 sum; so a layer_major
config keeps fp32 shards (auto picks layer-major only with accumulation).

The measurement upcasts the shard a block at a time into a small scratch (beside the
tiers): torch's norm of a bf16/fp16 tensor either rounds its result to that dtype or,
asked for fp32, copies the whole shard first; the blocks are those an fp32 shard is
measured in, so the norm is the same float ([Note: the gradient norm in blocks] in
step/precision.py).

One exception is left inside the case: a group whose gradient gets a second
contribution in the same step (a late gradient, [Note: late gradients] in
late_grads.py, or backward() called twice before step() without accumulation). The
second part is then added in the compute dtype, as plain PyTorch adds it to a bf16
parameter's `.grad`, where fp32 shards would keep the fp32 sum; the store logs it once
(ShardStore.use_grad_sum) and precision.grad_dtype fp32 restores the fp32 sum.
"""

from __future__ import annotations

import torch

from tierzero.engine.config import Config
from tierzero.engine.step.precision import compute_dtype

LOW_PRECISION = (torch.bfloat16, torch.float16)


def grad_dtype(config: Config, world_size: int) -> torch.dtype:
    """The dtype of every gradient shard of an engine with this config on `world_size`
    ranks ([Note: gradient precision])."""
    dtype = compute_dtype(config.precision.dtype)
    exact = (world_size == 1 and (config.batch.gradient_accumulation_steps or 1) == 1
             and dtype in LOW_PRECISION and config.batch.schedule != "layer_major")
    return dtype if exact and config.precision.grad_dtype == "auto" else torch.float32
