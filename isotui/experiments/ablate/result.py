"""ablate's result: one row per (site, removal), the curves of every layer after each edit, and
its cache entry (JSON only) and ``--csv``/``--json`` forms."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TypedDict, cast

from isotui.experiments.base import Arrays, Payload, Rows
from isotui.experiments.json_types import from_fields


@dataclass
class AblationRow:
    """One (site, removal): the ``--csv`` row. Losses are per predicted token (nan: the model has
    no LM head); ``final_change`` is the mean ``1 - cos`` of the kept tokens' last hidden state,
    clean against edited; ``*_random``: the same edit along random directions of the same size;
    ``recovery``: the last layer's avg_cos after the edit over its clean avg_cos."""

    model: str
    site: str
    remove: str
    loss: float
    loss_ablated: float
    delta_loss: float
    final_change: float
    loss_random: float
    delta_loss_random: float
    final_change_random: float
    recovery: float
    layer: int  # the hidden state the site gives (a block's input or output), else -1
    removed: float  # its size: the mean's norm, K directions, or the count of coordinates


@dataclass
class AblationCurves:
    """Every hidden state's avg_cos and drift (the mean's norm) after one row's edit, and after
    its random baseline (layer 0: the embeddings)."""

    avg_cos: list[float]
    drift_norm: list[float]
    avg_cos_random: list[float]
    drift_norm_random: list[float]
    dims: list[int] = field(default_factory=list)  # rogue/dims: the coordinates set to their mean


class AblationMeta(TypedDict, total=False):
    data: str
    n_samples: int
    n_tokens: int  # kept tokens (the final change and curves are over them)
    loss_tokens: int  # predicted tokens (the losses are over them)
    lm_class: str
    special_tokens: str
    dtype: str
    seed: int
    forwards: int  # forward passes per batch in the edited pass (1 + 2 per row measured now)
    seconds: float


@dataclass
class AblationResult:
    model: str
    objective: str  # causal, masked, or none (no LM head)
    rows: list[AblationRow]
    curves: list[AblationCurves]  # one per row
    avg_cos: list[float]  # the clean model's, per hidden state
    drift_norm: list[float]
    notes: list[str] = field(default_factory=list)
    meta: AblationMeta = field(default_factory=lambda: AblationMeta())
    from_cache: bool = False

    def to_payload(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items() if k != "from_cache"}

    def one(self, i: int) -> AblationResult:
        """Row ``i`` alone, with the clean curves, notes and meta: its cache entry of its own."""
        return AblationResult(
            self.model,
            self.objective,
            [self.rows[i]],
            [self.curves[i]],
            self.avg_cos,
            self.drift_norm,
            self.notes,
            self.meta,
            self.from_cache,
        )


class AblationEntry(TypedDict):
    """A cache entry's payload: an AblationResult's fields."""

    model: str
    objective: str
    rows: list[dict[str, object]]
    curves: list[dict[str, object]]
    avg_cos: list[float]
    drift_norm: list[float]
    notes: list[str]
    meta: dict[str, object]


def from_payload(payload: Mapping[str, object], _arrays: Arrays) -> AblationResult:
    """The result a cache entry holds (:meth:`AblationResult.to_payload`)."""
    entry = cast("AblationEntry", payload)  # the cache checked its schema
    return AblationResult(
        entry["model"],
        entry["objective"],
        [from_fields(AblationRow, r) for r in entry["rows"]],
        [from_fields(AblationCurves, c) for c in entry["curves"]],
        [float(v) for v in entry["avg_cos"]],
        [float(v) for v in entry["drift_norm"]],
        list(entry["notes"]),
        cast("AblationMeta", dict(entry["meta"])),
    )


CSV_COLUMNS = tuple(f.name for f in fields(AblationRow))


def _middle(name: str, width: int) -> str:
    """A long name keeps its start and its end (``transf…h.11``), as every table shortens."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return name[:head] + "…" + name[-(width - 1 - head) :]


def site_names(sites: list[str], width: int, *, shared: bool = True) -> dict[str, str]:
    """Each site's name as the views show it in ``width`` characters: shortened in its middle;
    where that leaves two sites alike (``norm_in``'s modules, ``mlp_out``'s), or ``shared`` is
    False, the part of their dotted names every site shares is dropped first, so each row says
    which site it is."""
    unique = list(dict.fromkeys(sites))
    short = {s: _middle(s, width) for s in unique}
    if len(unique) < 2 or (shared and len(set(short.values())) == len(unique)):
        return short
    parts = [s.split(".") for s in unique]
    common = 0  # the dotted parts every name shares, each name keeping at least its last
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return {s: _middle(".".join(p[common:]), width) for s, p in zip(unique, parts, strict=True)}


def csv_rows(results: list[AblationResult]) -> Rows:
    """``--csv``: one row per model, site and removal."""
    return [asdict(r) for res in results for r in res.rows]


def json_payload(results: list[AblationResult]) -> Payload:
    """``--json``: each result's fields (rows, curves, the clean curves, notes, meta)."""
    return {"results": [r.to_payload() for r in results]}
