"""offload.AdamStream ([Note: streamed optimizer step]): the streamed CPU Adam over the tier
manager gives bitwise the state of the in-place reference step over host tensors
(tests/adam_reference.py), moves each state byte over NVMe once per direction per step, lets
its writes drain after step() without anyone seeing stale data, and leaves consistent state
when a step fails.

Exactness: both sides run the same Adam kernel on the same fp32 inputs, so the comparison
is torch.equal, not a tolerance.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import re
from pathlib import Path

import pytest
import torch
from adam_reference import HostShards
from tiers_util import DelayIO, cpu_settings

from tierzero.offload import (
    AdamHyper,
    AdamStream,
    OffloadError,
    ShardSpec,
    TierManager,
    adam_stream,
)
from tierzero.swap import FileIO, SwapStore

NUMELS = (1000, 0, 4097, 33, 7000, 5)
ORDER = [4, 0, 2, 1, 5, 3]
HYPER = AdamHyper(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)
HOMES = {"master": "nvme", "exp_avg": "nvme", "exp_avg_sq": "nvme", "grad": "cpu",
         "param": "nvme"}
DTYPES = {"master": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32,
          "grad": torch.float32, "param": torch.bfloat16}
STATE_BYTES = 3 * 4 * sum(NUMELS)  # master + two moments, fp32
P16_BYTES = 2 * sum(NUMELS)


class FailingIO(FileIO):
    """Fails every pread with EIO while `armed`."""

    armed = False

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        if self.armed:
            raise OSError(errno.EIO, "injected read failure")
        return super().pread(fd, buf, offset)


class Rig:
    """A TierManager over a swap store holding NUMELS' state, and the host reference."""

    def __init__(self, tmp_path: Path, fileio: FileIO | None = None) -> None:
        self.keys = [{c: f"{c}/{i}" for c in DTYPES} if n else {} for i, n in enumerate(NUMELS)]
        specs = [ShardSpec(k[c], c, n, DTYPES[c])  # type: ignore[arg-type]
                 for k, n in zip(self.keys, NUMELS, strict=True) if n for c in DTYPES]
        self.ref = HostShards(NUMELS, param_dtype=torch.bfloat16)
        self.swap = SwapStore(tmp_path, block_size=1 << 16, fileio=fileio)
        self.mgr = TierManager(specs, cpu_settings(HOMES, device=1 << 20, host=16 << 20),
                               swap=self.swap)
        self.gen = torch.Generator().manual_seed(0)
        for i, n in enumerate(NUMELS):
            if n:
                self.ref.tensors[i]["master"].copy_(torch.randn(n, generator=self.gen))
                for c in DTYPES:
                    self.mgr.place(self.keys[i][c], self.ref.tensors[i][c]).wait()

    def stream(self, ring: int) -> AdamStream:
        """`ring` bytes of host ring (raised to the largest shard's buffers)."""
        return AdamStream(self.mgr, self.keys, NUMELS, order=ORDER, buffer_bytes=ring,
                          shadow=torch.bfloat16)

    def new_grads(self) -> None:
        for i, n in enumerate(NUMELS):
            if n:
                g = torch.randn(n, generator=self.gen)
                self.ref.tensors[i]["grad"].copy_(g)
                self.write(i, "grad", g)

    def write(self, i: int, c: str, value: torch.Tensor) -> None:
        self.mgr.fetch(self.keys[i][c], "host", writable=True).wait().copy_(value)
        self.mgr.release(self.keys[i][c])

    def read(self, i: int, c: str) -> torch.Tensor:
        t = self.mgr.fetch(self.keys[i][c], "host").wait().clone()
        self.mgr.release(self.keys[i][c])
        return t

    def assert_equal(self, shards: list[int] | None = None) -> None:
        for i in range(len(NUMELS)) if shards is None else shards:
            for c in ("master", "exp_avg", "exp_avg_sq", "param") if NUMELS[i] else ():
                assert torch.equal(self.read(i, c), self.ref.tensors[i][c]), f"shard {i} {c}"

    def nvme(self) -> tuple[int, int]:
        moved = self.mgr.memory_report().moved
        return moved["nvme_to_host"], moved["host_to_nvme"]

    def close(self) -> None:
        self.mgr.close()
        self.swap.close()


@pytest.mark.parametrize("ring", [0, 150_000, 1 << 20])
def test_stream_matches_the_reference_step_and_moves_each_byte_once(tmp_path: Path,
                                                                ring: int) -> None:
    """ring 0: one shard at a time; 150 kB: a few shards of mixed sizes in flight, with
    wrap-around; 1 MiB: every shard fits (the whole next step is read ahead)."""
    rig = Rig(tmp_path)
    stream = rig.stream(ring)
    try:
        counts = []
        for step in range(1, 5):
            rig.new_grads()
            rig.ref.step(hyper=HYPER, step=step)
            stats = stream.step(HYPER, step)
            assert stats.shards == len(NUMELS)
            stream.wait_idle()  # the read-ahead of the next step has landed too
            counts.append(rig.nvme())
        # Regression of the staged pipeline (state evicted from a too-small pool and read
        # again before its write): from the second step on, the bytes read between two
        # idle points are exactly one step's state, and the writes state + param.
        for (r0, w0), (r1, w1) in itertools.pairwise(counts):
            assert (r1 - r0, w1 - w0) == (STATE_BYTES, STATE_BYTES + P16_BYTES)
        stream.flush()
        rig.mgr.synchronize()
        rig.mgr.audit()
        # what is left in the pool: the new param kept as host caches, one buffer each
        # ([Note: param kept in host memory]); the pool has room for every shard here
        assert stream.kept == {i for i, n in enumerate(NUMELS) if n}
        assert rig.mgr.memory_report().pool_in_use == len(stream.kept)
        rig.assert_equal()
    finally:
        stream.close()
        rig.close()


def test_deferred_writes_are_seen_by_the_next_reader(tmp_path: Path) -> None:
    """Slow writes are still in flight when step() returns; a gather-like fetch of param
    and a read of the state right after see the new values (the manager orders them)."""
    rig = Rig(tmp_path, DelayIO(write_delay=0.01))
    stream = rig.stream(150_000)
    try:
        rig.new_grads()
        rig.ref.step(hyper=HYPER, step=1)
        stream.step(HYPER, 1)
        assert stream.writes_in_flight > 0
        last = ORDER[-1]  # written last: its writes are surely still queued
        assert torch.equal(rig.read(last, "param"), rig.ref.tensors[last]["param"])
        assert torch.equal(rig.read(last, "master"), rig.ref.tensors[last]["master"])
        rig.assert_equal()
    finally:
        stream.close()
        rig.close()


def test_state_written_between_steps_is_read_again(tmp_path: Path) -> None:
    """A read-ahead taken before someone else wrote the state (e.g. a checkpoint load) is
    not used: the version check reads it again."""
    rig = Rig(tmp_path)
    stream = rig.stream(150_000)
    try:
        rig.new_grads()
        rig.ref.step(hyper=HYPER, step=1)
        stream.step(HYPER, 1)
        stream.wait_idle()  # the first shards of step 2 are in host buffers now
        first = ORDER[0]
        new = torch.randn(NUMELS[first], generator=rig.gen)
        rig.ref.tensors[first]["master"].copy_(new)
        rig.write(first, "master", new)
        rig.new_grads()
        rig.ref.step(hyper=HYPER, step=2)
        stream.step(HYPER, 2)
        stream.flush()
        rig.assert_equal()
    finally:
        stream.close()
        rig.close()


def test_failure_mid_step_leaves_each_shard_whole(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel fails on the third shard: the shards before it are fully updated, the
    rest untouched, the manager holds nothing, and the next step runs."""
    rig = Rig(tmp_path)
    stream = rig.stream(150_000)
    initial = [{c: t.clone() for c, t in s.items()} for s in rig.ref.tensors]
    calls = {"n": 0}
    real = adam_stream.adam_update

    def failing(*args: object, **kw: object) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected kernel failure")
        real(*args, **kw)  # type: ignore[arg-type]

    try:
        rig.new_grads()
        rig.ref.step(hyper=HYPER, step=1)
        monkeypatch.setattr(adam_stream, "adam_update", failing)
        with pytest.raises(RuntimeError, match="injected kernel failure"):
            stream.step(HYPER, 1)
        monkeypatch.setattr(adam_stream, "adam_update", real)
        done = [i for i in ORDER if NUMELS[i]][:2]
        rig.assert_equal(done)
        for i in (i for i in ORDER if NUMELS[i] and i not in done):
            for c in ("master", "exp_avg", "exp_avg_sq", "param"):
                assert torch.equal(rig.read(i, c), initial[i][c]), f"shard {i} {c} changed"
        rig.mgr.synchronize()
        rig.mgr.audit()
        stream.step(HYPER, 1)  # runs again from the first shard
        stream.flush()
        rig.mgr.audit()
    finally:
        stream.close()
        rig.close()


def test_read_failure_is_raised_naming_the_shard_and_unwinds(tmp_path: Path) -> None:
    io = FailingIO()
    rig = Rig(tmp_path, io)
    stream = rig.stream(0)
    try:
        rig.new_grads()
        io.armed = True
        with pytest.raises(OffloadError, match="optimizer state of shard 4"):
            stream.step(HYPER, 1)
        io.armed = False
        rig.mgr.synchronize()
        rig.mgr.audit()
        rig.ref.step(hyper=HYPER, step=1)
        stream.step(HYPER, 1)
        stream.flush()
        rig.assert_equal()
    finally:
        stream.close()
        rig.close()


@pytest.mark.parametrize("ring", [0, 150_000])
def test_a_write_still_in_flight_after_the_step_fails_loudly(tmp_path: Path,
                                                             ring: int) -> None:
    """The last pwrite of a step fails (EIO) after step() returned: nothing in the step
    waits for it, and the next step's read-ahead is chained behind it (ring 0: one shard
    at a time). It is raised once, to the first who waits for it: the step, flush(), or
    the read-ahead (which reads again when its step comes). Every other key holds the
    step's update. The failed key is refused ([Note: a lost write]), unless its write
    went through a host cache (the param of a last shard, offered to the next forward),
    which keeps the update."""
    from swap_helpers import FaultyIO

    io = FaultyIO()
    rig = Rig(tmp_path, io)
    stream = rig.stream(ring)
    try:
        rig.new_grads()
        rig.ref.step(hyper=HYPER, step=1)
        before = io.calls["pwrite"]
        stream.step(HYPER, 1)
        stream.flush()
        per_step = io.calls["pwrite"] - before
        rig.new_grads()
        rig.ref.step(hyper=HYPER, step=2)
        io.arm("pwrite", errno.EIO, after=per_step - 1)  # the step's last write
        failed: list[BaseException] = []
        try:
            stream.step(HYPER, 2)
        except OffloadError as exc:  # it landed before the step's last look at its writes
            failed.append(exc)
        if not failed:
            try:
                stream.flush()
            except OffloadError as exc:
                failed.append(exc)
        assert io.calls["pwrite"] - before == 2 * per_step
        for exc in failed:
            assert re.search(r"scratch\.swp'; errno 5 \(EIO", str(exc)), exc
        with contextlib.suppress(OffloadError):  # raised to the manager once, unless a
            rig.mgr.synchronize()  # waiter or a read-ahead's call was told first
        refused = []
        for i, keys in enumerate(rig.keys):
            for c, k in keys.items():
                if c == "grad":
                    continue
                try:
                    got = rig.read(i, c)
                except OffloadError as exc:
                    assert "last write of this shard failed" in str(exc), exc
                    refused.append((i, k))
                    continue
                assert torch.equal(got, rig.ref.tensors[i][c]), k
        # one write failed: at most its key is refused. Which shard issued the step's last
        # pwrite is the I/O threads' order (usually the last shard's, not always on a busy
        # machine), so the failed key is the one the error names, not a fixed one.
        assert len(refused) <= 1, refused
        for exc in failed[:1] if refused else ():
            assert f"key '{refused[0][1]}'" in str(exc), exc
    finally:
        try:
            stream.close()
        finally:
            rig.close()


def test_bad_arguments_are_refused_before_any_work(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    try:
        with pytest.raises(ValueError, match="order must list every shard"):
            AdamStream(rig.mgr, rig.keys, NUMELS, order=[0, 1], buffer_bytes=0, shadow=None)
        with pytest.raises(ValueError, match="buffer_bytes=-1"):
            AdamStream(rig.mgr, rig.keys, NUMELS, buffer_bytes=-1, shadow=None)
        with pytest.raises(ValueError, match="no key for"):
            AdamStream(rig.mgr, [{}] * len(NUMELS), NUMELS, buffer_bytes=0, shadow=None)
        with pytest.raises(OffloadError, match="the shard is"):
            rig.mgr.write_from(rig.keys[0]["master"], torch.zeros(3))
    finally:
        rig.close()


@pytest.mark.parametrize("ring", [0, 150_000, 1 << 20])
def test_new_order_between_steps_keeps_the_state_exact(tmp_path: Path, ring: int) -> None:
    """set_order after a step, with writes in flight and the read-ahead taken for the old
    order (slow writes keep them queued): the stream drains once, every later step follows
    the new order, and the state stays bitwise the reference step's."""
    rig = Rig(tmp_path, DelayIO(write_delay=0.002))
    stream = rig.stream(ring)
    try:
        rig.new_grads()
        rig.ref.step(hyper=HYPER, step=1)
        stream.step(HYPER, 1)
        assert stream.writes_in_flight > 0
        kept = stream.kept
        new = list(reversed(ORDER))
        assert stream.set_order(new) and stream.order == new
        assert stream.writes_in_flight == 0  # drained by the change
        assert not stream.set_order(new)  # the same order again: nothing to do
        for step in (2, 3):
            rig.new_grads()
            rig.ref.step(hyper=HYPER, step=step)
            stream.step(HYPER, step)
        assert stream.kept == kept  # chosen once, from the construction order
        stream.flush()
        rig.assert_equal()
    finally:
        stream.close()
        rig.close()


def test_order_change_is_refused_while_open_or_malformed(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    stream = rig.stream(150_000)
    try:
        with pytest.raises(ValueError, match="order must list every shard"):
            stream.set_order([0, 1, 2])
        rig.new_grads()
        stream.begin(HYPER, 1)
        with pytest.raises(OffloadError, match=r"set_order\(\) while a step is open"):
            stream.set_order(list(reversed(ORDER)))
        stream.finish()
        assert stream.order == ORDER
    finally:
        stream.close()
        rig.close()


def test_read_ahead_is_a_background_read(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The state a step needs at once is a plain read; every read taken ahead (later
    shards of the step, the next step's first ones) is a background read, which the swap
    store moves behind parameter fetches ([Note: swap I/O order])."""
    rig = Rig(tmp_path)
    calls: list[tuple[str, bool]] = []
    real = rig.mgr.read_into

    def spy(key: str, out: torch.Tensor, *, background: bool = False,
            replacing: bool = False) -> object:
        calls.append((key, background))
        return real(key, out, background=background, replacing=replacing)

    monkeypatch.setattr(rig.mgr, "read_into", spy)
    stream = rig.stream(150_000)
    try:
        rig.new_grads()
        stream.step(HYPER, 1)
        stream.wait_idle()
        first = rig.keys[ORDER[0]]["master"]
        flags = [bg for key, bg in calls if key == first]
        assert flags == [False, True]  # step 1 needed it now; step 2's copy is read-ahead
        assert sum(not bg for _, bg in calls) == 3  # master and moments of the first shard
        assert any(bg for key, bg in calls if key != first)
    finally:
        stream.close()
        rig.close()
