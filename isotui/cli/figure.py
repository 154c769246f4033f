"""``isotui figure NAME --out PATH.pdf|.svg|.png``: a paper's figure from cached (or computed) results.

The results come through the experiments' one loop (:func:`isotui.cli.experiments.collect`, the
registry's layer run or checkpoint series: read from the cache, what is missing computed and
stored); :mod:`isotui.paper_figures` draws them. Beside the figure go PATH.csv (exactly the
plotted numbers) and PATH.json (the command, the settings and the run keys), so a figure can be
redrawn and cited. Import-light: matplotlib loads only when a figure is drawn.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

TRAJECTORY_FIGURES = {f"godey2024-fig{n}" for n in (11, 12, 19, 20, 21, 22)}  # --basis, --layer, --head
HELP = "draw a paper's figure (PDF, SVG or PNG) from cached or computed results; --list names them"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The figure's flags: which figure, where, how wide; the models or series and the run flags."""
    from isotui.cli.common import add_run_flags
    from isotui.cli.experiments import add_duplicates_flag, add_param_flags
    from isotui.core.trajectory import BASES
    from isotui.experiments.ablate.experiment import AblateParams
    from isotui.experiments.checkpoints import METRICS
    from isotui.experiments.drift_block.params import DriftBlockParams
    from isotui.experiments.qk_dynamics import DEFAULT_SAMPLE

    p.add_argument("name", nargs="?", metavar="NAME", help="the figure (see --list)")
    p.add_argument("--list", action="store_true", help="name every figure and what it shows")
    p.add_argument("--out", "-o", metavar="PATH", help="the figure: .pdf, .svg or .png (CSV, JSON beside it)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace PATH.csv and PATH.json even when they are not an earlier figure's",
    )
    p.add_argument("--width", choices=("single", "double"), default="single", help="3.3 in or 6.9 in")
    p.add_argument("--dpi", type=int, default=300, help="PNG resolution (default 300)")
    p.add_argument("--style", metavar="FILE", help="a matplotlib style file applied over the paper defaults")
    p.add_argument("--depth", action="store_true", help="godey2024-fig1: x is the normalised depth")
    p.add_argument("--dims", metavar="LIST", help="godey2024-fig17: the dimensions d (default 8,32,128,768)")
    p.add_argument("--metric", default="avg_cos", choices=METRICS, help="machina2024-heatmap/-curves' metric")
    p.add_argument("--log-counts", action="store_true", help="godey2024-fig7: a log count axis")
    p.add_argument("--at-norm", metavar="N", help="godey2024-fig7, fig9: at this N of the sweep")
    p.add_argument("--ks", metavar="LIST", help="gradient-energy: the subspace sizes k (default 1,2,4,8,16)")
    p.add_argument(
        "--basis",
        choices=BASES,
        help="godey2024-fig11/12/19-22: the SVD of queries+keys (qk), queries (q) or keys (k); "
        "default the figure's own (11-12 qk, 19-20 q, 21-22 k)",
    )
    p.add_argument("--layer", type=int, help="godey2024-fig11/12/19-22: the layer (default the last)")
    p.add_argument(
        "--head", type=int, help="godey2024-fig11/12/19-22: one head (default every head of the layer)"
    )
    p.add_argument(
        "--sample",
        default=str(DEFAULT_SAMPLE),
        help=f"godey2024-fig11-15/19-23: query and key positions per module for the SVD ({DEFAULT_SAMPLE})",
    )
    p.add_argument(
        "--model", "-m", action="append", dest="models", metavar="MODEL", help="model (repeat to compare)"
    )
    p.add_argument(
        "--checkpoints",
        "-c",
        action="append",
        metavar="LIST",
        help="machina2024-heatmap/-curves, godey2024-fig11-15/19-23: the checkpoint series (as "
        "`isotui experiment checkpoints -c`)",
    )
    add_duplicates_flag(p)
    add_run_flags(p, "run")
    group = p.add_argument_group("godey2024-fig6: the drift block (as isotui experiment drift-block)")
    add_param_flags(group, DriftBlockParams, skip=("device", "seed"))
    # the sites: the run flags' --modules (repeat it per glob), read as ablate reads its own
    group = p.add_argument_group("ablation: the removals (as isotui experiment ablate; sites: --modules)")
    add_param_flags(group, AblateParams, skip=("modules",))
    p.add_argument("--cache-dir", help="result cache (default ~/.cache/isotui, or $ISOTUI_CACHE_DIR)")
    p.add_argument("--no-cache", action="store_true", help="recompute, and store nothing")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    p.add_argument("--verbose", "-v", action="store_true", help="say where each result came from")


def _list(out: Any) -> int:
    from isotui.paper_figures import FIGURES

    width = max(len(n) for n in FIGURES)
    for figure in FIGURES.values():
        out.print(f"{figure.name:<{width}}  {figure.help}", highlight=False, markup=False)
    return 0


def _experiment_args(args: argparse.Namespace, experiment: str) -> argparse.Namespace:
    """The figure's flags as the experiment's own command would have parsed them."""
    from isotui.errors import IsotuiError

    ns = argparse.Namespace(**vars(args))
    ns.csv = ns.json = None
    ns.wide = None
    if experiment in ("checkpoints", "qk-dynamics"):
        if not args.checkpoints:
            raise IsotuiError(f"{args.name} needs --checkpoints (a checkpoint series)")
        if args.models and len(args.models) > 1:
            raise IsotuiError(f"{args.name} draws one series: give at most one --model")
        ns.model = args.models[0] if args.models else None
        ns.experiment = experiment
        ns.plot = None  # qk-dynamics' terminal figure: not drawn here
    elif experiment == "drift-block":
        if args.checkpoints or args.models:
            raise IsotuiError(f"{args.name} draws a drift block of its own flags: it takes no -m or -c")
        ns.experiment = "drift-block"
        ns.seed = "0" if args.seed is None else args.seed  # the run flags' "not given"
        ns.device = args.device or "auto"
        if args.at_norm is not None:  # said before the sweep runs
            from isotui.cli.figure_probes import check_at_norm

            check_at_norm(ns)
    elif experiment in ("final-norm", "gradients", "ablate"):
        from isotui.cli.figure_probes import model_args

        model_args(args, ns, experiment)
    else:
        if args.checkpoints:
            raise IsotuiError(
                f"--checkpoints is for the figures of a checkpoint series; {args.name} takes models (-m)"
            )
        ns.experiment = "run"
    return ns


def main(args: argparse.Namespace, err: Any) -> int:
    """List the figures, or draw one: check the inputs, collect the results, write the three files."""
    from isotui.cli.common import exit_code, print_error, stdout_console
    from isotui.errors import IsotuiError
    from isotui.paper_figures import HEIGHTS, WIDTHS, check_out, check_pixels, check_sidecars, find

    if args.list:
        return _list(stdout_console())
    if not args.name:
        raise IsotuiError("name a figure: isotui figure NAME --out PATH.pdf (isotui figure --list)")
    figure = find(args.name)
    if not args.out:
        raise IsotuiError(f"give --out PATH.pdf, .svg or .png for {args.name}")
    out = check_out(args.out)
    if getattr(args, "shard", None) is not None:  # a shard alone has no figure: no empty success
        raise IsotuiError(
            f"isotui figure draws whole runs: --shard {args.shard} would compute one slice and draw "
            f"nothing; run the shards with `isotui run ... --shard I/K` (the last one merges), then "
            f"`isotui figure {args.name}` with the same flags draws from the cache"
        )
    check_sidecars(out, args.force)
    if args.dpi <= 0:
        raise IsotuiError(f"--dpi {args.dpi} must be a positive number of dots per inch")
    check_pixels(WIDTHS[args.width], HEIGHTS[args.width], args.dpi, out.suffix.lower()[1:])  # before any run
    chosen = [
        f
        for f, v in (("--basis", args.basis), ("--layer", args.layer), ("--head", args.head))
        if v is not None
    ]
    if chosen and args.name not in TRAJECTORY_FIGURES:
        raise IsotuiError(
            f"{chosen[0]} is for the trajectory figures (godey2024-fig11, 12, 19-22); {args.name} takes none"
        )
    if args.remove is not None and figure.experiment != "ablate":
        raise IsotuiError(f"--remove is for the ablation figure; {args.name} takes none")
    if figure.experiment is None and (args.models or args.checkpoints):
        raise IsotuiError(f"{args.name} is drawn from a formula alone: it takes no -m or -c")
    results: list[Any] = []
    runs: list[dict[str, Any]] = []  # a probe figure's measured runs, for its JSON
    outcome = None
    if figure.experiment is not None:
        from isotui.cli.experiments import collect
        from isotui.cli.figure_probes import collect_gradients, probe_runs
        from isotui.experiments.registry import get

        ns = _experiment_args(args, figure.experiment)

        def on_error(_model: str, text: str) -> None:
            print_error(err, text)

        requests = None
        if figure.experiment == "gradients":
            outcome, requests = collect_gradients(ns, err, on_error)
        else:
            outcome = collect(get(figure.experiment), ns, err, on_error=on_error)
        results = outcome.results
        runs = probe_runs(requests, ns, results)
        if not results:
            return exit_code(outcome, err)
    if figure.name == "godey2024-fig17":
        from isotui.paper_figures import parse_dims

        parse_dims(args.dims)
    options = argparse.Namespace(**{**vars(args), "probe_runs": runs})  # the flags stay as parsed
    data, drawing = _render(figure, results, options, out.suffix.lower()[1:])
    _write(out, data, drawing, args)
    for path in (out, out.with_suffix(".csv"), out.with_suffix(".json")):
        err.print(f"wrote {path}", highlight=False)
    return exit_code(outcome, err) if outcome is not None else 0


def _render(figure: Any, results: list[Any], args: argparse.Namespace, fmt: str) -> tuple[bytes, Any]:
    from isotui.paper_figures import render

    return render(figure, results, args, fmt)


def _write(out: Any, data: bytes, drawing: Any, args: argparse.Namespace) -> None:
    """The figure, its CSV and its JSON (which records the SHA-256 of both sidecars: a redraw
    replaces them only while they are what isotui wrote), each made in memory first, then each
    written whole or not at all."""
    from isotui import __version__
    from isotui.paper_figures import WIDTHS, sidecar_bytes
    from isotui.store.files import write_output_bytes

    argv = getattr(args, "argv", None)
    payload = {
        "figure": args.name,
        "command": "isotui " + shlex.join(argv) if argv is not None else None,
        "isotui_version": __version__,
        "file": out.name,
        "csv": out.with_suffix(".csv").name,
        "width_in": WIDTHS[args.width],
        "height_in": round(float(drawing.figure.get_figheight()), 4),
        "dpi": args.dpi,
        "style": args.style,
        "runs": drawing.runs,
    }
    csv_data, json_data = sidecar_bytes(drawing.rows, payload)
    write_output_bytes(out, data, "--out")  # a symlink's target replaced, a FIFO written through
    write_output_bytes(out.with_suffix(".csv"), csv_data)
    write_output_bytes(out.with_suffix(".json"), json_data)  # last: the record of the other two
