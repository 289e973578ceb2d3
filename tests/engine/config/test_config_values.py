"""Leaf value coercion: byte sizes, numbers, booleans, paths."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierzero import engine
from tierzero.engine.config import values

BYTES = {"unit": "bytes", "ge": 0}


@pytest.mark.parametrize(("raw", "expected"), [
    (0, 0), (4096, 4096), (1e9, 10**9), (5e8, 500_000_000), ("5e8", 500_000_000),
    ("1000", 1000), ("512MiB", 512 << 20), ("512mib", 512 << 20), ("2GB", 2 * 10**9),
    ("1.5GiB", 3 << 29), ("64 KiB", 64 << 10), ("1TB", 10**12), ("3TiB", 3 << 40),
    ("7B", 7), ("1kb", 1000),
])
def test_byte_sizes(raw: Any, expected: int) -> None:
    assert values.coerce(raw, int, BYTES, "k") == expected


@pytest.mark.parametrize(("raw", "why"), [
    (1.5, "not a whole number of bytes"), ("1.5B", "not a whole number of bytes"),
    ("12XB", "unknown unit"), ("5 M", "unknown unit"), ("lots", "allowed: a byte size"),
    (True, "allowed: a byte size"), ([1], "allowed: a byte size"), (-1, "out of range"),
    ("-5MiB", "allowed: a byte size"), (float("inf"), "not a whole number"),
])
def test_bad_byte_sizes(raw: Any, why: str) -> None:
    with pytest.raises(engine.ConfigError) as err:
        values.coerce(raw, int, BYTES, "zero.prefetch_bytes")
    assert str(err.value).startswith("zero.prefetch_bytes: ")
    assert why in str(err.value)
    assert repr(raw) in str(err.value)


@pytest.mark.parametrize(("raw", "expected"), [(3, 3), (3.0, 3), ("3", 3), ("1e3", 1000)])
def test_ints(raw: Any, expected: int) -> None:
    assert values.coerce(raw, int, {}, "k") == expected


@pytest.mark.parametrize("raw", [3.5, "3.5", True, "three", None, [3]])
def test_bad_ints(raw: Any) -> None:
    with pytest.raises(engine.ConfigError, match="allowed: an integer"):
        values.coerce(raw, int, {}, "k")


@pytest.mark.parametrize(("raw", "expected"), [(True, True), ("false", False), ("TRUE", True)])
def test_bools(raw: Any, expected: bool) -> None:
    assert values.coerce(raw, bool, {}, "k") is expected


@pytest.mark.parametrize("raw", [1, 0, "yes", None])
def test_bad_bools(raw: Any) -> None:
    with pytest.raises(engine.ConfigError, match="allowed: true or false"):
        values.coerce(raw, bool, {}, "k")


def test_path_expands_env_and_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ_TEST_DIR", "/data/nvme0")
    monkeypatch.setenv("HOME", "/home/someone")
    meta = {"path": True}
    assert values.coerce("$TZ_TEST_DIR/swap", str, meta, "k") == "/data/nvme0/swap"
    assert values.coerce("${TZ_TEST_DIR}/x", str, meta, "k") == "/data/nvme0/x"
    assert values.coerce("~/swap", str, meta, "k") == "/home/someone/swap"


def test_path_with_unset_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TZ_UNSET_VAR", raising=False)
    with pytest.raises(engine.ConfigError) as err:
        values.coerce("$TZ_UNSET_VAR/swap", str, {"path": True}, "offload.params.path")
    assert "offload.params.path" in str(err.value)
    assert "unset environment variable $TZ_UNSET_VAR" in str(err.value)


def test_did_you_mean() -> None:
    assert values.did_you_mean("stag", ["stage", "units"]) == " (did you mean 'stage'?)"
    assert values.did_you_mean("zzzz", ["stage", "units"]) == ""


@given(st.integers(min_value=0, max_value=10**6),
       st.sampled_from(["", "B", "KB", "MB", "GB", "KiB", "MiB", "GiB", "kib", "gb"]))
def test_byte_size_strings_property(number: int, unit: str) -> None:
    multiple = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10,
                "mib": 1 << 20, "gib": 1 << 30}[unit.lower()]
    assert values.coerce(f"{number}{unit}", int, BYTES, "k") == number * multiple
    assert values.coerce(f"{number} {unit}".strip(), int, BYTES, "k") == number * multiple
