"""Unit-boundary tensors of a layer-major pass moved to host memory or NVMe when the rooms
the tier budgets leave are too small ([Note: boundary tensors] in engine/boundary.py).

The rooms are forced small by patching `boundary.rooms_for` (on this CPU-only machine the
real rooms are whole gigabytes). Moving a leaf changes where its bytes wait, never their
values: every result here is bit-identical to the micro-step schedule's at one rank (the
bound of tests/engine/test_layer_major.py), and at two ranks within that file's fp32
summation-order bounds.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_dist import run_two_ranks
from engine_helpers import Block, TinyLM, make_batches, make_model
from test_layer_major import STEPS, _assert_same, _config, _train, bound_key_bias, hf_run
from torch import nn

from tierzero.engine import boundary
from tierzero.engine.boundary import BoundaryRooms, BoundaryStats, BoundaryStore

GAS = 4


@contextlib.contextmanager
def rooms(**override: Any) -> Iterator[list[BoundaryRooms]]:
    """Every pass gets the rooms rooms_for() gives, with `override` applied; the rooms
    handed out are listed."""
    original = boundary.rooms_for
    given: list[BoundaryRooms] = []

    def patched(eng: Any) -> BoundaryRooms | None:
        base = original(eng) or BoundaryRooms(None, None, False)
        r = dataclasses.replace(base, **override)
        given.append(r)
        return r

    boundary.rooms_for = patched  # type: ignore[assignment]
    try:
        yield given
    finally:
        boundary.rooms_for = original  # type: ignore[assignment]


def _run(tmp: Path, schedule: str, *, model: nn.Module | None = None, offload: str = "nvme",
         precision: str = "bf16", clip: float = 0.5, seed: int = 1) -> dict[str, Any]:
    cfg = _config(tmp / schedule, schedule=schedule, precision=precision, offload=offload,
                  clip=clip)
    return _train(model or make_model(), cfg, make_batches(STEPS * GAS, seed=seed))


def test_boundary_tensors_spill_to_nvme_bit_for_bit(tmp_path: Path) -> None:
    ms = _run(tmp_path, "micro_step")
    with rooms(host=0) as given:
        lm = _run(tmp_path, "layer_major")
    assert given and all(r.swap is not None for r in given)
    assert lm["schedule"] == "layer_major"
    _assert_same(lm, ms, exact=True)
    b = lm["report"]["layer_major_boundary"]
    # 4 blocks: each block's input that the next block consumed may move (3 per micro-batch
    # and pass: blocks 0-2's outputs; block 3's output feeds the head's glue, which saves it)
    assert b["to_nvme_bytes"] > 0
    assert b["restored_bytes"] == b["to_nvme_bytes"]  # every spilled leaf came back
    assert b["to_host_bytes"] == 0
    assert b["stayed"] == STEPS * GAS  # the last block's output: the final LayerNorm's


def test_boundary_tensors_park_in_host_memory_then_nvme(tmp_path: Path) -> None:
    """A device of its own (as on a GPU; driven on the CPU): no device room moves every
    movable leaf to host memory; no host room either sends them on to NVMe."""
    ms = _run(tmp_path, "micro_step")
    with rooms(device=0, host=None, separate_host=True):
        host = _run(tmp_path / "host", "layer_major")
    with rooms(device=0, host=0, separate_host=True):
        nvme = _run(tmp_path / "nvme", "layer_major")
    for lm in (host, nvme):
        assert lm["schedule"] == "layer_major"
        _assert_same(lm, ms, exact=True)
    hb, nb = host["report"]["layer_major_boundary"], nvme["report"]["layer_major_boundary"]
    assert hb["to_host_bytes"] > 0 and hb["to_nvme_bytes"] == 0
    assert hb["restored_bytes"] == hb["to_host_bytes"]
    assert nb["to_nvme_bytes"] > 0 and nb["restored_bytes"] == nb["to_nvme_bytes"]
    # what waited on the device at once is below what the pass kept in all
    assert hb["device_peak_bytes"] < hb["held_peak_bytes"]


def test_room_for_part_moves_the_oldest_first(tmp_path: Path) -> None:
    """With room for half of a pass's leaves, only the rest move (8 of the 12 movable
    leaves of each pass: 16 are kept, 4 per micro-batch)."""
    with rooms(host=0):
        all_out = _run(tmp_path / "all", "layer_major")
    every = all_out["report"]["layer_major_boundary"]["to_nvme_bytes"]
    leaf = every // (STEPS * GAS * 3)  # 3 movable leaves per micro-batch and pass
    with rooms(host=8 * leaf):
        part = _run(tmp_path / "part", "layer_major")
    pb = part["report"]["layer_major_boundary"]
    assert pb["to_nvme_bytes"] == STEPS * 8 * leaf
    _assert_same(part, all_out, exact=True)


@pytest.mark.parametrize("arch,offload,precision", [("llama", "nvme", "bf16"),
                                                     ("gpt2", "nvme", "fp32"),
                                                     ("mixtral", "cpu", "bf16")])
def test_hf_decoder_layers_spill(tmp_path: Path, arch: str, offload: str,
                                 precision: str) -> None:
    """Hugging Face decoder stacks hand each layer's output to the next layer only: every
    layer output but the last may move; results as without moving (the bounds of
    test_layer_major.py's HF cases: bit for bit but for GPT-2's tied embedding)."""
    ms = hf_run(0, arch=arch, schedule="micro_step", offload=offload, precision=precision,
                clip=1.0, tmp=tmp_path)
    with rooms(host=0, separate_host=offload == "cpu", device=0) as given:
        lm = hf_run(0, arch=arch, schedule="layer_major", offload=offload,
                    precision=precision, clip=1.0, tmp=tmp_path / "spill")
    assert lm["schedule"] == "layer_major"
    if arch == "gpt2":
        bound_key_bias(lm, ms)
    _assert_same(lm, ms, exact=arch != "gpt2")
    b = lm["report"]["layer_major_boundary"]
    moved = b["to_nvme_bytes"] if given[0].swap is not None else b["to_host_bytes"]
    assert moved > 0 and b["restored_bytes"] == moved


class Keeper(TinyLM):
    """Keeps every block's output in a list during forward (as output_hidden_states does):
    those leaves have another holder and must stay where they are."""

    def forward(self, ids: torch.Tensor, targets: torch.Tensor,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
        x = self.emb(ids)
        self.kept: list[torch.Tensor] = []
        for blk in self.blocks:
            x = blk(x)
            self.kept.append(x)
        logits = self.head(self.norm(x)).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1))


class GlueSaver(TinyLM):
    """Multiplies each block's output by a root parameter before the next block: the glue
    saves the leaf for its backward, so the leaf must stay where it is."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x) * self.gain
        logits = self.head(self.norm(x)).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1))


@pytest.mark.parametrize("cls", [Keeper, GlueSaver])
def test_leaves_held_elsewhere_stay_put(tmp_path: Path, cls: type[TinyLM],
                                        caplog: pytest.LogCaptureFixture) -> None:
    """GlueSaver's gain is one weight used once per block: layer-major sums its uses in
    fp32 where micro-steps add them in the compute dtype first, so that model runs in fp32
    and is held to the fp32 summation-order bounds (test_layer_major.py)."""
    def build() -> TinyLM:
        torch.manual_seed(0)
        return cls()

    precision = "fp32" if cls is GlueSaver else "bf16"
    ms = _run(tmp_path, "micro_step", model=build(), precision=precision)
    with rooms(host=0):
        lm = _run(tmp_path, "layer_major", model=build(), precision=precision)
    assert lm["schedule"] == "layer_major"
    _assert_same(lm, ms, exact=cls is Keeper)
    b = lm["report"]["layer_major_boundary"]
    assert b["to_nvme_bytes"] == 0  # none could move: each had another holder
    assert b["stayed"] == STEPS * GAS * 4
    assert b["over_room_bytes"] > 0
    # said once for the run, not once per pass (STEPS passes held the same bytes)
    said = [r for r in caplog.records if "cannot move lower" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


def test_a_read_of_a_parked_leaf_fails_loudly() -> None:
    """A leaf's data is empty while it waits below; restore() brings the same values back
    to the same tensor object."""
    stats = BoundaryStats()
    store = BoundaryStore(BoundaryRooms(0, None, True), torch.device("cpu"), stats)
    leaf = torch.randn(2, 3).requires_grad_()
    want = leaf.detach().clone()
    store.track(leaf)
    args = (leaf,)
    store.consumed(args, {})
    assert leaf.numel() == 0 and stats.to_host_bytes == want.numel() * 4
    with pytest.raises(RuntimeError):
        _ = leaf @ torch.ones(3, 1)
    store.restore(args, {})
    assert torch.equal(leaf.detach(), want)
    store.close()


def _boundary_keys(eng: Any) -> list[str]:
    keys: list[str] = eng.store.swap.keys()
    return [k for k in keys if k.startswith("layer_major/")]


def test_failed_pass_deletes_its_swap_keys(tmp_path: Path) -> None:
    """A pass that fails in backward after spilling leaves no boundary key in the swap
    store (the engine's next step starts clean)."""
    from tierzero import engine

    cfg = _config(tmp_path, schedule="layer_major", precision="bf16", offload="nvme", clip=0.5)
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
    batches = make_batches(GAS)
    calls = {"n": 0}
    original = Block.forward

    def failing(self: Block, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and eng.scheduler.state.name == "BACKWARD":
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("boom in backward")
        return original(self, x)

    with rooms(host=0):
        Block.forward = failing  # type: ignore[method-assign]
        try:
            with pytest.raises(RuntimeError, match="boom"):
                eng.train_batch(batches, lambda mb: eng(*mb))
        finally:
            Block.forward = original  # type: ignore[method-assign]
        assert eng.scheduler.boundary_stats.to_nvme_bytes > 0
        assert not _boundary_keys(eng)
        eng.step()  # the abandoned step is skipped; training goes on
        eng.train_batch(make_batches(GAS, seed=5), lambda mb: eng(*mb))
        assert not _boundary_keys(eng)
    eng.close()


# -- two ranks ---------------------------------------------------------------------------------

def spill_run(rank: int, *, schedule: str, tmp: Path) -> dict[str, Any]:
    ctx = rooms(host=0) if schedule == "layer_major" else contextlib.nullcontext()
    with ctx:
        return _run(tmp / f"r{rank}", schedule, seed=1 + rank)


@pytest.mark.multiproc
def test_two_ranks_spill_matches_micro_step(tmp_path: Path) -> None:
    results = run_two_ranks(tmp_path, {s: partial(spill_run, schedule=s, tmp=tmp_path)
                                       for s in ("micro_step", "layer_major")})
    lm, ms = results[0]["layer_major"], results[0]["micro_step"]
    assert lm["schedule"] == "layer_major"
    assert lm["report"]["layer_major_boundary"]["to_nvme_bytes"] > 0
    for k, v in lm["params"].items():
        assert torch.equal(v, results[1]["layer_major"]["params"][k])
    _assert_same(lm, ms, exact=False)
