"""The swap directory is the caller's alone: per-user, never through a symlink,
never another user's, and stale cleanup touches only the caller's dead files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from swap_helpers import CreateThenRefuseDirectIO

from tierzero.swap import SwapError, SwapStore, scratch
from tierzero.swap.scratch import SUBDIR, clean_stale

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def test_subdir_is_per_user_and_private(tmp_path: Path) -> None:
    assert f"tierzero-swap-{os.geteuid()}" == SUBDIR
    other = tmp_path / f"tierzero-swap-{os.geteuid() + 1}"  # another user's, mode 0700
    other.mkdir(mode=0o700)
    with SwapStore(tmp_path) as s:
        s.write("k", torch.ones(10)).wait()
        assert Path(s.path).parent == tmp_path / SUBDIR
        assert stat.S_IMODE(os.lstat(tmp_path / SUBDIR).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(s.path).st_mode) == 0o600
    assert other.is_dir()


def test_symlinked_subdir_is_refused_and_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.mkdir()
    bait = target / "swap-1-deadbeef.scratch.swp"  # looks stale; must survive
    bait.write_bytes(b"precious")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / SUBDIR).symlink_to(target)
    with pytest.raises(SwapError, match=r"symbolic link.*directory you own"):
        SwapStore(shared)
    assert bait.read_bytes() == b"precious"
    assert sorted(p.name for p in target.iterdir()) == [bait.name]


def test_other_users_subdir_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend to be uid+1: the directory at that user's name belongs to us, not them.
    me = os.geteuid()
    monkeypatch.setattr(scratch, "_caller_uid", lambda: me + 1)
    planted = tmp_path / f"tierzero-swap-{me + 1}"
    planted.mkdir(mode=0o700)
    victim = planted / "swap-1-deadbeef.lock"
    victim.write_text("theirs")
    with pytest.raises(SwapError, match=rf"belongs to uid {me}, not to you \(uid {me + 1}\)"):
        SwapStore(tmp_path)
    assert victim.read_text() == "theirs"


@root_only
def test_subdir_chowned_to_another_user_is_refused(tmp_path: Path) -> None:
    sub = tmp_path / SUBDIR
    sub.mkdir(mode=0o700)
    os.chown(sub, 65534, 65534)
    with pytest.raises(SwapError, match=r"belongs to uid 65534"):
        SwapStore(tmp_path)


def test_subdir_open_to_others_is_refused(tmp_path: Path) -> None:
    sub = tmp_path / SUBDIR
    sub.mkdir()
    os.chmod(sub, 0o777)
    with pytest.raises(SwapError, match=r"mode 0777.*chmod 700"):
        SwapStore(tmp_path)


def test_planted_lock_link_is_neither_followed_nor_removed(tmp_path: Path) -> None:
    sub = tmp_path / SUBDIR
    sub.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    link = sub / "swap-1-deadbeef.lock"
    link.symlink_to(victim)
    data = sub / "swap-1-deadbeef.scratch.swp"
    data.write_bytes(b"x")
    assert clean_stale(sub) == []
    assert link.is_symlink() and data.exists() and victim.read_text() == "keep"
    with SwapStore(tmp_path) as s:
        s.write("k", torch.ones(4)).wait()
    assert link.is_symlink() and victim.read_text() == "keep"


@root_only
def test_stale_files_of_another_owner_are_kept(tmp_path: Path) -> None:
    sub = tmp_path / SUBDIR
    sub.mkdir(mode=0o700)
    lock = sub / "swap-1-deadbeef.lock"
    data = sub / "swap-1-deadbeef.scratch.swp"
    lock.write_text("")
    data.write_bytes(b"x")
    os.chown(data, 65534, 65534)
    assert clean_stale(sub) == []
    assert lock.exists() and data.exists()


def test_live_store_whose_lock_file_was_removed_is_not_stale(tmp_path: Path) -> None:
    with SwapStore(tmp_path) as s:
        s.write("k", torch.arange(100)).wait()
        lock = Path(s.path).with_name(Path(s.path).name.replace(".scratch.swp", ".lock"))
        lock.unlink()  # what a tmp cleaner does
        assert clean_stale(tmp_path / SUBDIR) == []
        with SwapStore(tmp_path) as other:
            other.write("k", torch.ones(3)).wait()
        assert torch.equal(s.read("k").wait(), torch.arange(100))


def test_dead_stores_files_are_still_cleaned(tmp_path: Path) -> None:
    sub = tmp_path / SUBDIR
    sub.mkdir(mode=0o700)
    names = ["swap-1-aa.lock", "swap-1-aa.scratch.swp", "swap-2-bb.scratch.swp"]
    for n in names:
        (sub / n).write_bytes(b"")
    assert sorted(p.name for p in clean_stale(sub)) == sorted(names)


def test_o_direct_refused_after_create_falls_back(tmp_path: Path) -> None:
    # ramfs, tmpfs before Linux 6.6: the failed O_DIRECT open leaves the file behind.
    with SwapStore(tmp_path, fileio=CreateThenRefuseDirectIO(), verify=True) as s:
        assert not s.direct
        s.write("k", torch.arange(50)).wait()
        assert torch.equal(s.read("k").wait(), torch.arange(50))
    assert not list(tmp_path.rglob("*.swp"))
