"""``isotui figure``'s part for the probes' figures over models: ``machina2024-final-norm``
(the final-norm experiment), ``gradient-energy`` (the gradients experiment, once per ``--ks``
k, each run cached on its own) and ``ablation`` (the ablate experiment, ``--remove`` and
``--modules`` as it parses them), and the cache keys the figure's JSON names.

Kept apart from :mod:`isotui.cli.figure` so that the figures of other experiments add their own
cases without touching these.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import Any


def model_args(args: argparse.Namespace, ns: argparse.Namespace, experiment: str) -> None:
    """The figure's flags as ``isotui experiment final-norm|gradients|ablate`` would have parsed them:
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


def check_at_norm(ns: argparse.Namespace) -> None:
    """godey2024-fig9's ``--at-norm``: one of the sweep's N, checked against the drift block's
    own flags before anything runs."""
    from isotui.cli.experiments import params_from_args
    from isotui.experiments.drift_block import config_from_params
    from isotui.experiments.registry import get
    from isotui.paper_figures_probes import parse_at_norm

    parse_at_norm(ns.at_norm, config_from_params(params_from_args(get("drift-block"), ns)).norms)


def collect_gradients(
    ns: argparse.Namespace, err: Any, on_error: Callable[[str, str], None]
) -> tuple[Any, list[Any]]:
    """gradient-energy's runs: the model's gradients once per k of ``--ks`` (each its own cache
    entry), the smallest k first; its hidden size then checks the other k before they run, and a
    k the model cannot take is said in terms of ``--ks``. (The outcome, the requests measured.)"""
    from isotui.cli.experiments import collect, make_requests
    from isotui.errors import IsotuiError
    from isotui.experiments.registry import get
    from isotui.paper_figures_probes import parse_ks

    experiment = get("gradients")
    ks = parse_ks(ns.ks)
    (first,) = make_requests(experiment, ns)

    def said(model: str, text: str) -> None:
        on_error(
            model, text.replace(f"--top-k {ks[0]} ", f"k = {ks[0]} of --ks ").replace("use --top-k", "use k")
        )

    requests = [replace(first, top_k=ks[0])]
    outcome = collect(experiment, ns, err, on_error=said, requests=requests)
    if not outcome.results or len(ks) == 1:
        return outcome, requests
    d = min(row.dim for row in outcome.results[0].rows)
    if ks[-1] >= d:
        raise IsotuiError(f"--ks {ns.ks}: every k must be below the hidden size {d} of model {first.model!r}")
    rest = [replace(first, top_k=k) for k in ks[1:]]
    more = collect(experiment, ns, err, on_error=on_error, requests=rest)
    outcome.results += more.results
    outcome.rows += more.rows
    outcome.failed += more.failed
    outcome.internal += more.internal
    outcome.total += more.total
    return outcome, requests + rest


def probe_runs(
    requests: list[Any] | None, ns: argparse.Namespace, results: list[Any]
) -> list[dict[str, Any]]:
    """The JSON's runs of a final-norm, gradients or ablate figure: each measured request's model,
    k and cache key (its file in the cache's final-norm/, gradients/ or ablate/ folder); empty for the other
    figures (their results carry their keys)."""
    if ns.experiment not in ("final-norm", "gradients", "ablate") or not results:
        return []
    from isotui.cli.experiments import make_requests
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
