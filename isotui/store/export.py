"""Exports of results: CSV (the per-layer table) and JSON (everything, incl. drift correlation)."""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from isotui.errors import IsotuiError
from isotui.results import SE_FIELDS, LayerRow, ModelResult


def _atomic_write(path: Path, write) -> Path:
    """Write through a temporary file renamed into place: a failure leaves the old file intact."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise IsotuiError(f"cannot write {path}: it is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise IsotuiError(f"cannot write {path}: {exc.strerror or exc}; choose another path") from None
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as exc:
        raise IsotuiError(f"cannot write {path}: {exc.strerror or exc}; choose another path") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


# After the per-layer columns: what the run measured, so rows of different runs stay apart.
RUN_COLUMNS = ("data", "n_samples", "max_length", "special_tokens", "dtype", "run_key")


def write_csv(results: Iterable[ModelResult], path: Path) -> Path:
    """One row per model, component and layer; columns as :meth:`LayerRow.columns`, then
    :data:`RUN_COLUMNS` from the run's metadata, then the standard errors (added later)."""
    results = list(results)

    def write(f) -> None:
        base = [c for c in LayerRow.columns() if c not in SE_FIELDS]  # earlier columns keep their places
        writer = csv.DictWriter(f, fieldnames=[*base, *RUN_COLUMNS, *SE_FIELDS])
        writer.writeheader()
        for r in results:
            run = {c: r.meta.get(c, "") for c in RUN_COLUMNS[:-1]} | {"run_key": r.key}
            for row in r.rows:
                writer.writerow(asdict(row) | run)

    return _atomic_write(path, write)


def _clean(value):
    """JSON has no NaN: write null instead, so every JSON reader accepts the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def write_json(results: Iterable[ModelResult], path: Path) -> Path:
    """All results with their metadata and drift correlations (NaN written as null)."""
    payload = {"results": [_clean(r.to_json()) for r in results]}
    return _atomic_write(path, lambda f: json.dump(payload, f, indent=2))


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
    """Any JSON payload (NaN written as null)."""
    return _atomic_write(path, lambda f: json.dump(_clean(payload), f, indent=2))
