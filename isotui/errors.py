"""Errors a user can act on: each carries one sentence that says what is wrong and what to do."""

from __future__ import annotations


class IsotuiError(Exception):
    """A bad input or an environment problem, reported as one sentence (never a traceback)."""


class Cancelled(Exception):
    """Raised between batches when the caller asked the job to stop."""
