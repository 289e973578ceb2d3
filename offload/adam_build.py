"""Build and load the C Adam kernel (`_adam_kernel.c`) at first use.

Why a C file compiled at first use (numbers in benchmarks/RESULTS.md, "CPU Adam"
and "Measurements behind design choices"):

- The step is memory-bandwidth bound. ``torch.optim.AdamW(fused=True)`` is
  already within a few percent of our kernel on plain fp32, and removing the
  sqrt and both divisions from our loop did not make it faster, so no kernel
  wins by arithmetic. It wins by bytes: the offloaded update (bf16 grad in,
  bf16 param out) is 28 B/param in one pass against 40 B for any PyTorch
  optimizer plus its two conversion passes.
- Plain C with ``-O3 -march=native`` auto-vectorises all nine dtype variants
  (gcc 12 reports every loop vectorised) and builds in seconds because it
  includes no torch headers; ``torch.utils.cpp_extension`` takes about a
  minute, and a build step at install time would make pip's build isolation
  fetch a CUDA torch. numba would add a heavy dependency for the same loop.
- Software prefetching (tried at 256, 1024 and 2048 elements ahead) and
  512-bit vectors (``-mprefer-vector-width=512``) made no measurable
  difference, so neither is used.

The shared object is cached per user, keyed by a hash of source, flags,
compiler and CPU, so a later run (or another process) loads it without
compiling. Loading a shared object runs its code as the caller, so the cache
is checked before anything in it is loaded:

[Note: kernel cache safety] The cache directory is created 0700 and used
only when it is a real directory (not a symlink) owned by the caller and not
writable by group or others; a cached file is loaded only when it is a
regular file owned by the caller, not group/world-writable, and its SHA-256
matches the one in its name (`tz_adam_<key>-<sha256 prefix>.so`, set when we
built it); it is opened with O_NOFOLLOW and loaded through that descriptor,
so what runs is what was checked. Anything else is ignored (with a warning)
and rebuilt, or, when the directory itself fails the check, the PyTorch path
is used with the reason logged.

When no compiler exists or the build fails, ``compiled_kernel()`` returns None
and logs the reason once; callers then use the pure-PyTorch path, which gives
the same numbers more slowly.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .state_codec import BLOCK as STATE_BLOCK

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_adam_kernel.c")
ABI_VERSION = 5
# -ffp-contract=off: see [Note: Adam operation order] in _adam_kernel.c.
# -fno-math-errno lets sqrtf vectorise; it does not change any result.
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=c11")
# Tried in order: tuned for this CPU, then portable (e.g. a compiler without -march=native).
ARCH_FLAGS: tuple[tuple[str, ...], ...] = (("-march=native",), ())
ENV_CACHE = "TIERZERO_CACHE_DIR"
ENV_DISABLE = "TIERZERO_ADAM_KERNEL"  # "torch": never compile, use the PyTorch path


class HyperParams(ctypes.Structure):
    """Mirror of `tz_adam_hp` in _adam_kernel.c (field order matters)."""

    _fields_ = [
        ("grad_scale", ctypes.c_float),
        ("decay", ctypes.c_float),
        ("wd", ctypes.c_float),
        ("w", ctypes.c_float),
        ("w_coeff", ctypes.c_float),
        ("w_small", ctypes.c_int),
        ("beta2", ctypes.c_float),
        ("one_minus_beta2", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("neg_step_size", ctypes.c_float),
        ("decoupled", ctypes.c_int),
        ("apply_decay", ctypes.c_int),
        ("apply_scale", ctypes.c_int),
    ]


@dataclass(frozen=True)
class CompiledKernel:
    """The loaded shared object and the entry points tierzero calls."""

    path: Path  # the cached .so
    step: Callable[..., int]  # tz_adam_step(p, m, v, g, gkind, out, okind, lo, hi, hp*)
    to_16: Callable[..., int]  # tz_f32_to_16(src, dst, okind, lo, hi)
    # tz_adam_step_q(p, m, ms, v, vs, g, gkind, out, okind, skind, lo, hi, hp*, seed, base):
    # compressed moments (offload/state_codec.py)
    step_q: Callable[..., int]
    # tz_adam_step_b(p16, m, ms, v, vs, g, gkind, skind, lo, hi, hp*, seed, base, key_p):
    # a bf16 master rounded stochastically (offload/bf16_master.py)
    step_b: Callable[..., int]


_lock = threading.Lock()
_loaded: dict[str, CompiledKernel | None] = {}  # memo of the one load attempt per process
_reason: dict[str, str] = {}


def cache_dir() -> Path:
    """Per-user cache directory for built kernels.

    $TIERZERO_CACHE_DIR/adam, else $XDG_CACHE_HOME/tierzero/adam, else ~/.cache/tierzero/adam.
    """
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env) / "adam"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "tierzero" / "adam"


def _cpu_signature() -> str:
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    text += line
                if line.strip() == "":
                    break  # first processor is enough
    except OSError:
        pass
    return text


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _compiler_version(cc: str) -> str:
    try:
        out = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


def _file_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _prepare_cache_dir(directory: Path) -> str | None:
    """Create `directory` 0700 if missing; None when it is safe to load code from, else why not.

    See [Note: kernel cache safety].
    """
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
        st = os.lstat(directory)
    except OSError as exc:
        return f"cache directory {directory} is not writable ({exc}); set ${ENV_CACHE}"
    fix = f"set ${ENV_CACHE} to a directory of your own"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"cache directory {directory} is a symbolic link or not a directory; {fix}"
    if st.st_uid != os.geteuid():
        return (f"cache directory {directory} belongs to uid {st.st_uid}, not to you "
                f"(uid {os.geteuid()}); tierzero loads compiled code only from your own; {fix}")
    if st.st_mode & 0o022:
        return (f"cache directory {directory} is writable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}); tierzero loads compiled code only from a "
                f"directory only you can write: chmod go-w it, or {fix}")
    return None


def _open_checked(path: Path) -> tuple[int | None, str]:
    """(fd, "") of a cached kernel that passes [Note: kernel cache safety], else (None, why)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        return None, f"cannot open it ({exc})"
    st = os.fstat(fd)
    why = ""
    if not stat.S_ISREG(st.st_mode):
        why = "not a regular file"
    elif st.st_uid != os.geteuid():
        why = f"owned by uid {st.st_uid}, not by you"
    elif st.st_mode & 0o022:
        why = f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    else:
        with os.fdopen(os.dup(fd), "rb") as f:
            digest = _file_digest(f.read())
        if not path.stem.endswith("-" + digest):
            why = f"its SHA-256 ({digest}) is not the one in its name"
    if why:
        os.close(fd)
        return None, why
    return fd, ""


def _load_cached(directory: Path, key: str) -> CompiledKernel | None:
    """The cached kernel for `key` that passes every check, or None; bad copies are logged
    (and removed when they are ours, so the rebuild replaces them)."""
    try:
        names = sorted(n for n in os.listdir(directory)
                       if n.startswith(f"tz_adam_{key}-") and n.endswith(".so"))
    except OSError:
        return None
    for name in names:
        path = directory / name
        fd, why = _open_checked(path)
        if fd is None:
            logger.warning("ignoring cached CPU Adam kernel %s: %s", path, why)
            with contextlib.suppress(OSError):
                if os.lstat(path).st_uid == os.geteuid():
                    path.unlink()
            continue
        try:
            return _load(path, fd)
        except OSError as exc:
            logger.warning("ignoring cached CPU Adam kernel %s: load failed: %s", path, exc)
        finally:
            os.close(fd)
    return None


def _build(cc: str, flags: tuple[str, ...], directory: Path, key: str) -> tuple[Path | None, str]:
    """Compile into `directory` atomically; return (the built file, "") or (None, the error)."""
    try:
        fd, tmp_name = tempfile.mkstemp(suffix=".so", dir=directory)  # 0600, O_EXCL
        os.close(fd)
    except OSError as exc:
        return None, f"cache directory {directory} is not writable ({exc}); set ${ENV_CACHE}"
    tmp = Path(tmp_name)
    try:
        proc = subprocess.run(
            [cc, *flags, str(SOURCE), "-o", str(tmp), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            return None, f"{cc} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"
        os.chmod(tmp, 0o600)  # the linker may have recreated it with the umask's mode
        target = directory / f"tz_adam_{key}-{_file_digest(tmp.read_bytes())}.so"
        os.replace(tmp, target)  # atomic: a concurrent process sees all or nothing
        return target, ""
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{cc} could not run: {exc}"
    finally:
        tmp.unlink(missing_ok=True)


# Descriptors that libraries were loaded through, kept open for the process's life: the
# dynamic loader knows a library by the name it was opened under and hands back the one
# already loaded under that name, so a second kernel opened through a reused
# /proc/self/fd/N (a rebuilt kernel after a cached one failed its checks; a benchmark's
# baseline beside the package's own) would silently run the first one.
_held_fds: list[int] = []


def _dlopen(path: Path, fd: int) -> ctypes.CDLL:
    """The library in the file open as `fd` (through /proc/self/fd where it exists, so the
    code that runs is the code that was checked; a duplicate of `fd` that is never closed,
    so the name is never reused), else by `path`. CDLL: calls release the GIL."""
    held = os.dup(fd)
    by_fd = f"/proc/self/fd/{held}"
    if not os.path.exists(by_fd):
        os.close(held)
        return ctypes.CDLL(str(path))
    _held_fds.append(held)
    return ctypes.CDLL(by_fd)


def _load(path: Path, fd: int) -> CompiledKernel:
    """Load the checked file open as `fd` (_dlopen); `path` names it in messages."""
    lib = _dlopen(path, fd)
    if lib.tz_adam_abi_version() != ABI_VERSION:
        raise OSError(f"{path} has ABI {lib.tz_adam_abi_version()}, expected {ABI_VERSION}")
    step = lib.tz_adam_step
    step.restype = ctypes.c_int
    step.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
        ctypes.POINTER(HyperParams),
    ]
    to_16 = lib.tz_f32_to_16
    to_16.restype = ctypes.c_int
    to_16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                      ctypes.c_int64]
    step_q = lib.tz_adam_step_q
    step_q.restype = ctypes.c_int
    step_q.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(HyperParams), ctypes.c_uint32,
        ctypes.c_int64,
    ]
    step_b = lib.tz_adam_step_b
    step_b.restype = ctypes.c_int
    step_b.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
        ctypes.POINTER(HyperParams), ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint32,
    ]
    if lib.tz_state_block() != STATE_BLOCK:
        raise OSError(f"{path} has state block {lib.tz_state_block()}, expected {STATE_BLOCK}")
    return CompiledKernel(path=path, step=step, to_16=to_16, step_q=step_q, step_b=step_b)


def _try_compile() -> tuple[CompiledKernel | None, str]:
    if os.environ.get(ENV_DISABLE, "").lower() == "torch":
        return None, f"${ENV_DISABLE}=torch"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set $CC, or install gcc/clang)"
    source = SOURCE.read_bytes()
    version = _compiler_version(cc)
    directory = cache_dir()
    unsafe = _prepare_cache_dir(directory)
    if unsafe is not None:
        return None, unsafe
    errors: list[str] = []
    for arch in ARCH_FLAGS:
        flags = BASE_FLAGS + arch
        key = hashlib.sha256(
            b"\0".join([source, " ".join(flags).encode(), version.encode(),
                        _cpu_signature().encode()])
        ).hexdigest()[:20]
        kernel = _load_cached(directory, key)
        if kernel is not None:
            return kernel, f"compiled kernel {kernel.path}"
        target, err = _build(cc, flags, directory, key)
        if target is None:
            errors.append(f"[{' '.join(flags)}] {err}")
            continue
        logger.info("built CPU Adam kernel %s with %s", target, version)
        kernel = _load_cached(directory, key)
        if kernel is not None:
            return kernel, f"compiled kernel {kernel.path}"
        errors.append(f"[{' '.join(flags)}] load of {target} failed (see the warning above)")
    return None, "C kernel build failed: " + " | ".join(errors)


def compiled_kernel() -> CompiledKernel | None:
    """The compiled kernel, building it on first call; None (logged once) when unavailable."""
    with _lock:
        if "kernel" not in _loaded:
            kernel, reason = _try_compile()
            _loaded["kernel"] = kernel
            _reason["kernel"] = reason
            if kernel is None:
                logger.warning("CPU Adam falls back to the pure-PyTorch path: %s", reason)
        return _loaded["kernel"]


def kernel_status() -> str:
    """One line: which Adam implementation this process uses and why."""
    compiled_kernel()
    return _reason["kernel"]
