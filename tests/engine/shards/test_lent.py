"""A gather that views the staging pool's buffer instead of copying it ([Note: a gather
viewing the pool's buffer] in engine/shards/lent.py): the memory is not copied or owned,
the results are the bits of the copying gather in every step mode that can write a shard
while a unit is gathered, a viewed shard is never written, and the pool's room bounds it.
"""

from __future__ import annotations

import dataclasses
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
)

from tierzero import engine
from tierzero.engine.config import Config
from tierzero.engine.shards.lent import (
    LEND_POOL_SPANS,
    LENT_POOL_BUFFERS,
    MAX_LENT_UNITS,
    adopt,
    alias_into,
    unalias,
)
from tierzero.offload.errors import OffloadError

needs_swap = needs_storage_swap("gathers copy")


def _released(numel: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    full = torch.empty(numel, dtype=dtype)
    full.untyped_storage().resize_(0)
    return full


@needs_swap
def test_alias_views_memory_it_does_not_own() -> None:
    arena = torch.arange(256, dtype=torch.uint8)  # as the pool's one allocation
    view = arena[64:128].view(torch.bfloat16)  # 32 elements, one buffer of it
    full = _released(32)
    alias_into(full, view)
    assert full.data_ptr() == view.data_ptr()
    assert torch.equal(full, view)
    part = full[4:8]  # as a parameter's view
    part.fill_(3.0)
    assert torch.equal(view[4:8], torch.full((4,), 3.0, dtype=torch.bfloat16))
    unalias(full)
    assert full.untyped_storage().nbytes() == 0 and part.untyped_storage().nbytes() == 0
    # the memory stayed the pool's: untouched and still usable after the alias is gone
    assert torch.equal(arena[:64], torch.arange(64, dtype=torch.uint8))
    assert torch.equal(view[4:8], torch.full((4,), 3.0, dtype=torch.bfloat16))
    alias_into(full, view)  # viewed again, as a unit gathered a second time
    assert torch.equal(full[4:8], view[4:8])
    unalias(full)


@needs_swap
def test_adopt_keeps_the_values_in_owned_memory() -> None:
    arena = torch.arange(128, dtype=torch.uint8)
    view = arena[:64].view(torch.bfloat16)
    full = _released(32)
    alias_into(full, view)
    saved = full[8:16]  # a view autograd would have saved
    want = saved.clone()
    own = torch.empty(64, dtype=torch.uint8)
    own.copy_(arena[:64])
    own_storage = own.untyped_storage()
    adopt(full, own_storage)
    assert own_storage.nbytes() == 0
    assert full.data_ptr() != view.data_ptr()
    assert torch.equal(saved, want)  # the saved view sees the copy
    arena.zero_()  # the pool reuses its buffer: the unit's values do not change
    assert torch.equal(saved, want)


@needs_swap
def test_alias_refuses_a_buffer_holding_memory_or_the_wrong_size() -> None:
    view = torch.zeros(32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="holds 64 bytes"):
        alias_into(torch.zeros(32, dtype=torch.bfloat16), view)
    with pytest.raises(ValueError, match="does not cover"):
        alias_into(_released(16), view)
    with pytest.raises(ValueError, match="does not cover"):
        alias_into(_released(16), torch.zeros(64, dtype=torch.bfloat16)[::2])


def _no_lending(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tierzero.engine.shards.flat.lending_supported", lambda device: False)


def nvme_cfg(path: Path, *, clip: float = 1.0) -> Config:
    """Params and optimizer state on NVMe (the streamed CPU Adam), swap files in `path`."""
    path.mkdir(parents=True, exist_ok=True)
    return offload_config(make_config(clip=clip), "nvme", path)


def _set(cfg: Config, **opt: Any) -> Config:
    o = dataclasses.replace(cfg.offload.optimizer, **opt)
    return dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, optimizer=o))


def _run(cfg: Config, scales: tuple[float, ...], *, checkpointed: bool = False,
         unused: bool = False) -> dict[str, Any]:
    """One step per scale (the loss times it); losses, params and the lending counters,
    with the most units viewing pool buffers at any gather or release. `unused`: block 1
    holds a parameter its forward never uses (no gradient: its group is reduced at the end
    of backward, the unit still gathered)."""
    model = make_model()
    model.checkpointed = checkpointed
    if unused:
        model.blocks[1].spare = torch.nn.Parameter(torch.ones(8))
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    sched = eng.scheduler
    most = [0]
    gather, release = sched.ensure_gathered, sched.release

    def watch(fn: Any) -> Any:
        def call(unit: Any) -> None:
            fn(unit)
            most[0] = max(most[0], sum(u.lent for u in sched.units))
        return call

    sched.ensure_gathered, sched.release = watch(gather), watch(release)
    losses, after_forward = [], []
    for (ids, tg), scale in zip(make_batches(len(scales)), scales, strict=True):
        loss = eng(ids, tg)
        # units kept gathered for their backward, and of them those viewing pool buffers
        kept = [u for u in sched.units if u.lendable and u.gathered]
        after_forward.append((len(kept), sum(u.lent for u in kept)))
        eng.backward(loss * scale)
        eng.step()
        losses.append(float(loss.detach()))
        assert not any(u.lent for u in sched.units)  # nothing held between steps
    out = {"losses": losses, "params": full_params(eng, model), "lent": sched.lent_gathers,
           "most": most[0], "peak": sched.lent_peak, "kept": sched.kept,
           "copies": sched.lent_copies, "after_forward": after_forward}
    eng.close()
    return out


# the gradient norm is about 1.5 at x1 and 0.75 at x0.5: clipping at 1.0 fires on the x1
# steps, so a speculated step is undone on step 3 and later ones are speculated again
SCALES = (0.5, 0.5, 0.5, 1.0, 0.5, 0.5)


@needs_swap
@pytest.mark.parametrize("case", [
    "deferred",  # clipping 1.0, speculation off: measured in backward, updated in forward
    "speculated",  # updated in backward, undone when clipping fires
    "early",  # no clipping: each unit updated as its gradient is final
    "kept",  # every unit kept gathered from its forward to its backward
    "checkpointed",  # activation checkpointing: the forward again inside backward
    "unused",  # a group reduced at the end of backward, its unit gathered: a copy
])
def test_same_bits_as_the_copying_gather(case: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = nvme_cfg(tmp_path / "swap", clip=0.0 if case == "early" else 1.0)
    cfg = _set(cfg, speculate_step=case != "deferred")
    if case == "kept":
        cfg = dataclasses.replace(cfg, zero=dataclasses.replace(
            cfg.zero, max_live_bytes=1 << 30, max_reuse_distance_bytes=1 << 30))
    kw = {"checkpointed": case == "checkpointed", "unused": case == "unused"}
    got = _run(cfg, SCALES, **kw)
    assert got["lent"] > 0, got
    assert 0 < got["peak"] <= MAX_LENT_UNITS and got["most"] <= MAX_LENT_UNITS
    # a unit is released before its update may write the shard it views, or copies it out
    # where it stays gathered (only the unit with an unused parameter, once a step)
    assert got["copies"] == (len(SCALES) if case == "unused" else 0), got
    # a unit kept gathered for its backward goes on viewing its buffer, up to the cap
    assert all(lent == min(kept, MAX_LENT_UNITS) for kept, lent in got["after_forward"])
    if case == "kept":
        assert got["kept"] >= (len(SCALES) - 1) * (len(make_model().blocks) - 1), got
    with monkeypatch.context() as m:
        _no_lending(m)
        want = _run(cfg, SCALES, **kw)
    assert want["lent"] == 0
    assert got["losses"] == want["losses"]
    bad = [k for k, v in want["params"].items() if not torch.equal(got["params"][k], v)]
    assert not bad, bad


def _pool_buffers(cfg: Config) -> int:
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
    count = eng.store.manager.plan.pool_count  # type: ignore[attr-defined]
    eng.close()
    return int(count)


@needs_swap
def test_the_pool_gets_the_buffer_a_unit_views(tmp_path: Path) -> None:
    """Where gathers view the pool, it has offload.params.buffer_count + LENT_POOL_BUFFERS
    buffers (the one a viewing unit holds); a pool too small to lend from gets none."""
    cfg = nvme_cfg(tmp_path / "swap")
    assert cfg.offload.params.buffer_count == LEND_POOL_SPANS  # the default lends
    assert _pool_buffers(cfg) == LEND_POOL_SPANS + LENT_POOL_BUFFERS
    p = dataclasses.replace(cfg.offload.params, buffer_count=LEND_POOL_SPANS - 1)
    small = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, params=p))
    assert _pool_buffers(small) == LEND_POOL_SPANS - 1
    got = _run(small, (0.5, 0.5))
    assert got["lent"] == 0  # gathers copy


@needs_swap
def test_a_viewed_shard_is_never_written(tmp_path: Path) -> None:
    """While a unit views its param's pool buffer, the tier manager refuses to write that
    shard (the backstop behind the scheduler's ordering), naming it; the engine goes on."""
    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                     config=nvme_cfg(tmp_path / "swap"))
    unit = next(u for u in eng.scheduler.units if u.module is model.blocks[1])
    group = next(g for g in unit.groups if g.trainable)
    key = group.key
    mgr = eng.store._mgr()  # type: ignore[attr-defined]
    seen: list[str] = []

    def write_while_gathered(module: Any, args: Any) -> None:
        assert unit.lent
        with pytest.raises(OffloadError, match=key) as err:
            mgr.write_from(f"{key}:param", torch.zeros(group.shard_numel, dtype=group.dtype))
        seen.append(str(err.value))

    handle = model.blocks[1].register_forward_pre_hook(write_while_gathered)
    ids, tg = make_batches(1)[0]
    eng.backward(eng(ids, tg))
    handle.remove()
    eng.step()
    assert seen and "held" in seen[0]
    eng.backward(eng(ids, tg))
    eng.step()
    eng.close()


@needs_swap
def test_at_most_max_lent_units_view_the_pool(tmp_path: Path) -> None:
    """Units gathered together inside a pass (as backward can gather a unit before the last
    one is released): the first MAX_LENT_UNITS view pool buffers, the next ones copy, with
    the same values; each release hands its buffer back."""
    from tierzero.engine.schedule import PassState

    model = make_model(n_blocks=MAX_LENT_UNITS + 2)
    eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                     config=nvme_cfg(tmp_path / "swap"))
    sched = eng.scheduler
    blocks = [u for u in sched.units if u.lendable]
    assert len(blocks) == MAX_LENT_UNITS + 2
    sched.state = PassState.FORWARD  # as between a pass's pre- and post-hooks
    try:
        for u in blocks:
            sched.ensure_gathered(u)
        assert [u.lent for u in blocks] == [True] * MAX_LENT_UNITS + [False, False]
        values = [[s.param.detach().clone() for g in u.groups for s in g.slots]
                  for u in blocks]
    finally:
        for u in blocks:
            sched.release(u)
        sched.state = PassState.IDLE
    assert not any(u.lent for u in blocks)
    mgr = eng.store._mgr()  # type: ignore[attr-defined]
    for u in blocks[:MAX_LENT_UNITS]:  # every hold ended: its cache can be dropped
        for g in u.groups:
            mgr.evict(f"{g.key}:param")
    with engine.GatheredParameters(list(model.parameters())):  # copied between passes
        assert not any(u.lent for u in blocks)
        for u, want in zip(blocks, values, strict=True):
            got = [s.param for g in u.groups for s in g.slots]
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), u.label
    eng.close()


@needs_swap
def test_only_one_rank_on_a_host_device_with_params_on_nvme_lends(tmp_path: Path) -> None:
    from tierzero.engine.shards.tiered import TieredShardStore

    cfg = nvme_cfg(tmp_path / "swap")
    cpu = torch.device("cpu")
    cases = [  # (store, lends)
        (TieredShardStore(cpu, cfg), True),
        (TieredShardStore(torch.device("meta"), cfg, host_compute=True), True),  # plan
        (TieredShardStore(cpu, cfg, world_size=2), False),  # a gather is a collective
        (TieredShardStore(torch.device("meta"), cfg, host_compute=False), False),  # CUDA
        (TieredShardStore(cpu, offload_config(make_config(), "cpu", None)), False),
    ]
    for store, lends in cases:
        assert store.lends is lends
        store.close()
