"""``isotui cache ls``: the cached runs as a table that fits the terminal (issue 38 item 3).

Every setting in a run's cache key is a column (:data:`RUN_KEY_COLUMNS`), ``sites`` (the
``--modules`` globs, ``blocks`` for the usual block outputs) and ``plug-ins`` (name and version
of each plug-in metric in force) among them where any run set them, so a ``--modules`` or plug-in
run never looks like a plain one. When the whole table does not fit the console's width, it
gives way in this order, each step only while it still does not fit:

1. ``created``, then ``size``, are left out (``--wide`` shows them);
2. a setting every listed run shares leaves its column for one line above the table
   (``every run: dtype float32, seed 0, ...``);
3. the settings left merge into one ``settings`` column, ``name value`` pairs that wrap between
   pairs, never inside a word.

Short fixed columns (key, samples, each setting) never wrap; model, data, sites and plug-ins fold
within their cells. ``--wide``: every column, at the table's natural width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the settings in a run's cache key besides model and data (experiments/layer_pass.py ``prepare``),
# as (meta field, column header); the ones not in ALWAYS_SHOWN are columns only where a run set them
RUN_KEY_COLUMNS = (
    ("modules", "sites"),
    ("metrics", "plug-ins"),
    ("max_length", "max len"),
    ("dtype", "dtype"),
    ("special_tokens", "special"),
    ("seed", "seed"),
    ("reservoir", "reservoir"),
    ("exact", "exact"),
    ("tokenizer", "tokenizer"),
    ("map_units", "map units"),
)
ALWAYS_SHOWN = ("max_length", "dtype", "special_tokens", "seed", "reservoir", "exact")
FOLDED = ("model", "data", "sites", "plug-ins", "settings")  # long values: wrap within the cell
FOLD_MIN = {"model": 16, "data": 8, "sites": 12, "plug-ins": 12}  # their narrowest, at most their longest
DROPPED_FIRST = ("created", "size")
OWN_COLUMN = ("modules",)  # sites keep their column when the settings merge (globs are long)
BREAK_AFTER = ",:/.=_-])"  # where a long name wraps by preference


def run_params(path: Path) -> dict[str, str]:
    """The settings that tell two entries of one model and data apart, from the entry's header:
    every one in its key (:data:`RUN_KEY_COLUMNS`); ``-`` where the data makes one meaningless
    (max length and special tokens of images and audio), ``""`` where a run did not set one that
    is optional (tokenizer, map units, plug-ins) or an older entry did not record it; sites are
    ``blocks`` unless ``--modules`` named modules."""
    from isotui.store.cache import ResultCache

    try:
        meta = ResultCache._header(path)["result"]["meta"]
    except Exception:  # an unreadable entry is listed as such already
        return {}
    modality = meta.get("modality", "text")
    reservoir = meta.get("reservoir")
    modules = meta.get("modules") or []
    metrics = meta.get("metrics") or {}
    if isinstance(metrics, list):  # [[name, version], ...] as in the key
        metrics = dict(metrics)
    return {
        "modules": ", ".join(map(str, modules)) if modules else "blocks",
        "metrics": ", ".join(f"{name} {version}" for name, version in metrics.items()),
        "max_length": str(meta.get("max_length") or "-") if modality == "text" else "-",
        "dtype": str(meta.get("dtype", "")),
        "special_tokens": str(meta.get("special_tokens", "")) if modality == "text" else "-",
        "seed": str(meta.get("seed", "")),
        "reservoir": f"{reservoir:,}" if isinstance(reservoir, int) else "",
        "exact": "yes" if meta.get("exact") else "no",
        "tokenizer": str(meta.get("tokenizer") or ""),
        "map_units": str(meta.get("map_units") or "") if modality == "image" else "",
    }


def _set(field: str, value: str) -> bool:
    """Whether a run set an optional setting (sites other than the blocks, a plug-in, ...)."""
    return bool(value) and not (field == "modules" and value == "blocks")


@dataclass
class Listing:
    """What :func:`cache_table` decided: the columns, the settings every run shares (said above
    the table), and the columns left out (said below it)."""

    headers: list[str]
    rows: list[list[str]]
    shared: list[str]
    left_out: list[str]


def layout(entries: Sequence[Any], params: Sequence[dict[str, str]], width: int, wide: bool) -> Listing:
    """The columns of ``cache ls`` for ``entries`` (cache entries) and their :func:`run_params`,
    fitted to ``width`` unless ``wide`` (see the module's docstring)."""
    settings = [
        (field, header)
        for field, header in RUN_KEY_COLUMNS
        if field in ALWAYS_SHOWN or any(_set(field, p.get(field, "")) for p in params)
    ]
    settings.insert(0, ("n_samples", "samples"))  # not a setting, but merges with them
    values = {field: [p.get(field, "") for p in params] for field, _ in settings}
    values["n_samples"] = [str(e.n_samples) for e in entries]  # str(): odd entries hold odd counts
    first = ["key", "model", "data"]
    base = [[str(e.key)[:12], str(e.model), str(e.data)] for e in entries]
    tail = {
        "created": [str(e.created).replace("T", " ")[:16] for e in entries],
        "size": [f"{e.size_bytes / 1024:.0f} KiB" for e in entries],
    }

    def build(
        settings_now: list[tuple[str, str]], merged: bool, tail_now: list[str]
    ) -> tuple[list[str], list[list[str]]]:
        own = [(f, h) for f, h in settings_now if not merged or f in OWN_COLUMN]
        pooled = [(f, h) for f, h in settings_now if (f, h) not in own]
        headers = [*first, *(h for _, h in own), *(["settings"] if pooled else []), *tail_now]
        rows = []
        for i, row in enumerate(base):
            cells = [*row, *(values[f][i] for f, _ in own)]
            if pooled:
                pairs = [(h, values[f][i]) for f, h in pooled]
                cells.append(", ".join(f"{h} {v}" for h, v in pairs if v and v != "-"))
            rows.append([*cells, *(tail[t][i] for t in tail_now)])
        return headers, rows

    tail_now = list(DROPPED_FIRST)
    settings_now = list(settings)
    headers, rows = build(settings_now, False, tail_now)
    if wide:
        return Listing(headers, rows, [], [])
    left_out: list[str] = []
    for column in DROPPED_FIRST:  # 1. created, then size
        if table_width(headers, rows) <= width:
            break
        tail_now.remove(column)
        left_out.append(column)
        headers, rows = build(settings_now, False, tail_now)
    shared: list[str] = []
    if table_width(headers, rows) > width and len(entries) > 1:  # 2. what every run shares, once
        for field, header in list(settings_now):
            same = set(values[field])
            if len(same) == 1:
                settings_now.remove((field, header))
                value = same.pop()
                if _set(field, value) and value != "-":
                    shared.append(f"{header} {value}")
        headers, rows = build(settings_now, False, tail_now)
    if table_width(headers, rows) > width:  # 3. one column of name-value pairs
        headers, rows = build(settings_now, True, tail_now)
    return Listing(headers, rows, shared, left_out)


def _min_width(header: str, cells: Sequence[str]) -> int:
    """A column's narrowest: a short one's longest cell; a folded one's at most FOLD_MIN; the
    settings' longest name-value pair (a pair never splits)."""
    longest = max([len(header), *map(len, cells)])
    if header == "settings":
        return max([len(header), *(len(p) for c in cells for p in c.split(", "))])
    if header in FOLD_MIN:
        return max(len(header), min(longest, FOLD_MIN[header]))
    return longest


def table_width(headers: Sequence[str], rows: Sequence[Sequence[str]], *, natural: bool = False) -> int:
    """The table's width at its columns' narrowest (or ``natural``: widest) cells: each column
    one space either side and a rule between (rich's heavy-head box)."""
    columns = [[r[i] for r in rows] for i in range(len(headers))]
    if natural:
        widths = [max([len(h), *map(len, col)]) for h, col in zip(headers, columns, strict=True)]
    else:
        widths = [_min_width(h, col) for h, col in zip(headers, columns, strict=True)]
    return sum(widths) + 3 * len(headers) + 1


def column_widths(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> list[int]:
    """Each column's width in a table of at most ``width`` columns: the short ones whole, the
    widest folded one narrowed first, each down to its narrowest, then (a very narrow terminal)
    below it down to its header."""
    columns = [[r[i] for r in rows] for i in range(len(headers))]
    widths = [max([len(h), *map(len, col)]) for h, col in zip(headers, columns, strict=True)]
    floors = [_min_width(h, col) for h, col in zip(headers, columns, strict=True)]
    folded = [i for i, h in enumerate(headers) if h in FOLDED]
    budget = width - 3 * len(headers) - 1
    for floor in (floors, [max(4, len(h)) for h in headers]):
        while sum(widths) > budget:
            narrowable = [i for i in folded if widths[i] > floor[i]]
            if not narrowable:
                break
            widths[max(narrowable, key=lambda i: widths[i])] -= 1
    return widths


def wrap_name(text: str, width: int) -> str:
    """``text`` in lines of at most ``width``, broken after a separator (``,`` ``:`` ``/`` ``.``
    ...) in the line's second half where there is one, else folded: a model name stays
    readable, its end (often what differs) whole."""
    lines = []
    while len(text) > width:
        cut = max((i + 1 for i, c in enumerate(text[:width]) if c in BREAK_AFTER), default=0)
        cut = cut if cut > width // 2 else width
        lines.append(text[:cut])
        text = text[cut:]
    return "\n".join([*lines, text])


def wrap_pairs(text: str, width: int) -> str:
    """The settings' ``name value`` pairs packed in lines of at most ``width``, split only between pairs."""
    lines: list[str] = []
    for pair in text.split(", ") if text else []:
        if lines and len(lines[-1]) + 2 + len(pair) <= width:
            lines[-1] += ", " + pair
        else:
            lines.append(pair)
    return "\n".join(wrap_name(line, width) for line in lines)


def cache_table(
    entries: Sequence[Any], params: Sequence[dict[str, str]], width: int, wide: bool, title: Any
) -> tuple[list[str], Any, list[str], int]:
    """``cache ls``'s table fitted to ``width``: (lines above it, the rich table, lines below it,
    its natural width)."""
    from isotui.render import Table
    from isotui.terminal import plain

    listing = layout(entries, params, width, wide)
    natural = table_width(listing.headers, listing.rows, natural=True)
    widths = column_widths(listing.headers, listing.rows, natural if wide else width)
    table = Table(title=title, title_justify="left")
    for header, w in zip(listing.headers, widths, strict=True):
        table.add_column(header, width=w, no_wrap=header not in FOLDED, overflow="fold")
    for row in listing.rows:
        cells = []
        for header, w, cell in zip(listing.headers, widths, row, strict=True):
            if header == "settings":
                cell = wrap_pairs(cell, w)
            elif header in FOLDED:
                cell = wrap_name(cell, w)
            cells.append(plain(cell))
        table.add_row(*cells)
    above = ["every run: " + ", ".join(listing.shared)] if listing.shared else []
    below = []
    if listing.left_out:
        below.append(f"({' and '.join(listing.left_out)} left out to fit {width} columns: cache ls --wide)")
    return above, table, below, natural
