"""swap.DrySwap: counts what a SwapStore would move, with the same per-key errors."""

from __future__ import annotations

import pytest
import torch

from tierzero.swap import DrySwap, SwapError


def test_counts_bytes_and_requests_on_meta() -> None:
    with DrySwap() as store:
        a = torch.empty(1000, dtype=torch.float32, device="meta")
        b = torch.empty(10, dtype=torch.bfloat16, device="meta")
        assert store.write("a", a).wait() is a  # completes at once, yields the tensor
        store.write("b", b).wait()
        store.write("a", a).wait()  # rewriting a key counts again
        out = torch.empty(1000, dtype=torch.float32, device="meta")
        assert store.read("a", out=out).done()
        s = store.stats()
        assert (s.write.requests, s.write.bytes) == (3, 2 * 4000 + 20)
        assert (s.read.requests, s.read.bytes) == (1, 4000)
        assert s.keys == 2 and s.used_bytes == 4020 and sorted(store.keys()) == ["a", "b"]
        store.delete("b")
        assert store.keys() == ["a"]


def test_same_errors_as_a_swap_store() -> None:
    store = DrySwap()
    store.write("k", torch.zeros(8))
    with pytest.raises(SwapError, match="unknown key"):
        store.read("nope", out=torch.empty(8))
    with pytest.raises(SwapError, match=r"read buffer is torch\.float16 of 16 bytes"):
        store.read("k", out=torch.empty(8, dtype=torch.float16))
    with pytest.raises(SwapError, match="only into a given buffer"):
        store.read("k")
    with pytest.raises(SwapError, match="cannot delete"):
        store.delete("nope")
    store.close()
    with pytest.raises(SwapError, match="closed"):
        store.write("k", torch.zeros(8))
