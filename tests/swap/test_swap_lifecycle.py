"""Scratch files: removed on close and at exit; stale ones of dead processes cleaned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tierzero.swap import SwapStore
from tierzero.swap.scratch import SUBDIR, clean_stale

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=check,
    )


def test_close_removes_files_and_own_subdir_only(tmp_path: Path) -> None:
    user_file = tmp_path / "keep.txt"
    user_file.write_text("mine")
    with SwapStore(tmp_path) as s:
        s.write("k", torch.zeros(1000)).wait()
        data = Path(s.path)
        assert data.name.endswith(".scratch.swp") and data.parent.name == SUBDIR
        assert data.exists() and data.with_name(data.name.replace(".scratch.swp", ".lock"))
    assert not data.exists() and not (tmp_path / SUBDIR).exists()
    assert user_file.read_text() == "mine"


def test_interpreter_exit_removes_files(tmp_path: Path) -> None:
    # Writes still in flight at exit (through the bounce copy, in torch's C++) must
    # finish before finalization: a daemon thread frozen there aborted the process
    # in about 1 run of 12 before the exit hook closed the store.
    code = """
        import sys, torch
        from tierzero.swap import SwapStore
        s = SwapStore(sys.argv[1])          # never closed
        s.write("k", torch.zeros(1 << 20)).wait()
        for i in range(16):
            s.write(f"pending{i}", torch.zeros(1 << 20))   # unaligned: bounce copies
        print(s.path)
        """
    runs = []
    for i in range(3):  # three exits, run side by side (each its own directory and check)
        where = tmp_path / f"run{i}"
        where.mkdir()
        runs.append((where, subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), str(where)], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    try:
        for where, proc in runs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            path = Path(out.strip())
            assert path.name.endswith(".scratch.swp")
            assert not path.exists()
            assert not list(where.rglob("*.swp")) and not list(where.rglob("*.lock"))
    finally:
        for _, proc in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_killed_mid_write_then_next_store_starts_clean(tmp_path: Path) -> None:
    # A child writes forever; we SIGKILL it in the middle of a write.
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            """
            import sys, torch
            from tierzero.swap import SwapStore, aligned_empty
            s = SwapStore(sys.argv[1], block_size=1 << 16)
            buf = aligned_empty(16 << 20, torch.uint8).fill_(1)
            s.write("warm", buf).wait()
            print(s.path, flush=True)
            i = 0
            while True:
                s.write(f"k{i % 4}", buf)
                i += 1
            """), str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    dead_path = Path(proc.stdout.readline().strip())
    assert dead_path.exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    # a live store in the same directory must survive the cleanup
    with SwapStore(tmp_path) as live:
        live.write("x", torch.ones(100)).wait()
        assert not dead_path.exists()
        assert not dead_path.with_name(dead_path.name.replace(".scratch.swp", ".lock")).exists()
        with SwapStore(tmp_path) as second:  # cleans again; must not touch `live`
            second.write("y", torch.ones(100)).wait()
            assert Path(live.path).exists()
            assert torch.equal(live.read("x").wait(), torch.ones(100))
        assert Path(live.path).exists()
        assert torch.equal(live.read("x").wait(), torch.ones(100))


def test_live_store_in_another_process_is_not_touched(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            """
            import sys, torch
            from tierzero.swap import SwapStore
            with SwapStore(sys.argv[1]) as s:
                s.write("k", torch.zeros(1000)).wait()
                print(s.path, flush=True)
                sys.stdin.readline()
                assert torch.equal(s.read("k").wait(), torch.zeros(1000))
                print("ok", flush=True)
            """), str(tmp_path)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    other = Path(proc.stdout.readline().strip())
    assert clean_stale(tmp_path / SUBDIR) == []
    with SwapStore(tmp_path):
        assert other.exists()
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "ok"
    assert proc.wait(timeout=30) == 0


def test_orphan_data_file_without_lock_is_stale(tmp_path: Path) -> None:
    sub = tmp_path / SUBDIR
    sub.mkdir()
    orphan = sub / "swap-1-deadbeef.scratch.swp"
    orphan.write_bytes(b"x" * 10)
    unrelated = sub / "notes.txt"  # not ours by name: never removed
    unrelated.write_text("keep")
    removed = clean_stale(sub)
    assert removed == [orphan] and unrelated.exists()
    os.remove(unrelated)


def test_forked_child_exit_does_not_remove_parent_files(tmp_path: Path) -> None:
    with SwapStore(tmp_path) as s:
        s.write("k", torch.ones(100)).wait()
        pid = os.fork()
        if pid == 0:  # child: a normal exit runs atexit handlers (finalizers)
            import atexit

            atexit._run_exitfuncs()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert status == 0
        assert Path(s.path).exists()
        assert torch.equal(s.read("k").wait(), torch.ones(100))
