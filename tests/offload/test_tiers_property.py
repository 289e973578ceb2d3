"""Property test: random place/fetch/release/evict/pin/prefetch sequences over all
three tiers with small budgets. After every step: data intact (against a shadow
copy), no budget exceeded, accounting equal to the records, no leaked buffers;
dirty data survives every eviction down to the home copy."""

from __future__ import annotations

import shutil
import tempfile

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tiers_util import cpu_settings, data_for

from tierzero.offload import ShardSpec, TierManager
from tierzero.swap import SwapStore

SPECS = [
    ShardSpec("p0", "param", 256, torch.float16),
    ShardSpec("p1", "param", 512, torch.float32),
    ShardSpec("p2", "param", 96, torch.float32),
    ShardSpec("g0", "grad", 300, torch.float32),
    ShardSpec("g1", "grad", 128, torch.float16),
    ShardSpec("m0", "master", 200, torch.float32),
    ShardSpec("e0", "exp_avg", 64, torch.float32),
]
HOMES = {"param": "nvme", "grad": "cpu", "master": "none", "exp_avg": "nvme"}
BIG = max(s.nbytes for s in SPECS)
DEVICE_HOMES = sum(s.nbytes for s in SPECS if HOMES[s.cls] == "none")
KEYS = [s.key for s in SPECS]
TIERS = ["device", "host"]


class TierMachine(RuleBasedStateMachine):
    """A model: the shadow data, what the test holds and what it pinned."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="tiers-prop-")
        self.store = SwapStore(self.dir, block_size=1 << 16)
        # room for: one held copy, one pinned copy, the fetch being checked
        self.mgr = TierManager(SPECS, cpu_settings(
            HOMES, device=DEVICE_HOMES + 3 * BIG, host=1 << 20, buffer_count=3, timeout=2.0,
            nvme_ahead=3 * BIG, device_ahead=2 * BIG), swap=self.store)
        self.shadow: dict[str, torch.Tensor] = {}
        self.held: tuple[str, str] | None = None
        self.pinned: tuple[str, str] | None = None
        self.step = 0

    def _tiers(self, key: str) -> list[str]:
        home = self.mgr.home_of(key)
        return TIERS[: TIERS.index(home) + 1] if home != "nvme" else TIERS

    def _busy(self, key: str) -> bool:
        return any(x is not None and x[0] == key for x in (self.held, self.pinned))

    @initialize()
    def place_all(self) -> None:
        for i, spec in enumerate(SPECS):
            self.shadow[spec.key] = data_for(spec, i)
            self.mgr.place(spec.key, self.shadow[spec.key]).wait()

    @rule(key=st.sampled_from(KEYS), tier=st.sampled_from(TIERS), modify=st.booleans())
    def fetch_check(self, key: str, tier: str, modify: bool) -> None:
        if tier not in self._tiers(key):
            return
        # writing below a held/pinned faster cache would make it stale, and a copy written
        # while others hold it counts as written until all release: both refused by design
        modify = modify and not self._busy(key)
        view = self.mgr.fetch(key, tier, writable=modify).wait()  # type: ignore[arg-type]
        assert torch.equal(view, self.shadow[key]), f"{key} on {tier} differs from its shadow"
        if modify:
            self.step += 1
            view.add_(self.step % 7 + 1)
            self.shadow[key] = view.clone()
        self.mgr.release(key, tier)  # type: ignore[arg-type]

    @precondition(lambda self: self.held is None)
    @rule(key=st.sampled_from(KEYS), tier=st.sampled_from(TIERS))
    def hold(self, key: str, tier: str) -> None:
        if tier in self._tiers(key):
            view = self.mgr.fetch(key, tier).wait()  # type: ignore[arg-type]
            assert torch.equal(view, self.shadow[key])
            self.held = (key, tier)

    @precondition(lambda self: self.held is not None)
    @rule()
    def unhold(self) -> None:
        assert self.held is not None
        self.mgr.release(*self.held)  # type: ignore[arg-type]
        self.held = None

    @precondition(lambda self: self.pinned is None)
    @rule(key=st.sampled_from(KEYS), tier=st.sampled_from(TIERS))
    def pin(self, key: str, tier: str) -> None:
        if tier in self._tiers(key):
            assert torch.equal(self.mgr.pin(key, tier).wait(), self.shadow[key])  # type: ignore[arg-type]
            self.pinned = (key, tier)

    @precondition(lambda self: self.pinned is not None)
    @rule()
    def unpin(self) -> None:
        assert self.pinned is not None
        self.mgr.unpin(*self.pinned)  # type: ignore[arg-type]
        self.pinned = None

    @rule(key=st.sampled_from(KEYS), tier=st.sampled_from([None, "device", "host"]))
    def evict(self, key: str, tier: str | None) -> None:
        home = self.mgr.home_of(key)
        if self._busy(key) or (tier is not None and TIERS.index(tier) >= TIERS.index(home)
                               if home != "nvme" else False):
            return
        self.mgr.evict(key, tier)  # type: ignore[arg-type]

    @rule(order=st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(TIERS)), max_size=10))
    def prefetch(self, order: list[tuple[str, str]]) -> None:
        self.mgr.set_order([(k, t) for k, t in order if t in self._tiers(k)])  # type: ignore[misc]

    @rule(key=st.sampled_from(KEYS))
    def flush_and_check_home(self, key: str) -> None:
        """Evict every cache of ``key``; the authoritative copy must hold the shadow."""
        if self._busy(key):
            return
        self.mgr.evict(key)
        self.mgr.synchronize()
        rec = self.mgr._records[key]
        if rec.home == "nvme":
            out = torch.empty(rec.spec.numel, dtype=rec.spec.dtype)
            self.store.read(key, out=out).wait()
        else:
            out = rec.copies[rec.home].data  # type: ignore[assignment]
        assert torch.equal(out, self.shadow[key]), f"dirty data of {key} lost on eviction"

    @invariant()
    def consistent(self) -> None:
        self.mgr.audit()  # bytes re-derived from records, budgets, pool slots, inclusion
        rep = self.mgr.memory_report()
        for tier, peak in rep.peak.items():
            assert peak <= rep.budget[tier], f"{tier} peaked at {peak} > {rep.budget[tier]}"

    def teardown(self) -> None:
        try:
            if self.held is not None:
                self.unhold()
            if self.pinned is not None:
                self.unpin()
            for key in KEYS:
                self.mgr.evict(key)
            self.mgr.synchronize()
            self.mgr.audit()
            assert self.mgr.memory_report().pool_in_use == 0, "pool buffers leaked"
            for key in KEYS:
                for tier in self._tiers(key):
                    view = self.mgr.fetch(key, tier).wait()  # type: ignore[arg-type]
                    assert torch.equal(view, self.shadow[key])
                    self.mgr.release(key, tier)  # type: ignore[arg-type]
        finally:
            self.mgr.close()
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)  # the directory this test made


TierMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_tier_machine = TierMachine.TestCase
