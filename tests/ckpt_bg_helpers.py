"""Runs for the background-save tests (tests/engine/checkpoint/test_ckpt_background.py),
module-level so that two spawned gloo ranks can run them."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from ckpt_helpers import resume_config
from engine_helpers import full_params, in_place_of, make_batches, make_model, runner_of

from tierzero import engine
from tierzero.engine.checkpoint import save as save_mod
from tierzero.engine.config import Config
from tierzero.engine.step.streamed import StreamedStep


def bg_config(offload: str, swap: str | None, gas: int = 1, **outputs: Any) -> Config:
    cfg = resume_config("bf16", gas, offload, swap)
    return replace(cfg, outputs=replace(cfg.outputs, **outputs))


def gate_writer(gate: threading.Event) -> None:
    """Background writers of this process take no snapshot part until `gate` is set (or
    their save is abandoned): the training's next steps surely change the state before
    any of it is written."""
    original = save_mod.write_snapshot_entry

    def gated(w: Any, name: str, ref: Any, snapshot: Any, pacer: Any) -> None:
        while not gate.wait(0.02) and not pacer.cancel.is_set():  # whichever comes first
            pass
        original(w, name, ref, snapshot, pacer)

    save_mod.write_snapshot_entry = gated  # type: ignore[assignment]


class DeferredHold:
    """Holds the in-place CPU Adam's worker in its first group of the deferred updates
    that begin while `holding` is set, until `release` is set; counts the groups whose
    update ran to its end meanwhile on any thread (`ended`). Taking a held group over is
    impossible (the worker runs it), so a caller that waited for the whole update would
    wait until `release`."""

    def __init__(self, eng: engine.ZeroEngine) -> None:
        step = in_place_of(eng)
        if step is None:
            raise AssertionError("DeferredHold needs the in-place CPU Adam (offload cpu)")
        self.step = step
        self.holding = threading.Event()
        self.release = threading.Event()
        self.ended: list[str] = []
        real = step.update

        def held(key: str, *args: Any) -> float:
            on_worker = threading.current_thread().name.startswith("tierzero-adam-early")
            if self.holding.is_set() and on_worker:
                assert self.release.wait(60), "the held deferred update was never released"
            seconds = real(key, *args)
            if self.holding.is_set():
                self.ended.append(key)
            return seconds

        step.update = held  # type: ignore[method-assign]

    def stop(self) -> None:
        self.holding.clear()
        self.release.set()


class StreamHold:
    """DeferredHold for the streamed CPU Adam (state on NVMe, [Note: deferred streamed
    step]): its worker is held before the first group of the deferred updates that begin
    while `holding` is set, until `release` is set; `ended` lists the groups whose update
    ran meanwhile (on any thread). The held worker drives the stream: a caller that waited
    for any group would wait until `release`."""

    def __init__(self, eng: engine.ZeroEngine) -> None:
        step = runner_of(eng)
        if not isinstance(step, StreamedStep):
            raise AssertionError("StreamHold needs the streamed CPU Adam (offload nvme)")
        self.step = step
        self.holding = threading.Event()
        self.release = threading.Event()
        self.ended: list[str] = []
        stream, keys = step.stream, list(step._keys)  # mark_final takes their positions
        real = stream.mark_final

        def held(indices: Any) -> None:
            on_worker = threading.current_thread().name.startswith("tierzero-adam-deferred")
            if self.holding.is_set() and on_worker:
                assert self.release.wait(60), "the held deferred update was never released"
            real(indices)
            if self.holding.is_set():
                self.ended += [keys[i] for i in indices]

        stream.mark_final = held  # type: ignore[method-assign]

    def stop(self) -> None:
        self.holding.clear()
        self.release.set()


def hold_of(eng: engine.ZeroEngine) -> DeferredHold | StreamHold:
    """The hold for the engine's CPU Adam: in place (offload cpu) or streamed (nvme)."""
    return DeferredHold(eng) if in_place_of(eng) is not None else StreamHold(eng)


def swap_stats(eng: engine.ZeroEngine) -> Any:
    swap = getattr(eng.store, "swap", None)
    return swap.stats() if swap is not None else None


def bg_run(rank: int, *, offload: str, ckpt: str, swap: str | None, n: int, m: int,
           background: bool, gate: bool = False, load: bool = False, gas: int = 1,
           hold: bool = False, **outputs: Any) -> dict[str, Any]:
    """Train n micro-steps (`gas` per optimizer step), save (in the background or not;
    `gate`: its writer held until the m following micro-steps are done), train m more.
    `load`: resume from `ckpt` first and train the m micro-steps only. `hold` (offload
    cpu or nvme, clipping, overlap_step): the update that step n defers is held on its
    worker until the save call has returned (DeferredHold, StreamHold; "held_ended" and
    "held_pending" say how it stood then). Returns final params, the save's stats and
    swap stats."""
    where = None if swap is None else f"{swap}/rank{rank}"
    if where is not None:
        Path(where).mkdir(parents=True, exist_ok=True)
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=bg_config(offload, where, gas,
                                                                   **outputs), device="cpu")
    batches = make_batches(n + m, seed=1 + rank)
    out: dict[str, Any] = {}
    released = threading.Event()
    if gate:
        gate_writer(released)
    if load:
        eng.load_checkpoint(ckpt)
    held = hold_of(eng) if hold else None
    for i in range(eng.micro_steps, n + m):
        ids, tg = batches[i]
        eng.backward(eng(ids, tg))
        if held is not None and i + 1 == n:
            held.holding.set()  # (backward waited for the updates of the steps before)
        eng.step()
        if i + 1 == n and not load:
            pending = eng.save_checkpoint(ckpt, tag="s", background=background)
            out["swap_during"] = swap_stats(eng)
            if held is not None:
                out["held_ended"] = list(held.ended)
                out["held_pending"] = held.step.deferred
                held.stop()
    if not load:
        out["swap_gated"] = swap_stats(eng)  # the steps after the save ran (the writer gated)
        released.set()
        if isinstance(pending, engine.PendingSave):
            pending.wait()
            out["stats"] = pending.stats
            out["fallback"] = pending.fallback
        out["swap_after"] = swap_stats(eng)
        out["outside"] = dict(eng.memory_report()["tiers"]["outside"]) if offload != "none" \
            else {}
    out["params"] = full_params(eng, model)
    eng.close()
    return out


def saved_tensors(path: Path, rank: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path / f"rank{rank:05d}.safetensors"))


def many_saves(ckpt: str, swap: str, saves: int) -> dict[str, Any]:
    """NVMe offload: a background save after every step; swap file size and kept regions
    after each save completed."""
    Path(swap).mkdir(parents=True, exist_ok=True)
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=bg_config("nvme", swap), device="cpu")
    batches = make_batches(saves + 1)
    sizes, kept, retired = [], [], []
    pending = None
    for i in range(saves + 1):
        ids, tg = batches[i]
        eng.backward(eng(ids, tg))
        eng.step()
        if pending is not None:
            pending.wait()
            st = swap_stats(eng)
            sizes.append(st.file_bytes)
            kept.append(st.kept_regions)
            retired.append(st.kept_retired_bytes)
        if i < saves:
            pending = eng.save_checkpoint(ckpt, tag=f"t{i}", background=True)
    eng.close()
    return {"sizes": sizes, "kept": kept, "retired": retired}
