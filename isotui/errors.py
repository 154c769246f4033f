"""Errors a user can act on: each carries one sentence that says what is wrong and what to do."""

from __future__ import annotations


class IsotuiError(Exception):
    """A bad input or an environment problem, reported as one sentence (never a traceback)."""


class NoHeadError(IsotuiError):
    """A model with no trained language-model head, so no loss: an experiment that can measure
    without a loss (ablate) goes on without one and says so; the others refuse."""


class Cancelled(Exception):
    """Raised between batches when the caller asked the job to stop."""
