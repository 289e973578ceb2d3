"""SwapStore against a dict model: random programs of writes, reads, deletes and waits."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierzero.swap import SwapError, SwapFuture, SwapStore

KEYS = ["a", "b", "c"]
DTYPES = [torch.uint8, torch.float16, torch.float32, torch.int64]

def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN bit patterns included), dtype and shape too."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


op = st.one_of(
    st.tuples(st.just("write"), st.sampled_from(KEYS), st.sampled_from(DTYPES),
              st.integers(0, 20_000), st.integers(0, 255)),
    st.tuples(st.just("read"), st.sampled_from(KEYS)),
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    st.tuples(st.just("wait_all")),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(op, max_size=40), block_kib=st.sampled_from([4, 8, 64]))
def test_store_behaves_like_a_dict(program: list[tuple[object, ...]], block_kib: int) -> None:
    model: dict[str, torch.Tensor] = {}
    checks: list[tuple[SwapFuture, torch.Tensor]] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d, \
            SwapStore(Path(d), block_size=block_kib << 10, threads=3, queue_depth=2,
                      verify=True) as s:
        for step in program:
            if step[0] == "write":
                _, key, dtype, n, fill = step
                assert isinstance(key, str) and isinstance(dtype, torch.dtype)
                t = torch.full((int(n),), int(fill), dtype=torch.uint8).view(torch.uint8)
                t = t[: int(n) - int(n) % dtype.itemsize].view(dtype)  # type: ignore[union-attr]
                s.write(key, t)  # caller never mutates t afterwards: no wait needed
                model[key] = t
            elif step[0] == "read":
                key = str(step[1])
                if key in model:
                    checks.append((s.read(key), model[key]))
                else:
                    try:
                        s.read(key)
                    except SwapError as exc:
                        assert "unknown key" in str(exc)
                    else:
                        raise AssertionError(f"read of missing {key!r} did not raise")
            elif step[0] == "delete":
                key = str(step[1])
                if key in model:
                    s.delete(key)
                    del model[key]
                else:
                    try:
                        s.delete(key)
                    except SwapError:
                        pass
                    else:
                        raise AssertionError(f"delete of missing {key!r} did not raise")
            else:
                for fut, want in checks:
                    assert same(fut.wait(), want)
                checks.clear()
        for fut, want in checks:
            got = fut.wait()
            assert same(got, want)
        for key, want in model.items():
            assert same(s.read(key).wait(), want)
        assert sorted(s.keys()) == sorted(model)
        stats = s.stats()
        assert stats.write.failed == 0 and stats.read.failed == 0
        assert stats.used_bytes == sum(4096 + -(-w.nbytes // 4096) * 4096 for w in model.values())
