"""param kept in host memory after the Adam writes it ([Note: param kept in host
memory] in offload/stream_parts.py, TierManager.write_from(keep_host=True)): the residency
moves of the kept cache, its fallback when the pool is full, and training that stays bit
for bit the same while the next forward's first gathers stop reading NVMe."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import TinyLM, make_batches, stream_of
from tiers_util import cpu_settings, data_for, store

from tierzero import engine
from tierzero.offload import AdamStream, ShardSpec, State, TierManager
from tierzero.offload.transfer import Mover
from tierzero.swap.fileio import FileIO

N = 4096  # bf16 elements: 8 KiB, two pages


def _manager(tmp_path: Path, pool: int) -> TierManager:
    specs = [ShardSpec(f"p{i}", "param", N, torch.bfloat16) for i in range(3)]
    mgr = TierManager(specs, cpu_settings({"param": "nvme"}, device=1 << 20, host=1 << 20,
                                          buffer_count=pool), swap=store(tmp_path))
    for i, s in enumerate(specs):
        mgr.place(s.key, data_for(s, i)).wait()
    mgr.synchronize()
    return mgr


def test_kept_write_is_a_dirty_cache_stored_down_then_a_clean_hit(tmp_path: Path) -> None:
    with _manager(tmp_path, pool=3) as mgr:
        rec = mgr._records["p0"]
        new = torch.randn(N).to(torch.bfloat16)
        want = new.clone()
        version = mgr.version("p0")
        t = mgr.write_from("p0", new, keep_host=True)
        # the new data went into a pool buffer and is being written down from it
        assert rec.copies["host"].state in (State.STORING, State.CLEAN)
        assert rec.copies["nvme"].state in (State.FILLING, State.CLEAN)
        assert mgr.version("p0") == version + 1  # a read-ahead taken before is stale
        new.fill_(0)  # the caller's buffer is free at once: the bytes were copied
        t.wait()
        mgr.synchronize()
        assert rec.copies["host"].state is State.CLEAN  # stays as a cache
        assert mgr.memory_report().pool_in_use == 1
        mgr.audit()
        before = mgr.memory_report()
        got = mgr.fetch("p0", "device").wait().clone()
        mgr.release("p0")
        after = mgr.memory_report()
        assert after.moved["nvme_to_host"] == before.moved["nvme_to_host"]  # no read back
        assert torch.equal(got, want)  # the bytes given, although the caller zeroed its own
        # the home copy holds the same bytes: evict the cache, read the file
        mgr.evict("p0")
        mgr.synchronize()
        assert rec.copies["host"].state is State.ABSENT
        out = torch.empty(N, dtype=torch.bfloat16)
        mgr.read_into("p0", out).wait()
        assert torch.equal(out, got)
        mgr.audit()


class GatedWrites(FileIO):
    """Every pwrite waits until `gate` is set: a write-back stays in flight until then."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        if not self.gate.wait(30):
            raise OSError("test gate never opened")
        return super().pwrite(fd, buf, offset)


def test_a_cache_being_written_down_is_read_at_once(tmp_path: Path) -> None:
    """[Note: reading a cache while it is written down] in offload/manager.py: a read-only
    fetch of a kept cache whose write is still in flight returns the new bytes without
    waiting for the write, holds the buffer past it (also against the eviction that a
    write-back may have been started for), and a writable fetch still waits for it."""
    io = GatedWrites()
    io.gate.set()  # the initial placement writes through
    specs = [ShardSpec(f"p{i}", "param", N, torch.bfloat16) for i in range(3)]
    mgr = TierManager(specs, cpu_settings({"param": "nvme"}, device=1 << 20, host=1 << 20,
                                          buffer_count=3),
                      swap=store(tmp_path, fileio=io))
    with mgr:
        for i, s in enumerate(specs):
            mgr.place(s.key, data_for(s, i)).wait()
        mgr.synchronize()
        rec = mgr._records["p0"]
        io.gate.clear()
        new = torch.randn(N).to(torch.bfloat16)
        written = mgr.write_from("p0", new, keep_host=True)
        assert rec.copies["host"].state is State.STORING  # held at the gate
        mgr.evict("p0")  # asks for the cache to go once written
        fetched = mgr.fetch("p0", "host")
        assert fetched.done() and not written.done()  # the write cannot have landed
        assert torch.equal(fetched.wait(), new)
        writer_done = threading.Event()

        def fetch_writable() -> None:
            mgr.fetch("p1", "host", writable=True).wait()
            writer_done.set()

        # a writable fetch of a cache being written down waits for the write
        mgr.fetch("p1", "host", writable=True).wait().fill_(2.0)
        mgr.release("p1")
        mgr.evict("p1")  # dirty: its write-back starts, held at the gate
        assert mgr._records["p1"].copies["host"].state is State.STORING
        writer = threading.Thread(target=fetch_writable)
        writer.start()
        assert not writer_done.wait(0.2)  # it cannot pass the gate's write
        io.gate.set()
        writer.join(30)
        assert writer_done.is_set()
        mgr.release("p1")
        written.wait()
        mgr.synchronize()
        assert rec.copies["host"].state is State.CLEAN  # the hold outlived the eviction
        assert torch.equal(fetched.wait(), new)
        mgr.release("p0")
        mgr.audit()
        out = torch.empty(N, dtype=torch.bfloat16)
        mgr.evict("p0")
        mgr.synchronize()
        mgr.read_into("p0", out).wait()
        assert torch.equal(out, new)  # the write landed whole


def test_kept_write_falls_back_to_a_direct_write_when_the_pool_is_full(tmp_path: Path
                                                                       ) -> None:
    with _manager(tmp_path, pool=2) as mgr:
        held = [mgr.fetch(k, "host").wait() for k in ("p1", "p2")]  # both buffers in use
        new = torch.randn(N).to(torch.bfloat16)
        mgr.write_from("p0", new, keep_host=True).wait()  # nothing evicted for it
        assert mgr._records["p0"].copies["host"].state is State.ABSENT
        assert mgr.memory_report().pool_in_use == 2 and len(held) == 2
        for k in ("p1", "p2"):
            mgr.release(k)
        got = mgr.fetch("p0", "host").wait().clone()
        mgr.release("p0")
        assert torch.equal(got, new)
        mgr.audit()


def test_kept_write_makes_room_as_prefetch_does(tmp_path: Path) -> None:
    """A kept write takes a pool buffer the way prefetch does: it drops a clean cache used
    later than its own shard, first a stale one (of data about to be replaced,
    expect_writes), never a dirty one (its data stays), and never waits (a direct write
    instead)."""
    with _manager(tmp_path, pool=2) as mgr:
        def cached() -> set[str]:
            return {k for k in ("p0", "p1", "p2")
                    if mgr._records[k].copies["host"].state is not State.ABSENT}

        for k in ("p1", "p2"):
            mgr.fetch(k, "host").wait()
            mgr.release(k)
        mgr.expect_writes(["p0"])  # not read ahead: the write below replaces it
        mgr.set_order([("p0", "device"), ("p1", "device"), ("p2", "device")])
        mgr.synchronize()
        assert cached() == {"p1", "p2"}
        mgr.write_from("p0", torch.randn(N).to(torch.bfloat16), keep_host=True).wait()
        assert cached() == {"p0", "p1"}  # p2 is used last: it gave way
        mgr.expect_writes(["p1"])  # p1's cache is stale now, though used next
        mgr.write_from("p2", torch.randn(N).to(torch.bfloat16), keep_host=True).wait()
        assert cached() == {"p0", "p2"}
        mgr.expect_writes(["p1"], False)
        mgr.set_order([])  # no prefetch while both caches turn dirty
        for k in ("p0", "p2"):
            mgr.fetch(k, "host", writable=True).wait().fill_(1.0)
            mgr.release(k)
        mgr.set_order([("p1", "device"), ("p0", "device"), ("p2", "device")])
        mgr.write_from("p1", torch.randn(N).to(torch.bfloat16), keep_host=True).wait()
        assert cached() == {"p0", "p2"}  # the dirty ones kept their buffers
        mgr.synchronize()
        for k in ("p0", "p2"):  # (one may have been cleaned ahead: written, still cached)
            assert bool((mgr.fetch(k, "host").wait() == 1.0).all()), k
            mgr.release(k)
        mgr.audit()


@pytest.mark.cuda
def test_kept_cache_feeds_a_cuda_device_copy(tmp_path: Path) -> None:
    """On CUDA the kept cache is in the pinned pool and the gather's H2D copy reads it."""
    specs = [ShardSpec(f"p{i}", "param", 1 << 20, torch.bfloat16) for i in range(2)]
    settings = cpu_settings({"param": "nvme"}, device=64 << 20, host=64 << 20,
                            buffer_count=2)
    settings = dataclasses.replace(settings, device="cuda")
    with TierManager(specs, settings, swap=store(tmp_path)) as mgr:
        for i, s in enumerate(specs):
            mgr.place(s.key, data_for(s, i)).wait()
        mgr.synchronize()
        new = torch.randn(1 << 20).to(torch.bfloat16)
        read0 = mgr.memory_report().moved["nvme_to_host"]
        mgr.write_from("p0", new, keep_host=True)  # not awaited: the copy reads the cache
        view = mgr.fetch("p0", "device").wait()
        assert view.is_cuda and torch.equal(view.cpu(), new)
        mgr.release("p0")
        mgr.synchronize()
        assert mgr.memory_report().moved["nvme_to_host"] == read0
        mgr.audit()


# ---------------------------------------------------------------- engine: bit for bit
def _run(tmp_path: Path, keep: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    if not keep:  # the same engine with the kept-param caches switched off
        real = AdamStream.__init__

        def no_keep(self: AdamStream, *a: Any, **kw: Any) -> None:
            real(self, *a, **{**kw, "keep_host_buffers": 0})

        monkeypatch.setattr(AdamStream, "__init__", no_keep)
    # param bytes read from NVMe, counted where the manager issues each read: the total
    # of all reads also holds optimizer-state read-ahead, which a busy machine drops and
    # reissues at its own pace ([Note: param kept in host memory] is about param only).
    param_read = [0]
    real_read = Mover.read

    def counting_read(self: Mover, key: str, out: torch.Tensor, *, background: bool = False
                      ) -> Any:
        if key.endswith(":param"):
            param_read[0] += out.numel() * out.element_size()
        return real_read(self, key, out, background=background)

    monkeypatch.setattr(Mover, "read", counting_read)
    swap = tmp_path / ("keep" if keep else "plain")
    swap.mkdir()
    # A pool with room to spare: a kept write falls back to a plain write only when every
    # buffer is taken (test_kept_write_falls_back_...), which a slow machine can cause here.
    cfg = engine.load_config({
        "zero": {"stage": 3, "units": ["Block"], "persistence_threshold_bytes": 0},
        "precision": "bf16",
        "optimizer": {"type": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "offload": {"params": {"device": "nvme", "path": str(swap), "buffer_count": 32},
                    "optimizer": {"device": "nvme", "path": str(swap)}}})
    torch.manual_seed(0)
    model = TinyLM(3, 128)
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    kept = stream_of(eng).kept if stream_of(eng) is not None else frozenset()
    losses, reads = [], []
    for ids, tg in make_batches(5):
        r0 = param_read[0]
        loss = eng(ids, tg)
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
        reads.append(param_read[0] - r0)
    with engine.GatheredParameters(list(model.parameters())):
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    eng.close()
    monkeypatch.undo()
    return {"losses": losses, "params": params, "kept": kept, "reads": reads}


def test_training_is_bit_identical_and_reads_less(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    keep = _run(tmp_path, True, monkeypatch)
    plain = _run(tmp_path, False, monkeypatch)
    assert keep["kept"] and not plain["kept"]
    assert keep["losses"] == plain["losses"]
    assert all(torch.equal(keep["params"][k], plain["params"][k]) for k in plain["params"])
    # from the second step on, the kept param is not read back from NVMe
    assert sum(keep["reads"][1:]) < sum(plain["reads"][1:])
