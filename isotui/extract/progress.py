"""Progress events that extraction posts to whoever runs it (rich bar headless, TUI jobs pane)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PHASES = ("resolving", "loading", "tokenising", "running", "finalising", "writing")


@dataclass(frozen=True)
class Progress:
    """Where a job stands. ``message`` carries one-off news (e.g. an out-of-memory back-off).

    ``stage``: ``prepare`` (resolving, loading, tokenising), ``extract`` (the forward passes),
    ``finalize``, ``write``, or ``oom`` for a back-off message.
    ``phase`` (one of :data:`PHASES`; empty from producers that do not say) tells what the job is
    doing, so no display shows ``0/None samples`` while a model loads or sits at 100% while the
    metrics are finalised; ``detail`` adds what is known (the model's size while loading);
    ``layers_done/layers_total`` count finalised layers; ``finalize_left_s`` estimates the
    finalisation still to come, so :attr:`eta_s` covers it.
    """

    samples_done: int
    samples_total: int
    tokens_done: int
    elapsed_s: float
    message: str | None = None
    stage: str = "extract"
    memory_bytes: int = 0  # GPU memory allocated, or the process's RSS on CPU
    phase: str = ""
    detail: str = ""
    layers_done: int = 0
    layers_total: int = 0
    finalize_left_s: float | None = None

    @property
    def eta_s(self) -> float | None:
        """Seconds left: the forward passes at the rate so far plus the estimated finalisation;
        during finalisation, the finalisation left; None before the first batch."""
        if self.phase == "finalising":
            return self.finalize_left_s
        if self.samples_done <= 0 or self.elapsed_s <= 0 or self.samples_total <= 0:
            return None
        forward = self.elapsed_s * (self.samples_total - self.samples_done) / self.samples_done
        return forward + (self.finalize_left_s or 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def status(self) -> str:
        """What the job is doing, in words (every front end's bar shows this): the phase, and
        while running samples, tokens, rate, ETA."""
        if self.phase == "resolving":
            return f"resolving {self.detail}".strip()
        if self.phase == "loading":
            return f"loading the model ({self.detail})" if self.detail else "loading the model"
        if self.phase == "tokenising":
            return self.detail or "tokenising"
        if self.phase == "finalising":
            layer = f"layer {self.layers_done + 1}/{self.layers_total}"
            return f"computing metrics: {layer}  ETA {clock(self.eta_s)}"
        if self.phase == "writing":
            return f"writing {self.detail}".strip()
        total = self.samples_total or "?"
        return (
            f"{self.samples_done}/{total} samples  {self.tokens_done:,} tokens  "
            f"{self.tokens_per_s:,.0f} tok/s  ETA {clock(self.eta_s)}"
        )


def clock(seconds: float | None) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour), ``-:--`` when unknown."""
    if seconds is None:
        return "-:--"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


ProgressCallback = Callable[[Progress], None]
StopCheck = Callable[[], bool]


def no_progress(_: Progress) -> None:
    """Default callback: report nothing."""


def never_stop() -> bool:
    """Default stop check: run to the end."""
    return False
