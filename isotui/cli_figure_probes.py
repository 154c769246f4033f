"""``isotui figure``'s part for the probes' figures over models: ``machina2024-final-norm``
(the final-norm experiment) and ``gradient-energy`` (the gradients experiment, once per ``--ks``
k, each run cached on its own), and the cache keys the figure's JSON names.

Kept apart from :mod:`isotui.cli_figure` so that the figures of other experiments add their own
cases without touching these.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any


def model_args(args: argparse.Namespace, ns: argparse.Namespace, experiment: str) -> None:
    """The figure's flags as ``isotui experiment final-norm|gradients`` would have parsed them:
    one model (the figure draws one), the final norm only, the first k for the parser's check."""
    from isotui.errors import IsotuiError

    if args.checkpoints:
        raise IsotuiError(
            f"--checkpoints is for the machina2024 series figures; {args.name} takes one model (-m)"
        )
    if args.models and len(args.models) > 1:
        raise IsotuiError(f"{args.name} draws one model: give at most one --model")
    ns.experiment = experiment
    ns.every_layer = False
    if experiment == "gradients":
        from isotui.paper_figures_probes import parse_ks

        ns.top_k = parse_ks(args.ks)[0]


def probe_requests(experiment: str, ns: argparse.Namespace) -> list[Any] | None:
    """gradient-energy's requests: the model's gradients run once per k of ``--ks`` (each its
    own cache entry); None for every other figure (the experiment's own requests)."""
    if experiment != "gradients":
        return None
    from isotui.cli_experiments import make_requests
    from isotui.experiments.registry import get
    from isotui.paper_figures_probes import parse_ks

    (first,) = make_requests(get("gradients"), ns)
    return [replace(first, top_k=k) for k in parse_ks(ns.ks)]


def probe_runs(
    requests: list[Any] | None, ns: argparse.Namespace, results: list[Any]
) -> list[dict[str, Any]]:
    """The JSON's runs of a final-norm or gradients figure: each measured request's model, k and
    cache key (its file in the cache's final-norm/ or gradients/ folder); empty for the other
    figures (their results carry their keys)."""
    if ns.experiment not in ("final-norm", "gradients") or not results:
        return []
    from isotui.cli_experiments import make_requests
    from isotui.experiments.registry import get
    from isotui.paths import cache_dir

    root = None if ns.no_cache else cache_dir(ns.cache_dir)
    runs: list[dict[str, Any]] = []
    for request in requests if requests is not None else make_requests(get(ns.experiment), ns):
        run: dict[str, Any] = {"model": request.model}
        if ns.experiment == "gradients":
            run["top_k"] = request.top_k
        run["key"] = request.keys(root)[0]
        runs.append(run)
    return runs
