"""Progress events that extraction posts to whoever runs it (rich bar headless, TUI jobs pane)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """Where a job stands. ``message`` carries one-off news (e.g. an out-of-memory back-off)."""

    samples_done: int
    samples_total: int
    tokens_done: int
    elapsed_s: float
    message: str | None = None
    stage: str = "extract"
    memory_bytes: int = 0  # GPU memory allocated, or the process's RSS on CPU

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far; None before the first batch."""
        if self.samples_done <= 0 or self.elapsed_s <= 0 or self.samples_total <= 0:
            return None
        return self.elapsed_s * (self.samples_total - self.samples_done) / self.samples_done

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_done / self.elapsed_s if self.elapsed_s > 0 else 0.0


ProgressCallback = Callable[[Progress], None]
StopCheck = Callable[[], bool]


def no_progress(_: Progress) -> None:
    """Default callback: report nothing."""


def never_stop() -> bool:
    """Default stop check: run to the end."""
    return False
