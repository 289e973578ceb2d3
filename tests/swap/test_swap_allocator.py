"""ExtentAllocator: best fit, coalescing, growth, misuse."""

from __future__ import annotations

import random

import pytest

from tierzero.swap.allocator import ExtentAllocator

P = 4096


def test_best_fit_and_coalescing() -> None:
    a = ExtentAllocator()
    a.grow(10 * P)
    offs = [a.alloc(P) for _ in range(10)]
    assert offs == [i * P for i in range(10)]
    assert a.alloc(1) is None and a.free_bytes == 0
    a.free(1 * P, P)
    a.free(5 * P, P)
    a.free(6 * P, P)  # coalesces with 5
    assert a.alloc(2 * P) == 5 * P  # only the 2-page hole fits
    assert a.alloc(P) == 1 * P
    for o in (0, 1, 2, 3, 4):
        a.free(o * P, P)
    assert a.alloc(5 * P) == 0  # 0..4 coalesced into one extent


def test_tail_growth_and_errors() -> None:
    a = ExtentAllocator()
    a.grow(4 * P)
    assert a.alloc(2 * P) == 0
    assert a.tail_free() == 2 * P
    a.grow(P)
    assert a.tail_free() == 3 * P and a.alloc(3 * P) == 2 * P
    with pytest.raises(ValueError, match="double free"):
        a.free(0, P)
        a.free(0, P)
    with pytest.raises(ValueError, match="outside"):
        a.free(100 * P, P)


def test_random_alloc_free_keeps_invariants() -> None:
    rng = random.Random(0)
    a = ExtentAllocator()
    a.grow(256 * P)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.5:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            size = rng.randrange(1, 8) * P
            off = a.alloc(size)
            if off is None:
                continue
            assert all(off + size <= o or o + s <= off for o, s in live.items())
            live[off] = size
        assert a.used == sum(live.values())
    for off, size in list(live.items()):
        a.free(off, size)
    assert a.used == 0 and a.alloc(256 * P) == 0
