"""A do-nothing kernel over exactly Adam's memory streams: the bound of the access pattern.

`x.mul_(c)` (two streams over one array) is the simplest in-place stream; Adam
reads four arrays and writes three (plus a bf16 output), and DRAM serves such
a mix more slowly. This kernel touches the same bytes in the same pattern with
no arithmetic to speak of (p = p*s + g*z with s=1, z=0 passed at run time, so
values stay unchanged and the compiler cannot drop the work), so tierzero's
time divided by this one's is how close the Adam kernel is to the memory limit
of its own pattern. Built with the system cc like the kernel itself; skipped
(with the reason) when that fails.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from tierzero.offload import AdamThreads

SOURCE = r"""
#include <stdint.h>
#include <string.h>
/* plain: read p, m, v, g (fp32); write p, m, v.  28 B per element. */
void pattern_plain(float *restrict p, float *restrict m, float *restrict v,
                   const float *restrict g, float s, float z, int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
        float gi = g[i] * z;
        p[i] = p[i] * s + gi; m[i] = m[i] * s + gi; v[i] = v[i] * s + gi;
    }
}
/* offloaded: read p, m, v (fp32) + g (bf16); write p, m, v + o (bf16).  28 B per element. */
void pattern_offloaded(float *restrict p, float *restrict m, float *restrict v,
                       const uint16_t *restrict g, uint16_t *restrict o, float s, float z,
                       int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
        uint32_t u = (uint32_t)g[i] << 16; float gf; memcpy(&gf, &u, 4);
        float gi = gf * z, a = p[i] * s + gi;
        p[i] = a; m[i] = m[i] * s + gi; v[i] = v[i] * s + gi;
        uint32_t w; memcpy(&w, &a, 4); o[i] = (uint16_t)(w >> 16);
    }
}
"""


def load() -> tuple[ctypes.CDLL | None, str]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "pattern kernel skipped: no C compiler"
    work = Path(tempfile.mkdtemp(prefix="tz-pattern-"))
    src, lib = work / "pattern.c", work / "pattern.so"
    src.write_text(SOURCE)
    proc = subprocess.run([cc, "-O3", "-march=native", "-fPIC", "-shared", str(src), "-o",
                           str(lib)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return None, f"pattern kernel skipped: {cc} failed: {proc.stderr.strip()[-300:]}"
    so = ctypes.CDLL(str(lib))
    shutil.rmtree(work)  # the loaded library stays mapped
    f32, i64, ptr = ctypes.c_float, ctypes.c_int64, ctypes.c_void_p
    so.pattern_plain.argtypes = [ptr, ptr, ptr, ptr, f32, f32, i64, i64]
    so.pattern_offloaded.argtypes = [ptr, ptr, ptr, ptr, ptr, f32, f32, i64, i64]
    return so, "ok"


def pattern_methods(so: ctypes.CDLL, pool: AdamThreads, *, p: torch.Tensor, m: torch.Tensor,
                    v: torch.Tensor, g32: torch.Tensor, g16: torch.Tensor, p16: torch.Tensor
                    ) -> dict[str, Callable[[], None]]:
    """Steps over the given arrays (values left unchanged), split over the pool like Adam."""
    n = p.numel()
    ptrs = [t.data_ptr() for t in (p, m, v, g32, g16, p16)]

    def plain() -> None:
        pool.run(n, lambda lo, hi: so.pattern_plain(*ptrs[:4], 1.0, 0.0, lo, hi))

    def offloaded() -> None:
        pool.run(n, lambda lo, hi: so.pattern_offloaded(*ptrs[:3], ptrs[4], ptrs[5], 1.0, 0.0,
                                                        lo, hi))

    return {"pattern_plain": plain, "pattern_offloaded": offloaded}
