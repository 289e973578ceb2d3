"""Transparent huge pages for the host buffers allocated every step ([Note: huge pages for
per-step host buffers] in offload/huge_pages.py).

What is guaranteed, and checked here, is the advice the kernel records: a range advised
MADV_HUGEPAGE carries the "hg" flag in /proc/self/smaps (whether a huge page was free
when it was faulted in is the kernel's business, and is not asserted). The checks that
read the kernel's flags run where the kernel's THP mode is "madvise" (the usual default);
elsewhere they are skipped with the mode named.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tierzero.offload import huge_pages as hp
from tierzero.offload.transfer import Mover

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20
MODE = hp.thp_mode()
needs_madvise = pytest.mark.skipif(
    not sys.platform.startswith("linux") or MODE != "madvise",
    reason=f"the kernel's transparent huge page mode is {MODE!r}, not 'madvise': "
           "no advice is given, so there is nothing to observe")


def vm_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `addr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_thp_mode_reads_the_bracketed_word(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hp.thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert hp.thp_mode(f) == "always"
    f.write_text("garbage\n")
    assert hp.thp_mode(f) is None
    assert hp.thp_mode(tmp_path / "missing") is None


def test_huge_range_is_the_whole_huge_pages_inside() -> None:
    H = hp.HUGE_PAGE
    assert hp.huge_range(4 * H, 3 * H) == (4 * H, 3 * H)
    assert hp.huge_range(4 * H + 4096, 3 * H) == (5 * H, 2 * H)  # both ends cut
    assert hp.huge_range(4 * H + 1, 2 * H) == (5 * H, H)
    assert hp.huge_range(4 * H + 1, 2 * H - 2) is None  # no whole page inside
    assert hp.huge_range(4 * H, H - 1) is None
    assert hp.huge_range(4 * H, H) == (4 * H, H)


def test_advise_huge_declines_what_it_cannot_advise() -> None:
    assert not hp.advise_huge(torch.empty(8 * MB, dtype=torch.uint8, device="meta"))
    assert not hp.advise_huge(torch.empty(64 << 10, dtype=torch.uint8))  # under 2 MiB


@needs_madvise
def test_advise_huge_marks_the_range() -> None:
    t = torch.empty(16 * MB, dtype=torch.uint8)
    assert hp.advise_huge(t)
    lo, _ = hp.huge_range(t.data_ptr(), t.numel())  # type: ignore[misc]
    assert "hg" in vm_flags(lo)
    t.fill_(1)  # still ordinary memory
    assert int(t.sum()) == t.numel()


def check_engine_buffers() -> None:
    """The device tier's CPU buffers and the host allocator's are advised."""
    eng = Mover(torch.device("cpu"), None)
    try:
        t = eng.empty_device(4 * MB, torch.float32)
        lo, _ = hp.huge_range(t.data_ptr(), t.numel() * 4)  # type: ignore[misc]
        assert "hg" in vm_flags(lo)
    finally:
        eng.close()
    from tierzero.offload.pool import HostAllocator
    h = HostAllocator(pin=False, node=None).empty(16 * MB)
    lo, _ = hp.huge_range(h.data_ptr(), h.numel())  # type: ignore[misc]
    assert "hg" in vm_flags(lo)


def check_gather_buffers() -> None:
    """A unit's gather buffer on a CPU device, allocated anew at each gather, is advised
    before the gather writes it: seen from inside each forward, on the parameter itself."""
    from dataclasses import replace

    from engine_helpers import make_config

    from tierzero import engine
    from tierzero.engine.config import OffloadConfig, OptimizerOffloadConfig, ParamOffloadConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 4 MiB weights
    cfg = make_config("fp32", units=("Linear",))
    cfg = replace(cfg, offload=OffloadConfig(params=ParamOffloadConfig(device="cpu"),
                                             optimizer=OptimizerOffloadConfig(device="cpu")))
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    seen: list[set[str]] = []

    def look(mod: nn.Module, args: object) -> None:
        w = mod.weight  # type: ignore[union-attr]
        span = hp.huge_range(w.data_ptr(), w.numel() * w.element_size())
        assert span is not None
        seen.append(vm_flags(span[0]))

    for m in model:
        m.register_forward_pre_hook(look)
    try:
        for _ in range(2):
            loss = eng(torch.randn(2, 1024)).sum()
            eng.backward(loss)
            eng.step()
    finally:
        eng.close()
    assert len(seen) == 4 and all("hg" in f for f in seen), seen


def check_torch_not_advising() -> None:
    """The control: with THP_MEM_ALLOC_ENABLE=0 torch's own tensors are not advised, so
    what the checks above see is the engine's advice."""
    t = torch.empty(16 * MB, dtype=torch.uint8)
    lo, _ = hp.huge_range(t.data_ptr(), t.numel())  # type: ignore[misc]
    assert "hg" not in vm_flags(lo)


@needs_madvise
@pytest.mark.parametrize("check", ["check_engine_buffers", "check_gather_buffers"])
def test_engine_advises_its_own_buffers(check: str) -> None:
    """Run where torch's allocator does not advise (THP_MEM_ALLOC_ENABLE=0: as in a process
    that made a tensor before it imported tierzero); the control runs in the same process,
    before the check."""
    off = {"THP_MEM_ALLOC_ENABLE": "0"}
    assert _child_checks(["check_torch_not_advising", check], off) == "ok"


def _child_checks(names: list[str], env: dict[str, str]) -> str:
    calls = "; ".join(f"t.{name}()" for name in names)
    return _child("import sys; sys.path[:0] = ['tests', 'tests/offload']\n"
                  f"import test_huge_pages as t; {calls}; print('ok')", env)


def _child(code: str, env: dict[str, str]) -> str:
    full = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env
    out = subprocess.run([sys.executable, "-c", code], env=full, cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip()


def test_import_sets_torchs_switch_unless_the_environment_says() -> None:
    code = "import os, tierzero; print(os.environ['THP_MEM_ALLOC_ENABLE'])"
    assert _child(code, {}) == "1"
    assert _child(code, {"THP_MEM_ALLOC_ENABLE": "0"}) == "0"


@needs_madvise
def test_torch_tensors_are_advised_when_tierzero_is_imported_first() -> None:
    """torch reads the switch at its first allocation: a process that imports tierzero
    before making a tensor has every tensor of 2 MiB or more advised (autograd's too)."""
    code = ("import tierzero, torch\n"
            "from tierzero.offload.huge_pages import huge_range\n"
            "import sys; sys.path.insert(0, 'tests/offload')\n"
            "from test_huge_pages import vm_flags\n"
            "t = torch.empty(16 << 20, dtype=torch.uint8)\n"
            "print('hg' in vm_flags(huge_range(t.data_ptr(), t.numel())[0]))")
    assert _child(code, {}) == "True"
    assert _child(code, {"THP_MEM_ALLOC_ENABLE": "0"}) == "False"
