"""Building the C Adam kernel: cache reuse, and the logged fallback when it cannot be built."""

from __future__ import annotations

import logging
import shutil
import stat
from pathlib import Path

import pytest
import torch

from tierzero.offload import AdamHyper, CPUAdam, adam_build, adam_update

HAS_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_builds_once_then_loads_from_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    monkeypatch.setenv(adam_build.ENV_CACHE, str(tmp_path))
    monkeypatch.delenv(adam_build.ENV_DISABLE, raising=False)
    kernel, reason = adam_build._try_compile()
    assert kernel is not None, reason
    built = sorted((tmp_path / "adam").glob("*.so"))
    assert len(built) == 1 and kernel.path == built[0]
    mtime = built[0].stat().st_mtime_ns
    again, _ = adam_build._try_compile()
    assert again is not None and again.path == built[0]
    assert built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt
    assert sorted((tmp_path / "adam").iterdir()) == built  # no temporary files left


def test_no_compiler_gives_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.delenv(adam_build.ENV_DISABLE, raising=False)
    kernel, reason = adam_build._try_compile()
    assert kernel is None
    assert "no C compiler found" in reason


def test_failing_compiler_gives_its_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    fake = tmp_path / "broken-cc"
    fake.write_text("#!/bin/sh\necho 'broken-cc: internal error' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv(adam_build.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv(adam_build.ENV_DISABLE, raising=False)
    kernel, reason = adam_build._try_compile()
    assert kernel is None
    assert "exited 3" in reason and "broken-cc: internal error" in reason
    assert list((tmp_path / "cache" / "adam").iterdir()) == []  # temp outputs removed


def test_fallback_is_logged_once_and_still_correct(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(adam_build.ENV_DISABLE, "torch")
    monkeypatch.setattr(adam_build, "_loaded", {})
    monkeypatch.setattr(adam_build, "_reason", {})
    with caplog.at_level(logging.WARNING, logger="tierzero.offload.adam_build"):
        assert adam_build.compiled_kernel() is None
        assert adam_build.compiled_kernel() is None
        # "auto" now takes the PyTorch path and must still match torch.optim.AdamW exactly.
        p = torch.randn(1000, requires_grad=True)
        ref = p.detach().clone().requires_grad_()
        opt, ref_opt = CPUAdam([p], weight_decay=0.1), torch.optim.AdamW([ref], weight_decay=0.1)
        for _ in range(5):
            g = torch.randn(1000)
            p.grad, ref.grad = g.clone(), g.clone()
            opt.step()
            ref_opt.step()
        assert torch.equal(p, ref)
        with pytest.raises(RuntimeError, match="backend='compiled' requested but unavailable"):
            e = torch.zeros(3)
            adam_update(e, e.clone(), e.clone(), e.clone(), hyper=AdamHyper(), step=1,
                        backend="compiled")
    warnings = [r for r in caplog.records if "falls back to the pure-PyTorch path" in r.message]
    assert len(warnings) == 1
    assert "TIERZERO_ADAM_KERNEL=torch" in warnings[0].getMessage()


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_unusable_cache_dir_gives_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(adam_build.ENV_CACHE, str(blocker))
    monkeypatch.delenv(adam_build.ENV_DISABLE, raising=False)
    kernel, reason = adam_build._try_compile()
    assert kernel is None
    assert "is not writable" in reason and "TIERZERO_CACHE_DIR" in reason
