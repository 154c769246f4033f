"""Rich tables of attention results (``isotui experiment attention`` / ``qk-dynamics``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.cells import cell_len

from isotui.experiments.attention import AttentionResult, summarize
from isotui.render import DUPLICATE_MARK, Table, _f, amount, duplicates_caption, shorten
from isotui.terminal import literal, markup, plain


def _site(component: str, layer: int, attention: str, many: bool) -> str:
    label = str(layer) if not many else f"{component} {layer}"
    return label + (" x" if attention == "cross" else "")


def _clean(text: str) -> str:
    """``-0.000`` -> ``0.000``: a value that rounds to zero has no sign."""
    return text[1:] if text.startswith("-") and not text.strip("-0.e+") else text


def column_formatter(kind: str, values: Sequence[float]) -> Callable[[float], str]:
    """One formatter for every cell of a column, chosen by the column's kind (and, for kinds that
    span decades, once for the whole column from its values): never ``5.28e-05`` above
    ``0.0001`` in one column, never ``-0.000``, counts without decimals."""
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    if kind == "count":
        return lambda v: "-" if v is None or not math.isfinite(v) else str(int(v))
    if kind == "cos":  # in [-1, 1]
        digits, sci = 3, False
    elif kind == "nats":
        digits, sci = 2, False
    elif kind == "prob":  # in [0, 1], the smallest ones tiny
        tiny = [v for v in finite if v > 0]
        digits, sci = 4, bool(tiny) and min(tiny) < 1e-3
    else:  # magnitudes: fixed unless the column spans decades below 0.01 or above 1e4
        nonzero = [v for v in finite if v > 0]
        digits = 2
        sci = bool(nonzero) and (min(nonzero) < 1e-2 or max(nonzero) >= 1e4)
    if sci:
        return lambda v: "-" if v is None or not math.isfinite(v) else _clean(f"{v:.2e}")
    return lambda v: "-" if v is None or not math.isfinite(v) else _clean(f"{v:.{digits}f}")


@dataclass(frozen=True)
class AttnColumn:
    """A column of the attention table: header, the value(s) it shows and its kind (one formatter
    per kind). :data:`ATTENTION_COLUMNS` is in priority order: a narrow terminal drops columns
    from the end until the table fits (the CSV always has everything)."""

    header: str
    values: Callable[[Any], tuple[float, ...]]
    kind: str
    per_head: bool | None = None  # None: both views; True/False: only that view
    rope: bool = False  # only for rotary models
    joiner: str = ""


ATTENTION_COLUMNS: list[AttnColumn] = [
    AttnColumn("head", lambda r: (r.head,), "count", per_head=True),
    AttnColumn("heads", lambda r: (r.heads,), "count", per_head=False),
    AttnColumn("cos(Q̄,K̄)", lambda r: (r.cos_qk_bar,), "cos"),
    AttnColumn("range", lambda r: (r.cos_qk_bar_min, r.cos_qk_bar_max), "cos", per_head=False, joiner=".."),
    AttnColumn("|Q̄|", lambda r: (r.q_bar_norm,), "magnitude"),
    AttnColumn("|K̄|", lambda r: (r.k_bar_norm,), "magnitude"),
    AttnColumn("entropy", lambda r: (r.entropy,), "nats"),
    AttnColumn("p max", lambda r: (r.softmax_max,), "prob"),
    AttnColumn("Q̄·K̄", lambda r: (r.dot_qk_bar,), "magnitude"),
    AttnColumn("q avg_cos", lambda r: (r.q_avg_cos,), "cos"),
    AttnColumn("k avg_cos", lambda r: (r.k_avg_cos,), "cos"),
    AttnColumn("score μ±σ", lambda r: (r.score_mean, r.score_std), "magnitude", joiner="±"),
    AttnColumn("p med", lambda r: (r.softmax_median,), "prob"),
    AttnColumn("p min", lambda r: (r.softmax_min,), "prob"),
    AttnColumn("cos pre-rope", lambda r: (r.cos_qk_bar_pre_rope,), "cos", rope=True),
]


def attention_table(result: AttentionResult, width: int = 200, *, per_head: bool = False) -> Table:
    """One row per attention module (heads averaged; cos range over heads), or per head. Columns
    are dropped by priority on narrow terminals, as in the layer table."""
    meta = result.meta
    source = "cache" if result.from_cache else f"{meta.get('seconds', 0):.1f} s"
    title = markup(
        f"[bold]{literal(shorten(result.model, 60))}[/]  attention  {literal(meta.get('data'))}  "
        f"{amount(meta)}  {meta.get('dtype')} on {meta.get('device')}  ({source})",
        style="table.title",
    )
    table = Table.titled(title)
    many = len({m["component"] for m in result.modules()}) > 1
    rope = any(r.rope for r in result.rows)
    if per_head:
        items: list[Any] = list(result.rows)
    else:
        items = summarize(result)
    possible = [
        c
        for c in ATTENTION_COLUMNS
        if (c.per_head is None or c.per_head == per_head) and (rope or not c.rope)
    ]
    labels = [_site(item.component, item.layer, item.attention, many) for item in items]
    cells: dict[str, list[str]] = {}
    for c in possible:
        parts = [c.values(item) for item in items]
        fmt = column_formatter(c.kind, [v for vs in parts for v in vs])
        cells[c.header] = [(c.joiner or " ").join(fmt(v) for v in vs) for vs in parts]

    def room(header: str, column: list[str]) -> int:  # its width with a border and padding
        return max([cell_len(header), *(cell_len(x) for x in column)]) + 3

    used = 1 - 2 + room("layer", labels)  # the outer border; no padding at the edges
    columns: list[AttnColumn] = []
    for c in possible:
        if used + room(c.header, cells[c.header]) > width and columns:
            break
        columns.append(c)
        used += room(c.header, cells[c.header])
    table.add_column("layer", justify="right", no_wrap=True)
    for c in columns:
        table.add_column(c.header, justify="right", no_wrap=True)
    for i, label in enumerate(labels):
        table.add_row(label, *(cells[c.header][i] for c in columns))
    notes = [
        "Q̄, K̄: mean query and key of a head over the kept tokens; layer L is the attention of the block "
        "that outputs hidden-state row L; range: the lowest and highest cos(Q̄,K̄) among the layer's heads; "
        "p max/med/min: softmax row statistics averaged over query rows; entropy in nats"
        + ("; x: cross-attention" if any(m["attention"] == "cross" for m in result.modules()) else "")
    ]
    if rope:
        notes.append("queries and keys after rotary embedding (as scored); cos pre-rope: before it")
    if len(columns) < len(possible):
        hidden = ", ".join(c.header for c in possible if c not in columns)
        notes.append(f"(narrow terminal: {hidden} hidden; --csv has them all)")
    notes.extend(meta.get("notes", []))
    return table.captioned(plain("\n".join(notes), style="table.caption"))


def dynamics_tables(result) -> list[Table]:
    """Checkpoints (rows) by layers (columns), heads averaged: cos(Q̄,K̄), Q̄·K̄ and entropy."""
    steps = result.steps()
    many = len({s[0] for s in result.sites}) > 1
    labels = [_site(c, layer, a, many) for c, layer, a in result.sites]
    tables = []
    for attr, name, digits in (
        ("cos_qk_bar", "cos(Q̄,K̄)", 3),
        ("dot_qk_bar", "Q̄·K̄", 2),
        ("entropy", "attention entropy (nats)", 2),
    ):
        values = result.layer_means(attr)
        table = Table.titled(
            markup(
                f"[bold]{literal(shorten(result.series, 60))}[/]  {name} per layer, heads averaged  "
                f"{literal(result.meta.get('data'))}, {result.meta.get('n_samples')} samples",
                style="table.title",
            )
        )
        table.add_column("checkpoint", justify="left", no_wrap=True)
        table.add_column("step", justify="right")
        for label in labels:
            table.add_column(label, justify="right")
        for i, ckpt in enumerate(result.checkpoints):
            mark = DUPLICATE_MARK if ckpt.duplicate_of else ""
            table.add_row(
                plain(shorten(ckpt.label, 28) + mark), str(steps[i]), *(_f(v, digits) for v in values[i])
            )
        tables.append(table)
    tables[-1].caption = plain(
        "layer L: the attention of the block that outputs hidden-state row L; x: cross-attention; per head "
        "and the 2-D trajectories of Q̄ and K̄: --csv, --plot LAYER:HEAD"
        + duplicates_caption(result.checkpoints),
        style="table.caption",
    )
    tables[-1].caption_justify = "left"
    return tables
