"""Kept regions ([Note: kept regions] in swap/kept.py): a snapshot of a key stays readable
while the key is rewritten or deleted, is freed once released, and is read behind the
store's other requests ([Note: swap I/O order])."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from swap_helpers import SlowIO

from tierzero.swap import SwapError, SwapStore, aligned_empty


def _filled(n: int, value: float) -> torch.Tensor:
    t = aligned_empty(n, torch.float32)
    t.fill_(value)
    return t


def test_kept_region_survives_rewrites_and_delete_then_frees(tmp_path: Path) -> None:
    n = 10_000
    with SwapStore(tmp_path, block_size=1 << 14) as s:
        s.write("a", _filled(n, 1.0))  # not waited: keep() waits for it
        s.write("b", _filled(n, 5.0)).wait()
        used_before = s.stats().used_bytes
        region = s.keep("a")
        kept_b = s.keep("b")
        for v in (2.0, 3.0, 4.0):
            s.write("a", _filled(n, v)).wait()
        s.delete("b")
        assert float(s.read("a").wait()[0]) == 4.0
        got = s.read_kept(region, aligned_empty(n, torch.float32)).wait()
        assert torch.equal(got, _filled(n, 1.0))  # the bytes at keep(), checksum checked
        assert torch.equal(s.read_kept(kept_b, aligned_empty(n, torch.float32)).wait(),
                           _filled(n, 5.0))
        st = s.stats()
        assert st.kept_regions == 2 and st.kept_retired_bytes > 0
        assert st.kept_read is not None and st.kept_read.bytes == 2 * n * 4
        assert st.read.bytes == n * 4  # kept reads are not counted as the training's
        s.release_kept(region)
        s.release_kept(kept_b)
        st = s.stats()
        assert st.kept_regions == 0 and st.kept_retired_bytes == 0
        assert st.used_bytes == used_before - (used_before // 2)  # "b" gone, "a" one region
        with pytest.raises(SwapError, match="not kept"):
            s.read_kept(region, aligned_empty(n, torch.float32))


def test_release_of_an_unreplaced_region_keeps_the_key(tmp_path: Path) -> None:
    with SwapStore(tmp_path) as s:
        s.write("k", _filled(100, 7.0)).wait()
        s.release_kept(s.keep("k"))
        s.release_kept(s.keep("k"))
        assert float(s.read("k").wait()[5]) == 7.0
        assert s.stats().kept_regions == 0


def test_repeated_snapshots_do_not_grow_the_file(tmp_path: Path) -> None:
    """reserve_free grows the file once by a snapshot's bytes; later snapshots reuse it."""
    keys = [f"k{i}" for i in range(4)]
    with SwapStore(tmp_path, block_size=1 << 14) as s:
        for i, k in enumerate(keys):
            s.write(k, _filled(8192, float(i))).wait()
        sizes = []
        for rnd in range(6):
            kept = [s.keep(k) for k in keys]
            s.reserve_free(sum(r.entry.region_bytes for r in kept))
            for k in keys:
                s.write(k, _filled(8192, float(rnd))).wait()
            for r in kept:
                s.release_kept(r)
            sizes.append(s.stats().file_bytes)
        assert len(set(sizes)) == 1, sizes


def test_unknown_key_cannot_be_kept(tmp_path: Path) -> None:
    with SwapStore(tmp_path) as s, pytest.raises(SwapError, match="nothing is stored"):
        s.keep("nope")


def test_kept_reads_go_behind_foreground_reads(tmp_path: Path) -> None:
    """With one I/O thread and slow reads, a kept-region read submitted first still
    finishes after foreground reads submitted right behind it, except for its share."""
    io = SlowIO(read_delay=0.01)
    with SwapStore(tmp_path, block_size=4096, threads=1, fileio=io) as s:
        s.write("big", _filled(4096 * 16, 1.0)).wait()  # 64 blocks
        s.write("fg", _filled(1024 * 8, 2.0)).wait()  # 8 blocks
        region = s.keep("big")
        order: list[str] = []
        lock = threading.Lock()

        def note(name: str):  # type: ignore[no-untyped-def]
            def cb(_: object) -> None:
                with lock:
                    order.append(name)
            return cb

        kept = s.read_kept(region, aligned_empty(4096 * 16, torch.float32))
        kept.add_done_callback(note("kept"))
        fg = [s.read("fg", aligned_empty(1024 * 8, torch.float32)) for _ in range(3)]
        for f in fg:
            f.add_done_callback(note("fg"))
        kept.wait()
        for f in fg:
            f.wait()
        s.release_kept(region)
    assert order[-1] == "kept", order


def test_restore_points_the_key_back_and_frees_the_newer_region(tmp_path: Path) -> None:
    n = 10_000
    with SwapStore(tmp_path, block_size=1 << 14) as s:
        s.write("a", _filled(n, 1.0)).wait()
        used = s.stats().used_bytes
        region = s.keep("a")
        s.write("a", _filled(n, 2.0))  # not waited: restore waits for it
        s.restore(region)
        assert torch.equal(s.read("a").wait(), _filled(n, 1.0))
        st = s.stats()
        assert st.kept_regions == 0 and st.kept_retired_bytes == 0
        assert st.used_bytes == used  # the newer region is free again
        with pytest.raises(SwapError, match="not kept"):
            s.restore(region)
        s.write("a", _filled(n, 3.0)).wait()  # the key goes on as any other
        assert float(s.read("a").wait()[7]) == 3.0
        assert s.stats().used_bytes == used


def test_restore_of_an_unwritten_key_and_beside_a_snapshot_hold(tmp_path: Path) -> None:
    """Restoring a key not written since keep() changes nothing; a region a second hold
    (a background save's snapshot) keeps stays readable through it after a restore, and
    the newer region another hold keeps is retired, not freed."""
    n = 4096
    with SwapStore(tmp_path, block_size=1 << 14) as s:
        s.write("k", _filled(n, 1.0)).wait()
        s.restore(s.keep("k"))
        assert float(s.read("k").wait()[0]) == 1.0
        snap = s.keep("k")
        spec = s.keep("k")
        s.write("k", _filled(n, 2.0)).wait()
        newer = s.keep("k")  # a second holder of the region written after keep
        s.restore(spec)
        assert float(s.read("k").wait()[0]) == 1.0
        assert float(s.read_kept(newer, aligned_empty(n, torch.float32)).wait()[0]) == 2.0
        s.release_kept(newer)  # retired and unheld: freed
        s.release_kept(snap)  # the key points at it: stays
        assert float(s.read("k").wait()[0]) == 1.0
        st = s.stats()
        assert st.kept_regions == 0 and st.kept_retired_bytes == 0
