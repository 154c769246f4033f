"""Checkpoint series picked from a model's branches, and checkpoints that are not what they say.

Selectors in ``--checkpoints`` (wherever a series is accepted: ``isotui experiment checkpoints``
and ``qk-dynamics``, ``isotui figure machina2024-*``, the app's Dynamics and Checkpoints boxes,
``isotui sweep``'s ``checkpoints`` key) pick among the branches of ``--model`` whose names carry a
training step (Pythia ``step1000``, MultiBERTs-style ``step_20k``), ordered by step:

- ``all``: every one;
- ``every:N`` (``every:10k``): those whose step is a multiple of N, step 0 included. On Pythia's
  schedule (0, 1, 2, 4 ... 512, then every 1000 up to 143000) ``every:1000`` gives the 144
  thousands and drops the log-spaced early steps; ``step0..step512`` gives those;
- ``stepA..stepB`` (or ``A..B``; either end may be left open): those with A <= step <= B.

Selectors and revisions combine (a union, ordered by step). ``--model`` may also be a folder of
checkpoint folders (``isotui train-tiny`` output): its sub-folders are the branches.

Before anything is downloaded, a checkpoint whose weight files have the same contents (LFS
sha256) as another checkpoint of the series, or as the model's last step, gets ``duplicate_of``:
the label of the latest step with those weights, taken as the genuine one (EleutherAI/pythia
#205: the wrong branches serve the final weights).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from isotui.errors import IsotuiError
from isotui.experiments.checkpoint import Checkpoint, series_folder, step_of

if TYPE_CHECKING:
    from isotui.models.branches import Weights

Notice = Callable[[str], None]
_STEP_TEXT = r"(?:step[_-]?)?\d+k?"
_RANGE = re.compile(rf"^({_STEP_TEXT})?\.\.({_STEP_TEXT})?$", re.IGNORECASE)
_EVERY = re.compile(r"^every:(.*)$", re.IGNORECASE)
_LISTED = 6  # duplicates named in the notice


@dataclass(frozen=True)
class Selector:
    """``all``, ``every:N`` or ``A..B``: which of the model's steps to keep."""

    text: str
    kind: Literal["all", "every", "range"]
    every: int = 1
    low: int | None = None
    high: int | None = None

    def keeps(self, step: int) -> bool:
        if self.kind == "every":
            return step % self.every == 0
        if self.kind == "range":
            return (self.low is None or step >= self.low) and (self.high is None or step <= self.high)
        return True


def _number(text: str) -> int:
    """``1000``, ``10k``, ``step1000``, ``step_20k`` -> the step."""
    step = step_of(text) if text.lower().startswith("step") else None
    if step is not None:
        return step
    return int(text[:-1]) * 1000 if text.lower().endswith("k") else int(text)


def parse_selector(item: str, flag: str = "--checkpoints") -> Selector | None:
    """The selector ``item`` is, or None (a revision, model id or folder: an existing folder
    named like a selector is a folder); a bad one is one sentence naming ``flag``."""
    if Path(item).expanduser().exists():
        return None
    if item.lower() == "all":
        return Selector(item, "all")
    every = _EVERY.match(item)
    if every:
        value = every.group(1)
        if not re.fullmatch(r"\d+k?", value, re.IGNORECASE) or _number(value) == 0:
            raise IsotuiError(
                f"{flag} {item}: N must be a positive number of steps, e.g. every:1000 or every:10k"
            )
        return Selector(item, "every", every=_number(value))
    span = _RANGE.match(item)
    if span:
        low = _number(span.group(1)) if span.group(1) else None
        high = _number(span.group(2)) if span.group(2) else None
        if low is not None and high is not None and low > high:
            raise IsotuiError(
                f"{flag} {item}: the range runs backwards (step {low} after step {high}); give stepA..stepB "
                "with A <= B"
            )
        return Selector(item, "range", low=low, high=high)
    return None


def available(model: str | None, selector: Selector, flag: str, notice: Notice | None) -> list[Checkpoint]:
    """The checkpoints a selector picks among: the branches of hub model ``model`` whose names
    carry a step (or the step folders of a series folder), ordered by step."""
    from isotui.models.naming import parse_model

    if model is None:
        raise IsotuiError(
            f"{flag} {selector.text} picks among the branches of --model: give the hub model, e.g. "
            f"-m EleutherAI/pythia-160m -c {selector.text}"
        )
    path = Path(model).expanduser()
    if path.is_dir():
        found = series_folder(path) if not (path / "config.json").is_file() else []
        steps = [(p, step_of(p.name)) for p in found]
        out = [Checkpoint(str(p), p.name, s) for p, s in steps if s is not None]
        if not out:
            raise IsotuiError(
                f"{flag} {selector.text} picks among the branches of a hub model, and --model {model} is a "
                "local folder with no branches (no checkpoint folders named by step); give a hub id, or the "
                "checkpoint folders themselves"
            )
        return out
    ref = parse_model(model)
    if ref.kind != "hub" or ref.revision is not None:
        raise IsotuiError(
            f"{flag} {selector.text} picks among the branches of a hub model; --model {model} is not one "
            "(give its id without @revision, e.g. EleutherAI/pythia-160m)"
        )
    from isotui.models.branches import list_refs

    refs = list_refs(ref.source, flag, notice)
    out = [Checkpoint(f"{ref.source}@{r.name}", r.name, step_of(r.name)) for r in refs]
    out = sorted((c for c in out if c.step is not None), key=lambda c: (c.step, c.label))
    if not out:
        names = ", ".join(r.name for r in refs[:8]) or "none"
        raise IsotuiError(
            f"{flag} {selector.text}: {ref.source} has no branch named by a training step (its branches: "
            f"{names}); name its revisions instead"
        )
    return out


def pick(branches: list[Checkpoint], selector: Selector, model: str, flag: str) -> list[Checkpoint]:
    """The branches ``selector`` keeps, in step order; none is one sentence."""
    kept = [c for c in branches if c.step is not None and selector.keeps(c.step)]
    if not kept:
        steps = [c.step for c in branches if c.step is not None]
        raise IsotuiError(
            f"{flag} {selector.text} matches no branch of {model} (its {len(steps)} steps run from "
            f"{min(steps)} to {max(steps)})"
        )
    return kept


def union(checkpoints: list[Checkpoint]) -> list[Checkpoint]:
    """Each checkpoint once, ordered by step (checkpoints without a step last, as given)."""
    once = list({c.model: c for c in reversed(checkpoints)}.values())[::-1]
    return sorted(once, key=lambda c: (c.step is None, c.step or 0))


# --- duplicate weights ---------------------------------------------------------------------------


def _hub_revision(model: str) -> tuple[str, str] | None:
    """(repo id, revision) of a hub checkpoint, else None (a folder, random:, minilm...)."""
    from isotui.models.naming import parse_model

    if Path(model).expanduser().exists():
        return None
    try:
        ref = parse_model(model)
    except IsotuiError:
        return None
    return (ref.source, ref.revision or "main") if ref.kind == "hub" else None


def _last_step(model: str | None, branches: list[Checkpoint] | None) -> Checkpoint | None:
    """The model's last step branch (the reference for weights served under other names), from
    the branches already listed or listed now; None when it cannot be told."""
    if model is None or _hub_revision(model) is None or "@" in model:
        return None
    if branches is None:
        from isotui.models.branches import list_refs

        try:
            refs = list_refs(model, "--checkpoints")
        except IsotuiError:  # not cached offline, not on the hub: loading says so
            return None
        branches = [Checkpoint(f"{model}@{r.name}", r.name, step_of(r.name)) for r in refs]
    stepped = [c for c in branches if c.step is not None]
    return max(stepped, key=lambda c: c.step or 0) if stepped else None


def _local_weights(checkpoints: list[Checkpoint]) -> dict[str, Weights]:
    """The weight files of the checkpoints that are local folders, as the hub's are compared:
    by file name and SHA-256 of the contents (another copy of the same weights is a duplicate)."""
    from isotui.models.branches import weight_format
    from isotui.models.naming import weight_digests

    out: dict[str, Weights] = {}
    for c in checkpoints:
        folder = Path(c.model).expanduser()
        if not folder.is_dir():
            continue
        try:
            files = weight_digests(folder)
        except OSError:  # unreadable: loading it says so in its own sentence
            continue
        found: dict[str, set[tuple[str, str]]] = {}
        for name, digest in files.items():
            fmt = weight_format(name)
            if fmt is not None:
                found.setdefault(fmt, set()).add((name, digest))
        if found:
            out[c.model] = {fmt: frozenset(v) for fmt, v in found.items()}
    return out


def flag_duplicates(
    checkpoints: list[Checkpoint],
    model: str | None,
    branches: list[Checkpoint] | None = None,
    notice: Notice | None = None,
) -> list[Checkpoint]:
    """The series with ``duplicate_of`` set on each checkpoint whose weight files have the same
    contents as another checkpoint's or the model's last step's: the latest step of those, taken
    as the genuine one. Hub checkpoints are compared from their listings or the hub cache (nothing
    downloaded), local folders by their files' SHA-256; one whose weights cannot be told is left
    as it is."""
    from isotui.models.branches import same_weights, weight_files

    pairs = {c.model: _hub_revision(c.model) for c in checkpoints}
    local = _local_weights(checkpoints)
    if not any(pairs.values()) and len(local) < 2:
        return checkpoints
    last = _last_step(model, branches) if any(pairs.values()) else None
    others = [last] if last is not None and last.model not in pairs else []
    for c in others:
        pairs[c.model] = _hub_revision(c.model)
    weights = weight_files([p for p in pairs.values() if p is not None], notice)
    found = {c: weights[p] for c, p in pairs.items() if p is not None and weights.get(p)} | local
    known = [  # a checkpoint with no weight file at its top level (an odd layout) is not compared
        (i, c, found[c.model]) for i, c in enumerate([*checkpoints, *others]) if c.model in found
    ]

    def order(entry: tuple[int, Checkpoint, Weights]) -> tuple[bool, int, int]:
        i, c, _w = entry
        return (c.step is not None, c.step or 0, i)

    out = list(checkpoints)
    for i, c, w in known:
        if i >= len(checkpoints):  # the last step: a reference, not in the series
            continue
        group = [e for e in known if same_weights(w, e[2])]
        genuine = max(group, key=order)[1]
        if genuine.model != c.model:
            out[i] = replace(c, duplicate_of=genuine.label)
    return out


def duplicates_said(checkpoints: list[Checkpoint], skipped: bool, skip_flag: str) -> str:
    """One sentence on the checkpoints flagged as duplicates (and whether they were left out)."""
    flagged = [c for c in checkpoints if c.duplicate_of]
    said = ", ".join(f"{c.label} = {c.duplicate_of}" for c in flagged[:_LISTED])
    more = f" and {len(flagged) - _LISTED} more" if len(flagged) > _LISTED else ""
    what = (
        f"{len(flagged)} of {len(checkpoints)} checkpoints serve the same weights as a later step, so they "
        f"are not what their names say ({said}{more})"
    )
    if skipped:
        return f"{what}; {skip_flag} left them out"
    return f"{what}; duplicate_of marks them in the table, CSV and JSON, and {skip_flag} leaves them out"
