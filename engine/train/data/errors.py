"""The data pipeline's one error type."""

from __future__ import annotations


class DataError(ValueError):
    """A dataset, row or tokenizer that cannot be used; the message names the file (and
    line or row) and what is allowed."""
