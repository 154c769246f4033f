"""Rich renderings of results for the terminal (headless ``isotui run``)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Console, ConsoleOptions, RenderResult
from rich.style import Style
from rich.table import Table as RichTable
from rich.text import Text

from isotui.core.correlation import MC_PERMUTATIONS
from isotui.core.sampled import SE_DOF, SE_GROUPS, jackknife_t
from isotui.results import (
    METRIC,
    METRICS,
    SE_FIELDS,
    LayerRow,
    Metric,
    ModelResult,
    own_directions,
    plugin_metrics,
)
from isotui.terminal import literal, markup, plain


class Table(RichTable):
    """A rich table whose left-justified title and caption wrap at the console's width: rich
    wraps them at the table's own (about 55 columns for the attention table, in a terminal of
    100). Every table isotui prints is one of these."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        title = self.title if self.title_justify == "left" else None
        caption = self.caption if self.caption_justify == "left" else None
        if title:
            yield self._annotation(console, title, Style.pick_first(self.title_style, "table.title"))
            self.title = None
        if caption:
            self.caption = None
        try:
            yield from super().__rich_console__(console, options)
        finally:
            self.title = title or self.title
            self.caption = caption or self.caption
        if caption:
            yield self._annotation(console, caption, Style.pick_first(self.caption_style, "table.caption"))

    @classmethod
    def titled(cls, title: str | Text) -> Table:
        """A result's table as every view prints it: its title at the left, bold headers, no
        padding at the edges."""
        return cls(title=title, title_justify="left", header_style="bold", pad_edge=False)

    def captioned(self, caption: str | Text) -> Table:
        """This table with ``caption`` under it, at the left as its title: the notes that end a
        result's table wrap at the console's width, not the table's."""
        self.caption = caption
        self.caption_justify = "left"
        return self

    @staticmethod
    def _annotation(console: Console, text: Any, style: Any) -> Text:
        return console.render_str(text, style=style, highlight=False) if isinstance(text, str) else text


def amount(meta: dict[str, Any]) -> str:
    """How much was measured, in the data's own units: tokens, images, seconds of audio."""
    n = meta.get("n_samples")
    modality = meta.get("modality", "text")
    if modality == "image":
        return f"{n} images"
    if modality == "audio":
        seconds = meta.get("audio_seconds")
        return f"{n} clips" + (f", {seconds:.0f} s of audio" if seconds is not None else "")
    return f"{n} samples, {meta.get('n_tokens')} tokens"


def null_note(
    rows: list[LayerRow], lead: str = "* avg_cos above the isotropic null's 95th percentile"
) -> str:
    """What the ``*`` means, with the null's value (or range, when layers differ in d)."""
    dims = sorted({r.dim for r in rows})
    p95 = [r.null_p95 for r in rows if math.isfinite(r.null_p95)]
    if not p95:
        return lead
    if len(dims) == 1:
        return f"{lead} for d={dims[0]} ({_f(p95[0])})"
    span = f"{dims[0]}-{dims[-1]}: {_f(min(p95))}-{_f(max(p95))}"
    return f"{lead} for each layer's d ({span}; null_p95 in the CSV)"


def null_mean_note(rows: list[LayerRow]) -> str:
    """What ``*`` does not test, and the test of the mean: a layer's avg_cos against the null of
    the mean over its own n vectors (``above_null_mean``), whose sd is sqrt(2 / (n (n - 1) d))."""
    known = [r for r in rows if math.isfinite(r.null_mean_p95)]
    if not known:
        return ""
    above = [r for r in known if r.above_null_mean]
    which = "every layer" if len(above) == len(known) else f"{len(above)} of {len(known)} layers"
    return (
        "(* compares avg_cos with one pair's cosine; the mean over a layer's n vectors has its own "
        f"null, sd sqrt(2/(n(n-1)d)), 95th percentile {known[0].null_mean_p95:.1e} at layer "
        f"{known[0].layer}: {which} above it, above_null_mean in the CSV)"
    )


def interval_note(rows: list[LayerRow]) -> str:
    """How to read ``±``: one jackknife SE (8 groups, 7 degrees of freedom, so a 95% interval is
    2.36 SE), and where the sampled directions' bias is as large as the SE."""
    if not any(getattr(r, f) for r in rows for f in SE_FIELDS if math.isfinite(getattr(r, f))):
        return ""
    note = (
        f"± is one standard error, a delete-a-group jackknife over {SE_GROUPS} groups of the reservoir "
        f"({SE_DOF} degrees of freedom): a 95% interval is ±{jackknife_t():.2f} SE (intervals in the JSON)"
    )
    biased = own_directions(rows)
    if biased:
        note += (
            f"; layer{'s' if len(biased) > 1 else ''} {', '.join(str(r.layer) for r in biased)}: I(W) and "
            "all-but-the-top from the "
            "reservoir's own directions, whose bias can be as large as the SE; --exact removes it"
        )
    return note


def shorten(name: str, width: int) -> str:
    """``random:gpt2:n…,n_head=2``: a long name keeps its start and its end."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return name[:head] + "…" + name[-(width - 1 - head) :]


NAME_PARTS = re.compile(r"[^:/,]*[:/,]|[^:/,]+")  # a model name's parts, each with the : / , after it


def _shared(a: list[str], b: list[str]) -> int:
    """How many leading parts ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def distinct_names(names: Sequence[str], width: int) -> list[str]:
    """Names shown together (a legend, a table), each in at most ``width`` cells and no two the
    same: one that fits is kept whole; a longer one is cut to what tells it apart from the others:
    a hub id's last part when no other shown name ends so, else without the leading and trailing
    parts (split after ``:``, ``/``, ``,``) it shares with another name, marked ``…``
    (``random:gpt2:n_layer=2,n_head=2`` beside ``random:gpt2:n_layer=4,n_head=2`` reads
    ``…n_layer=2…``), then whole parts from the end while it is too long, then :func:`shorten`;
    names that would still read the same are numbered."""
    parts = [NAME_PARTS.findall(n) for n in names]
    bases = [n.rstrip("/").rsplit("/", 1)[-1] for n in names]
    out = []
    for i, name in enumerate(names):
        others = [j for j, other in enumerate(names) if other != name]
        hub = "/" in name and not name.startswith(("random:", "/", ".", "~"))
        if len(name) <= width:
            out.append(name)
            continue
        if hub and bases[i] and all(bases[j] != bases[i] for j in others):
            out.append(shorten(bases[i], width))
            continue
        mine = parts[i]
        head = max((_shared(mine, parts[j]) for j in others), default=0)
        tail = max((_shared(mine[::-1], parts[j][::-1]) for j in others), default=0)
        head = min(head, len(mine) - 1)
        tail = min(tail, len(mine) - 1 - head)
        kept = mine[head : len(mine) - tail]
        cut = "…" * (head > 0) + "".join(kept).rstrip(":/," if tail else "") + "…" * (tail > 0)
        while len(cut) > width and len(kept) > 1:  # whole parts, never n_layer=12 read as n_layer=1
            kept, tail = kept[:-1], 1
            cut = "…" * (head > 0) + "".join(kept).rstrip(":/,") + "…"
        out.append(shorten(cut, width))
    same = [
        i
        for i, name in enumerate(names)
        if any(out[i] == out[j] and name != names[j] for j in range(len(names)))
    ]
    for i in same:
        number = f" ({i + 1})"
        out[i] = shorten(out[i], max(width - len(number), 1)) + number
    return out


def _f(value: float, digits: int = 4) -> str:
    """``value`` to ``digits`` decimals; ``inf``/``-inf`` as such (a plug-in's infinity is a
    value), ``-`` where there is none (NaN, None)."""
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.{digits}f}"


def _p(value: float) -> str:
    """A p in two significant digits; one that underflowed to 0 (Pearson's t test, scipy's t
    approximation at |rho| near 1) as ``<1e-300``: no p is said as 0."""
    if not math.isfinite(value):
        return "-"
    return f"{value:.2g}" if value > 0 else "<1e-300"


def _se(se: float) -> str:
    """``±4e-4``: a sampled metric's standard error in one significant digit; nothing when it
    is exact (0) or unknown."""
    if se is None or not math.isfinite(se) or se == 0:
        return ""
    mantissa, _, exponent = f"{se:.0e}".partition("e")
    return f"±{mantissa}e{int(exponent)}"


def p_bound(value: float) -> str:
    """An upper bound on a p in two significant digits, rounded up (``<3.1e-12``: rounding to
    nearest could say less than was shown)."""
    from decimal import ROUND_CEILING, Context, Decimal

    if not math.isfinite(value) or value <= 0 or value >= 1:
        return _p(value)
    if value < 1e-300:  # subnormal: too few digits to print two
        return "<1e-300"
    # up to the 12th digit first (1e-5 is stored a hair above 1e-5; the bounds carry more margin)
    near = Context(prec=12).plus(Decimal(value))
    return f"<{float(Context(prec=2, rounding=ROUND_CEILING).plus(near)):.2g}"


def _spearman_p(d) -> str:
    """The permutation p, how it was found, and scipy's t approximation beside it; a bound
    (``p<6e-06``) where no Monte Carlo resample was as extreme, or a proven bound (``p<3.1e-54
    proven bound``) where the exact count is out of reach and the bound says more than a
    simulation could."""
    p = _p(d.spearman_p)
    if d.spearman_p_method == "monte-carlo-bound":
        p = f"<{d.spearman_p:.1g} Monte Carlo, none of {MC_PERMUTATIONS:,} as extreme"
    elif d.spearman_p_method == "bound":
        p = f"{p_bound(d.spearman_p)} proven bound"
    elif d.spearman_p_method == "monte-carlo":
        p += f"±{d.spearman_p_se:.1g} Monte Carlo"
    elif d.spearman_p_method:
        p += f" {d.spearman_p_method}"
    if math.isfinite(d.spearman_p_t):
        p += f"; t approx. {_p(d.spearman_p_t)}"
    return p


def _rogue(text: str, shape: Sequence[int] | None = None) -> str:
    """``63:0.4497|383:0.0881`` -> ``63:.45 383:.09`` (the CSV keeps full precision). A flattened
    conv map's dimension (``shape``: its C, H, W) is named by channel and position, ``c12@(3,4)``,
    with its share in two significant digits (one of d ~ 10^5 dimensions carries ~1e-5)."""
    parts = []
    for item in filter(None, text.split("|")):
        dim, _, share = item.partition(":")
        if shape is None:
            parts.append(f"{dim}:{float(share):.2f}".replace(":0.", ":.").replace(":-0.", ":-."))
            continue
        c, y, x = (int(v) for v in np.unravel_index(int(dim), tuple(shape)))
        parts.append(f"c{c}@({y},{x}):{float(share):.2g}")
    return " ".join(parts)


def _map_shape(result: ModelResult, r: LayerRow) -> Sequence[int] | None:
    """The (C, H, W) of row ``r``'s flattened map, when its vectors are one (else None)."""
    shapes = (result.meta.get("map_shapes") or {}).get(r.component) or []
    return shapes[r.layer] if r.layer < len(shapes) else None


def _avg_cos(r: LayerRow) -> Text:
    return Text(_f(r.avg_cos) + ("*" if r.above_null else " "), style="bold" if r.above_null else "")


MODULE_WIDTH = 40  # a --modules row's module name in the layer column (its start and end kept)


def layer_label(r: LayerRow) -> str:
    """``3``, ``12 (norm)`` when the model's final norm is in it, ``decoder 3`` for a 2nd stack,
    ``3 h.1.attn`` for a ``--modules`` row (the module named where the eye looks, not only in
    the CSV)."""
    layer = f"{r.layer}{' (norm)' if r.final_norm else ''}"
    if r.module:
        layer = f"{layer} {shorten(r.module, MODULE_WIDTH)}"
    return layer if r.component == "model" else f"{r.component} {layer}"


@dataclass(frozen=True)
class Column:
    """A column of the per-layer table: header, cell text, and the LayerRow field it shows
    (what the app sorts and shades by). Terminals narrower than ``min_width`` drop it; the CSV
    always has every field."""

    header: str
    cell: Callable[[LayerRow], Any]
    min_width: int
    field: str


def _metric_cell(m: Metric) -> Callable[[LayerRow], Any]:
    """A metric's cell: its value to its digits, with its standard error where it has one."""
    if m.name == "avg_cos":
        return _avg_cos  # marked * above the isotropic null
    if m.name == "top_rogue_share":
        return lambda r: _rogue(r.rogue_dims)  # the top dimensions with their shares
    if m.se:
        se = m.se
        return lambda r: _f(getattr(r, m.name), m.digits) + _se(getattr(r, se))
    return lambda r: _f(getattr(r, m.name), m.digits)


# The layer and its vector count, then every metric with a table header (results.METRICS).
COLUMNS: list[Column] = [
    Column("layer", layer_label, 0, "layer"),
    Column("n", lambda r: str(r.n_vectors), 0, "n_vectors"),
    *(Column(m.header, _metric_cell(m), m.min_width, m.name) for m in METRICS if m.header),
]


def layer_columns(rows: list[LayerRow]) -> list[Column]:
    """The per-layer table's columns for these rows: :data:`COLUMNS`, then the plug-in metrics'
    columns the rows hold (isotui.core.plugin)."""
    return COLUMNS + [Column(m.header, _metric_cell(m), m.min_width, m.name) for m in plugin_metrics(rows)]


TIMING_PARTS = (
    ("load_s", "load"),
    ("tokenise_s", "tokenise"),
    ("forward_s", "forward"),
    ("metrics_s", "per-batch metrics"),
    ("finalise_s", "finalise"),
    ("write_s", "cache write"),
)


def total_seconds(meta: dict[str, Any], write_s: float | None = None) -> float:
    """The run's wall time from loading to writing (older entries: the extraction's seconds)."""
    timings = {**(meta.get("timings") or {}), **({"write_s": write_s} if write_s is not None else {})}
    return sum(timings.get(k, 0.0) for k, _ in TIMING_PARTS) if timings else meta.get("seconds", 0.0)


def timing_note(meta: dict[str, Any], write_s: float | None = None) -> str | None:
    """``time: load 2.1 s, forward 20.3 s, ...; total 41.0 s`` (what a run spent where);
    ``write_s``: the cache write, known only to the run that wrote it."""
    timings = {**(meta.get("timings") or {}), **({"write_s": write_s} if write_s is not None else {})}
    if not meta.get("timings"):
        return None
    parts = [f"{label} {timings[k]:.1f} s" for k, label in TIMING_PARTS if k in timings]
    return f"time: {', '.join(parts)}; total {total_seconds(meta, write_s):.1f} s"


def result_table(result: ModelResult, width: int = 200) -> Table:
    """The per-layer table of one model, with the isotropic null and final-norm marks."""
    meta = result.meta
    source = "cache" if result.from_cache else f"{total_seconds(meta):.1f} s"
    title = markup(
        f"[bold]{literal(result.model)}[/]  {literal(meta.get('data'))}  {amount(meta)}  "
        f"{meta.get('dtype')} on {meta.get('device')}  ({source})",
        style="table.title",
    )
    table = Table.titled(title)
    every = layer_columns(result.rows)
    columns = [c for c in every if c.min_width <= width]
    for c in columns:
        rogue = c.header.startswith("rogue")
        table.add_column(c.header, justify="left" if rogue else "right", no_wrap=rogue)
    for r in result.rows:
        shape = _map_shape(result, r)
        table.add_row(
            *(
                _rogue(r.rogue_dims, shape) if c.field == "top_rogue_share" and shape else c.cell(r)
                for c in columns
            )
        )
    notes = [null_note(result.rows)]
    if mean_note := null_mean_note(result.rows):
        notes.append(mean_note)
    if se_note := interval_note(result.rows):
        notes.append(se_note)
    if len(columns) < len(every):
        notes.append("(narrow terminal: some columns hidden; --csv has them all)")
    if any(r.final_norm for r in result.rows):
        module = meta.get("final_norm_module") or "final norm"
        notes.append(f"(norm): the model's last hidden state has already passed through `{module}`")
    for comp, d in result.drift.items():
        prefix = "" if comp == "model" else f"{comp}: "
        notes.append(
            f"{prefix}drift vs avg_cos over {d.n_layers} layers: Spearman rho={_f(d.spearman_rho, 3)} "
            f"(p={_spearman_p(d)}), Pearson r={_f(d.pearson_r, 3)} (p={_p(d.pearson_p)})"
        )
    notes.extend(meta.get("notes", []))
    timing = timing_note(meta, result.write_seconds)
    if timing:
        notes.append(timing if not result.from_cache else f"time when computed: {timing[6:]}")
    return table.captioned(plain("\n".join(notes), style="table.caption"))


def wide_rows(results: list[ModelResult], metric: str = "avg_cos") -> tuple[list[str], list[list[Any]]]:
    """(model names, rows): one row per (component, layer) of any model, one value per model
    (None where a model has no such layer): the layer x model view of Godey et al. Fig. 1."""
    sites: list[tuple[str, int]] = []
    values: dict[tuple[str, int], dict[int, float]] = {}
    for i, result in enumerate(results):
        for r in result.rows:
            site = (r.component, r.layer)
            if site not in values:
                sites.append(site)
                values[site] = {}
            values[site][i] = getattr(r, metric)
    order = {c: n for n, c in enumerate(dict.fromkeys(c for c, _ in sites))}
    sites.sort(key=lambda s: (order[s[0]], s[1]))
    rows = [[c, layer, *(values[(c, layer)].get(i) for i in range(len(results)))] for c, layer in sites]
    return [r.model for r in results], rows


def wide_table(results: list[ModelResult], metric: str = "avg_cos", width: int = 200) -> Table:
    """Layers (rows) by models (columns) for one metric; the per-model tables have the rest."""
    models, rows = wide_rows(results, metric)
    table = Table.titled(f"[bold]{metric}[/] per layer, {len(models)} models")
    many = len({row[0] for row in rows}) > 1
    table.add_column("layer", justify="right", no_wrap=True)
    cell = max(8, min(24, (width - 10) // max(1, len(models)) - 3))
    for model in models:
        table.add_column(plain(shorten(model, cell)), justify="right", overflow="fold")
    digits = METRIC[metric].digits if metric in METRIC else 4  # a plug-in's column: 4 decimals
    for component, layer, *cells in rows:
        label = str(layer) if not many and component == "model" else f"{component} {layer}"
        table.add_row(label, *(_f(v, digits) if v is not None else "" for v in cells))
    return table.captioned(
        "depth differs between models: compare by row (layer index) or see the per-model tables; "
        "--wide METRIC shows another metric; --wide-csv writes this table"
    )


DUPLICATE_MARK = "*"  # a checkpoint serving another step's weights (its duplicate_of)


def duplicates_caption(checkpoints: list[Any]) -> str:
    """The caption's sentence on checkpoints that serve another step's weights ("" if none)."""
    flagged = [c for c in checkpoints if c.duplicate_of]
    if not flagged:
        return ""
    return (
        f"; {DUPLICATE_MARK}: serves the weights of a later step, not its own ("
        + ", ".join(f"{shorten(c.label, 24)} = {shorten(c.duplicate_of, 24)}" for c in flagged)
        + ")"
    )
