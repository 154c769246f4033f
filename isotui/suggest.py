"""Answers that guess right: the nearest of the names isotui knows to a name it does not
(``minlm`` -> ``minilm``, ``gtp2`` -> ``gpt2``, ``--max-sampels`` -> ``--max-samples``)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

CUTOFF = 0.7  # difflib's similarity ratio a guess needs: minlm/minilm 0.91, gtp2/gpt2 0.75


def nearest(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to ``word`` (case ignored), if any is close enough to be a typo of it."""
    by_lower: dict[str, str] = {}
    for choice in choices:
        by_lower.setdefault(choice.lower(), choice)
    found = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=CUTOFF)
    return by_lower[found[0]] if found else None


def did_you_mean(word: str, choices: Iterable[str], *, spell: str = "{}") -> str:
    """``"did you mean minilm?"`` (the nearest choice, written through ``spell``), or ``""``."""
    guess = nearest(word, choices)
    return f"did you mean {spell.format(guess)}?" if guess is not None else ""
