"""Exports of results: CSV (the per-layer table) and JSON (everything, incl. drift correlation)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from isotui.errors import IsotuiError
from isotui.results import SE_FIELDS, LayerRow, ModelResult
from isotui.store.files import write_output


def _atomic_write(path: Path, write) -> Path:
    """Write an export through :func:`isotui.store.files.write_output` (atomic for a regular
    file, written through for a device, FIFO or ``-``, a symlink's target replaced)."""
    return write_output(path, write)


# After the per-layer columns: what the run measured, so rows of different runs stay apart.
RUN_COLUMNS = ("data", "n_samples", "max_length", "special_tokens", "dtype", "run_key")


def _layer_columns() -> tuple[list[str], list[str]]:
    """The layer columns before the run's settings, and those after: every LayerRow field from
    the first standard error on came later than the run columns, so it is written after them
    (earlier columns keep their places; a metric added at the end of LayerRow lands last)."""
    names = LayerRow.columns()
    first_later = names.index(SE_FIELDS[0])
    return names[:first_later], names[first_later:]


def plugin_columns(results: Iterable[ModelResult]) -> list[str]:
    """The plug-in metrics' columns any of the results' rows hold, in the order first seen."""
    return list(dict.fromkeys(c for r in results for row in r.rows for c in row.extra))


def layer_csv_rows(results: Iterable[ModelResult]) -> list[dict]:
    """The rows of :func:`write_csv` as dicts, keys in column order: the layer metrics, the run's
    settings, the standard errors (added later, so earlier columns keep their places), then the
    plug-in metrics' columns (empty for a row without them: a result measured before)."""
    results = list(results)
    base, later = _layer_columns()
    extra = plugin_columns(results)
    out = []
    for r in results:
        run = {c: r.meta.get(c, "") for c in RUN_COLUMNS[:-1]} | {"run_key": r.key}
        for row in r.rows:
            d = row.as_dict()
            tail = {c: d.get(c, "") for c in extra}
            out.append({c: d[c] for c in base} | run | {c: d[c] for c in later} | tail)
    return out


def write_csv(results: Iterable[ModelResult], path: Path) -> Path:
    """One row per model, component and layer; columns as :meth:`LayerRow.columns`, then
    :data:`RUN_COLUMNS` from the run's metadata, then the standard errors (added later)."""
    results = list(results)
    rows = layer_csv_rows(results)

    def write(f) -> None:
        base, later = _layer_columns()
        writer = csv.DictWriter(f, fieldnames=[*base, *RUN_COLUMNS, *later, *plugin_columns(results)])
        writer.writeheader()
        writer.writerows(rows)

    return _atomic_write(path, write)


# JSON has no NaN nor infinity. NaN is written as null; an infinity as 1e999 (a JSON number that
# overflows to infinity in Python's json, JavaScript and most readers), never as null, which would
# read back as NaN: a plug-in's inf stays inf. Placeholders while encoding (no text holds them).
_INF = {1.0: "\u0000isotui:+inf\u0000", -1.0: "\u0000isotui:-inf\u0000"}


def _clean(value):
    """NaN as null, an infinity as a placeholder :func:`_dumps` writes as ``1e999``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else _INF[math.copysign(1.0, value)]
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _dumps(cleaned) -> str:
    """A :func:`_clean` payload as JSON text, its infinities written as ``1e999``/``-1e999``."""
    text = json.dumps(cleaned, indent=2)
    for sign, placeholder in _INF.items():
        text = text.replace(json.dumps(placeholder), "1e999" if sign > 0 else "-1e999")
    return text


def write_json(results: Iterable[ModelResult], path: Path) -> Path:
    """All results with their metadata and drift correlations (NaN written as null, an
    infinity as 1e999)."""
    payload = {"results": [_clean(r.to_json()) for r in results]}
    return _atomic_write(path, lambda f: f.write(_dumps(payload)))


def write_rows_csv(rows: Iterable, path: Path) -> Path:
    """An experiment's table (dataclass rows, columns in field order) as CSV."""
    return write_dicts_csv([asdict(row) for row in rows], path)


def write_dicts_csv(rows: list[dict], path: Path) -> Path:
    """Rows as dicts (columns: the first row's keys, in order) as CSV."""
    if not rows:
        raise IsotuiError(f"nothing to write to {path}: the table is empty")

    def write(f) -> None:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    return _atomic_write(path, write)


def write_payload_json(payload: dict, path: Path) -> Path:
    """Any JSON payload (NaN written as null, an infinity as 1e999)."""
    return _atomic_write(path, lambda f: f.write(_dumps(_clean(payload))))
