"""Building the C Adam kernel: cache reuse, and the logged fallback when it cannot be built."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from tierzero.offload import AdamHyper, CPUAdam, adam_build, adam_update

HAS_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))


@pytest.fixture(autouse=True)
def _quick_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests build the kernel into fresh cache directories several times to check
    caching and the cache's safety, not the kernel's speed: -O0 instead of -O3 (about 1 s
    a build instead of 8-12 s). Every other test uses the -O3 kernel built once."""
    monkeypatch.setattr(adam_build, "BASE_FLAGS", tuple(
        "-O0" if f == "-O3" else f for f in adam_build.BASE_FLAGS))
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


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


# A shared object whose constructor creates the file named by $TZ_PLANTED_MARKER: loading it
# would run someone else's code as the caller.
_PLANTED_C = """
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *p = getenv("TZ_PLANTED_MARKER");
    FILE *f = p ? fopen(p, "w") : NULL;
    if (f) fclose(f);
}
int tz_adam_abi_version(void) { return 2; }
"""


def _legit_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """(file name of a real build, the old-style name tz_adam_<key>.so) for this machine."""
    monkeypatch.setenv(adam_build.ENV_CACHE, str(tmp_path / "legit"))
    kernel, reason = adam_build._try_compile()
    assert kernel is not None, reason
    key = kernel.path.name.split("-")[0].removeprefix("tz_adam_")
    return kernel.path.name, f"tz_adam_{key}.so"


def _plant(directory: Path, names: tuple[str, ...], tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Path:
    src = tmp_path / "planted.c"
    src.write_text(_PLANTED_C)
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", str(src), "-o",
                        str(directory / name)], check=True)
    marker = tmp_path / "planted-code-ran"
    monkeypatch.setenv("TZ_PLANTED_MARKER", str(marker))
    return marker


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_cache_dir_writable_by_others_is_not_loaded_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(adam_build.ENV_DISABLE, raising=False)
    names = _legit_name(tmp_path, monkeypatch)
    shared = tmp_path / "shared"
    marker = _plant(shared / "adam", names, tmp_path, monkeypatch)
    os.chmod(shared / "adam", 0o777)
    monkeypatch.setenv(adam_build.ENV_CACHE, str(shared))
    kernel, reason = adam_build._try_compile()
    assert kernel is None
    assert "writable by group or others (mode 0777)" in reason and "chmod go-w" in reason
    assert not marker.exists()


@root_only
@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_cache_dir_of_another_user_is_not_loaded_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(adam_build.ENV_DISABLE, raising=False)
    names = _legit_name(tmp_path, monkeypatch)
    theirs = tmp_path / "theirs"
    marker = _plant(theirs / "adam", names, tmp_path, monkeypatch)
    os.chmod(theirs / "adam", 0o755)
    os.chown(theirs / "adam", 65534, 65534)
    monkeypatch.setenv(adam_build.ENV_CACHE, str(theirs))
    kernel, reason = adam_build._try_compile()
    assert kernel is None and "belongs to uid 65534" in reason
    assert not marker.exists()


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_cached_file_with_wrong_hash_or_mode_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(adam_build.ENV_DISABLE, raising=False)
    names = _legit_name(tmp_path, monkeypatch)
    for mode in (0o600, 0o666):  # wrong hash; then right dir, writable file
        mine = tmp_path / f"mine-{mode:o}"
        marker = _plant(mine / "adam", names, tmp_path, monkeypatch)
        os.chmod(mine / "adam" / names[0], mode)
        monkeypatch.setenv(adam_build.ENV_CACHE, str(mine))
        with caplog.at_level(logging.WARNING, logger="tierzero.offload.adam_build"):
            kernel, reason = adam_build._try_compile()
        assert kernel is not None, reason
        assert not marker.exists()
        assert any("ignoring cached CPU Adam kernel" in r.message for r in caplog.records)
        m = torch.zeros(8)
        adam_update(m, torch.zeros(8), torch.zeros(8), torch.ones(8), hyper=AdamHyper(),
                    step=1, backend="compiled")
        assert torch.all(m < 0)
    built = tmp_path / "mine-600" / "adam" / names[0]
    assert stat.S_IMODE(built.stat().st_mode) == 0o600


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_new_cache_dir_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(adam_build.ENV_DISABLE, raising=False)
    monkeypatch.setenv(adam_build.ENV_CACHE, str(tmp_path / "fresh"))
    kernel, reason = adam_build._try_compile()
    assert kernel is not None, reason
    assert stat.S_IMODE(os.lstat(tmp_path / "fresh" / "adam").st_mode) == 0o700
    assert stat.S_IMODE(kernel.path.stat().st_mode) == 0o600


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_two_libraries_opened_through_the_same_descriptor_number_stay_apart(
        tmp_path: Path) -> None:
    """The loader knows a library by the name it was opened under: loading a second file
    through a reused /proc/self/fd/N used to hand back the first library (a rebuilt kernel
    after a cached one failed its checks ran the old one)."""
    cc = adam_build._compiler()
    assert cc is not None
    which = []
    for n in (1, 2):
        src, lib = tmp_path / f"l{n}.c", tmp_path / f"l{n}.so"
        src.write_text(f"int which(void) {{ return {n}; }}\n")
        subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
        fd = os.open(lib, os.O_RDONLY)
        try:
            which.append((fd, adam_build._dlopen(lib, fd).which()))
        finally:
            os.close(fd)  # the next open may get the same number
    assert [w for _, w in which] == [1, 2], which
