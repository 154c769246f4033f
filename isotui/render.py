"""Rich renderings of results for the terminal (headless ``isotui run``)."""

from __future__ import annotations

import math

from rich.table import Table
from rich.text import Text

from isotui.results import ModelResult


def _f(value: float, digits: int = 4) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _p(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.2g}"


def result_table(result: ModelResult) -> Table:
    """The per-layer table of one model, with the isotropic null and final-norm marks."""
    meta = result.meta
    source = "cache" if result.from_cache else f"{meta.get('seconds', 0):.1f} s"
    title = (
        f"[bold]{result.model}[/]  {meta.get('data')}  {meta.get('n_samples')} samples, "
        f"{meta.get('n_tokens')} tokens  {meta.get('dtype')} on {meta.get('device')}  ({source})"
    )
    table = Table(title=title, title_justify="left", header_style="bold", pad_edge=False)
    for name in (
        "layer",
        "n",
        "avg_cos",
        "xctx",
        "centered",
        "drift",
        "mean_norm",
        "isoscore",
        "eff_rank",
        "top_pc",
        "rogue dims (dim:share)",
    ):
        table.add_column(name, justify="left" if name.startswith("rogue") else "right")
    for r in result.rows:
        mark = "*" if r.above_null else " "
        layer = f"{r.layer}{' (norm)' if r.final_norm else ''}"
        label = layer if r.component == "model" else f"{r.component} {layer}"
        table.add_row(
            label,
            str(r.n_vectors),
            Text(_f(r.avg_cos) + mark, style="bold" if r.above_null else ""),
            _f(r.avg_cos_xctx),
            _f(r.avg_cos_centered),
            _f(r.drift_norm, 3),
            _f(r.mean_norm, 3),
            _f(r.isoscore),
            _f(r.eff_rank, 1),
            _f(r.top_pc_share, 3),
            r.rogue_dims.replace("|", " "),
        )
    dim = result.rows[0].dim if result.rows else 0
    p95 = result.rows[0].null_p95 if result.rows else math.nan
    notes = [f"* avg_cos above the isotropic null's 95th percentile for d={dim} ({_f(p95)})"]
    if any(r.final_norm for r in result.rows):
        module = meta.get("final_norm_module") or "final norm"
        notes.append(f"(norm): the model's last hidden state has already passed through `{module}`")
    for comp, d in result.drift.items():
        prefix = "" if comp == "model" else f"{comp}: "
        notes.append(
            f"{prefix}drift vs avg_cos over {d.n_layers} layers: Spearman rho={_f(d.spearman_rho, 3)} "
            f"(p={_p(d.spearman_p)}), Pearson r={_f(d.pearson_r, 3)} (p={_p(d.pearson_p)})"
        )
    notes.extend(meta.get("notes", []))
    table.caption = "\n".join(notes)
    table.caption_justify = "left"
    return table
