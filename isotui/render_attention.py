"""Rich tables of attention results (``isotui experiment attention`` / ``qk-dynamics``)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from isotui.experiments.attention import AttentionResult, summarize
from isotui.render import _f, amount, shorten


def _site(component: str, layer: int, attention: str, many: bool) -> str:
    label = str(layer) if not many else f"{component} {layer}"
    return label + (" x" if attention == "cross" else "")


def attention_table(result: AttentionResult, width: int = 200, *, per_head: bool = False) -> Table:
    """One row per attention module (heads averaged; cos range over heads), or per head."""
    meta = result.meta
    source = "cache" if result.from_cache else f"{meta.get('seconds', 0):.1f} s"
    title = (
        f"[bold]{escape(shorten(result.model, 60))}[/]  attention  {escape(str(meta.get('data')))}  "
        f"{amount(meta)}  {meta.get('dtype')} on {meta.get('device')}  ({source})"
    )
    table = Table(title=title, title_justify="left", header_style="bold", pad_edge=False)
    many = len({m["component"] for m in result.modules()}) > 1
    rope = any(r.rope for r in result.rows)
    heads = ["layer"] + (["head"] if per_head else ["heads"])
    heads += ["cos(Q̄,K̄)"] + ([] if per_head else ["range"]) + ["Q̄·K̄", "|Q̄|", "|K̄|"]
    if rope and width >= 130:
        heads += ["cos pre-rope"]
    heads += ["q avg_cos", "k avg_cos", "score μ±σ", "p max", "p med", "p min", "entropy"]
    for h in heads:
        table.add_column(h, justify="right")
    if per_head:
        for r in result.rows:
            cells = [_site(r.component, r.layer, r.attention, many), str(r.head), _f(r.cos_qk_bar, 3)]
            cells += [_f(r.dot_qk_bar, 2), _f(r.q_bar_norm, 2), _f(r.k_bar_norm, 2)]
            if rope and width >= 130:
                cells.append(_f(r.cos_qk_bar_pre_rope, 3))
            cells += [_f(r.q_avg_cos, 3), _f(r.k_avg_cos, 3), f"{_f(r.score_mean, 2)}±{_f(r.score_std, 2)}"]
            cells += [_f(r.softmax_max, 3), _f(r.softmax_median, 4), _f(r.softmax_min, 4), _f(r.entropy, 2)]
            table.add_row(*cells)
    else:
        for s in summarize(result):
            rows = [
                r
                for r in result.rows
                if (r.component, r.layer, r.attention) == (s.component, s.layer, s.attention)
            ]
            cells = [_site(s.component, s.layer, s.attention, many), str(s.heads), _f(s.cos_qk_bar, 3)]
            cells += [f"{_f(s.cos_qk_bar_min, 2)}..{_f(s.cos_qk_bar_max, 2)}"]
            cells += [_f(s.dot_qk_bar, 2), _f(s.q_bar_norm, 2), _f(s.k_bar_norm, 2)]
            if rope and width >= 130:
                pre = [r.cos_qk_bar_pre_rope for r in rows]
                cells.append(_f(sum(pre) / len(pre), 3))
            cells += [_f(s.q_avg_cos, 3), _f(s.k_avg_cos, 3), f"{_f(s.score_mean, 2)}±{_f(s.score_std, 2)}"]
            cells += [_f(s.softmax_max, 3), _f(s.softmax_median, 4), _f(s.softmax_min, 4), _f(s.entropy, 2)]
            table.add_row(*cells)
    notes = [
        "Q̄, K̄: mean query and key of a head over the kept tokens; layer L is the attention of the block "
        "that outputs hidden-state row L; p max/med/min: softmax row statistics averaged over query rows; "
        "entropy in nats"
        + ("; x: cross-attention" if any(m["attention"] == "cross" for m in result.modules()) else "")
    ]
    if rope:
        notes.append("queries and keys after rotary embedding (as scored); cos pre-rope: before it")
    notes.extend(meta.get("notes", []))
    table.caption = "\n".join(notes)
    table.caption_justify = "left"
    return table


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
        table = Table(
            title=f"[bold]{escape(shorten(result.series, 60))}[/]  {name} per layer, heads averaged  "
            f"{escape(str(result.meta.get('data')))}, {result.meta.get('n_samples')} samples",
            title_justify="left",
            header_style="bold",
            pad_edge=False,
        )
        table.add_column("checkpoint", justify="left", no_wrap=True)
        table.add_column("step", justify="right")
        for label in labels:
            table.add_column(label, justify="right")
        for i, ckpt in enumerate(result.checkpoints):
            table.add_row(escape(shorten(ckpt.label, 28)), str(steps[i]), *(_f(v, digits) for v in values[i]))
        tables.append(table)
    tables[-1].caption = (
        "layer L: the attention of the block that outputs hidden-state row L; x: cross-attention; per head "
        "and the 2-D trajectories of Q̄ and K̄: --csv, --plot LAYER:HEAD"
    )
    tables[-1].caption_justify = "left"
    return tables
