"""The terminal table of a sweep: one row per N, mean (± std over seeds), N* below."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from isotui.experiments.drift_block.result import DriftBlockResult

if TYPE_CHECKING:
    from rich.table import Table

# (column title, metric, format, priority: lower is kept longer on a narrow terminal)
TABLE_COLUMNS = (
    ("in cos", "in_avg_cos", ".4f", 0),
    ("out cos", "out_avg_cos", ".4f", 0),
    ("in |x|", "in_mean_norm", ".2f", 1),
    ("out |x|", "out_mean_norm", ".2f", 1),
    ("q cos", "q_avg_cos", ".4f", 3),
    ("k cos", "k_avg_cos", ".4f", 3),
    ("cos(Q̄,K̄)", "cos_qk_bar", ".4f", 2),
    ("score μ", "score_mean", ".3f", 6),
    ("score σ", "score_std", ".3f", 4),
    ("sm max", "softmax_max", ".3e", 2),
    ("sm med", "softmax_median", ".3e", 6),
    ("sm min", "softmax_min", ".3e", 2),
    ("peak max", "softmax_max_peak", ".3e", 5),
    ("floor min", "softmax_min_floor", ".3e", 5),
)


def _cell(mean: float, std: float, fmt: str) -> str:
    if math.isnan(mean):
        return "-"
    text = format(mean, fmt)
    if not math.isnan(std):  # several seeds: the std on a line of its own keeps the table narrow
        text += f"\n[dim]±{std:{'.1e' if fmt.endswith('e') else fmt}}[/]"
    return text


def result_table(result: DriftBlockResult, width: int = 200) -> Table:
    """The rich table: one row per N (mean, and ± std below it, over the seeds when several).

    Columns that do not fit ``width`` are dropped, least essential first (the CSV has them all).
    """
    from rich.table import Table

    c = result.config
    seeds = ",".join(str(s) for s in result.seeds)
    title = (
        f"[bold]drift-block[/]  BERT block d={c.hidden} heads={c.heads} ffn={c.intermediate} "
        f"std={c.init_std:g}  {c.batch}x{c.seq_len} tokens  vocab {c.vocab}  {c.describe_block()}  "
        f"seed{'s' if len(result.seeds) > 1 else ''} {seeds}"
    )
    table = Table(title=title, title_justify="left", header_style="bold", pad_edge=False)
    cells = {m: [_cell(s.mean[m], s.std[m], fmt) for s in result.summary] for _, m, fmt, _ in TABLE_COLUMNS}

    def col_width(head: str, metric: str) -> int:
        lines = [
            line.replace("[dim]", "").replace("[/]", "") for v in cells[metric] for line in v.split("\n")
        ]
        return max(len(head), *map(len, lines)) + 3

    norm_width = max(len(f"{v:g}") for v in result.norms) + 3
    kept = list(TABLE_COLUMNS)
    while kept and norm_width + sum(col_width(h, m) for h, m, _, _ in kept) > width:
        kept.remove(max(kept, key=lambda col: (col[3], TABLE_COLUMNS.index(col))))
    table.add_column("N", justify="right")
    for head, _, _, _ in kept:
        table.add_column(head, justify="right", no_wrap=True)
    for i, s in enumerate(result.summary):
        table.add_row(f"{s.norm:g}", *(cells[m][i] for _, m, _, _ in kept))
    notes = []
    if len(kept) < len(TABLE_COLUMNS):
        notes.append("(narrow terminal: some columns hidden; --csv has them all)")
    notes.append(n_star_line(result))
    notes.extend(result.notes)
    table.caption = "\n".join(notes)
    table.caption_justify = "left"
    return table


def n_star_line(result: DriftBlockResult) -> str:
    """The caption line that gives N* (mean ± std over the seeds that cross) or says there is none."""
    if math.isnan(result.n_star):
        return "fixed point N*: none in this sweep (input and output mean norms do not cross)"
    text = f"fixed point N* (input mean norm = output mean norm): {result.n_star:.3f}"
    if not math.isnan(result.n_star_std):
        text += f" ± {result.n_star_std:.3f} over {np.isfinite(result.n_star_per_seed).sum()} seeds"
    return text


def score_bars(
    result: DriftBlockResult, index: int, max_bars: int = 60, tail: float = 0.001
) -> tuple[np.ndarray, np.ndarray]:
    """Fig. 7's histogram at the ``index``-th N (heads and seeds pooled), ready to draw: the
    central mass of the scores (the ``tail`` share on each side left out, so a few far scores do
    not squash the picture; the table gives the exact min and max) on at most ``max_bars`` bars,
    each the sum of the same number of consecutive stored bins (exact counts, equal widths).
    Returns (counts with the left-out scores in slot 0 and -1, edges), as ``draw_histogram`` takes."""
    counts = result.score_hist_pooled()[index]
    edges = np.asarray(result.score_edges[index], dtype=np.float64)
    inner = counts[1:-1].astype(np.int64)
    total = int(inner.sum())
    if total == 0:
        return counts, edges
    cdf = np.cumsum(inner) / total
    lo = int(np.searchsorted(cdf, tail, side="left"))
    hi = int(np.searchsorted(cdf, 1 - tail, side="left")) + 1
    group = -(-(hi - lo) // max_bars)
    bars = -(-(hi - lo) // group)
    hi = lo + bars * group
    if hi > len(inner):  # the last bar runs past the stored bins: continue them, empty and as wide
        extra = hi - len(inner)
        width = edges[1] - edges[0]
        inner = np.concatenate([inner, np.zeros(extra, dtype=np.int64)])
        edges = np.concatenate([edges, edges[-1] + width * np.arange(1, extra + 1)])
    grouped = inner[lo:hi].reshape(bars, group).sum(1)
    left, right = counts[0] + inner[:lo].sum(), counts[-1] + inner[hi:].sum()
    return np.concatenate([[left], grouped, [right]]).astype(np.int64), edges[lo : hi + 1 : group]
