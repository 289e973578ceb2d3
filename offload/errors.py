"""Errors raised by the tier manager. Every message names the shard, tier or
setting involved, the value seen, and what would fix it."""

from __future__ import annotations


class OffloadError(RuntimeError):
    """Base class: misuse of the tier manager or a broken invariant."""


class PlanError(OffloadError):
    """A placement cannot fit its budgets; raised before anything is allocated."""


class BudgetError(OffloadError):
    """A request cannot be satisfied within a tier's budget."""


class TransferError(OffloadError):
    """An asynchronous copy or swap transfer failed; the cause is chained."""
