"""The plug-in metrics in force: those registered from Python and those installed packages name in
the ``isotui.metrics`` entry point group, checked once per run before any work.

An entry point names a metric object, or a class (or function) that makes one with no arguments::

    [project.entry-points."isotui.metrics"]
    mean_share = "my_package.metrics:MeanShare"

Every run (CLI, config, app, Python API) streams every metric in force, and its name and version
are in the run's cache key: installing, removing or upgrading a plug-in never serves an entry made
without it. The protocol itself is :class:`isotui.core.plugin.StreamingMetric`.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from isotui.core import plugin as core
from isotui.core.plugin import PluginError, StreamingMetric
from isotui.results import LAYER_METRICS, LayerRow
from isotui.store.export import RUN_COLUMNS

GROUP = "isotui.metrics"

# what an entry point loaded to, by (name, value, the distribution's folder): an installed plug-in
# is imported once per process, a newly installed one found at the next run
_loaded: dict[tuple[str, str, str], StreamingMetric] = {}


def _origin(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    package = f" of {dist.name}" if dist is not None and getattr(dist, "name", None) else ""
    return f"entry point {ep.name} = {ep.value} in group {GROUP}{package}"


def _load(ep: EntryPoint) -> StreamingMetric:
    """The metric an entry point names (a class or factory called with no arguments), checked."""
    dist = getattr(ep, "dist", None)
    where = str(getattr(dist, "_path", "")) if dist is not None else ""
    key = (ep.name, ep.value, where)
    if key in _loaded:
        return _loaded[key]
    try:
        obj = ep.load()
        if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "batch")):
            obj = obj()  # a class, or a function that makes the metric
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # sys.exit at import time too: the plug-in's failure, said
        raise PluginError(
            f"metric plug-in {ep.name!r} ({_origin(ep)}) failed to load: {core.describe_exit(exc)}; "
            "fix or uninstall that package"
        ) from None
    metric = core.check_declaration(obj, _origin(ep))
    _loaded[key] = metric
    return metric


def discovered() -> dict[str, StreamingMetric]:
    """The metrics the ``isotui.metrics`` entry points installed now give, by name."""
    out: dict[str, StreamingMetric] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        metric = _load(ep)
        if metric.name in out and out[metric.name] is not metric:
            raise PluginError(f"two installed metric plug-ins are named {metric.name!r}: uninstall one")
        out[metric.name] = metric
    return out


BUILT_IN_COLUMNS = frozenset((*LayerRow.columns(), *RUN_COLUMNS))


def in_force() -> tuple[StreamingMetric, ...]:
    """Every metric in force, by name: those :func:`isotui.register_metric` registered and those
    the entry points give, each checked (its declaration, and no column that isotui or another
    plug-in already has); a :class:`~isotui.core.plugin.PluginError` names the one at fault."""
    found = discovered()
    core.set_discovered(found)
    mine = core.registered()
    clash = sorted(set(found) & set(mine))
    if clash and found[clash[0]] is not mine[clash[0]]:
        raise PluginError(
            f"metric plug-in {clash[0]!r} is both installed (entry point) and registered from Python: "
            "register yours under another name"
        )
    metrics = [({**found, **mine})[n] for n in sorted({**found, **mine})]
    owner: dict[str, str] = {}
    for m in metrics:
        for c in m.columns:
            if c in BUILT_IN_COLUMNS:
                raise PluginError(
                    f"metric plug-in {m.name!r} names a column {c!r}, which isotui's own table already "
                    "has: rename that column"
                )
            if c in owner:
                raise PluginError(
                    f"metric plug-ins {owner[c]!r} and {m.name!r} both name a column {c!r}: rename one"
                )
            owner[c] = m.name
    return tuple(metrics)


def key_part() -> list[list[str]]:
    """[[name, version], ...] of the metrics in force (sorted by name): what the cache key holds."""
    return [[m.name, m.version] for m in in_force()]


def register_metric(metric: StreamingMetric) -> None:
    """Put ``metric`` in force for this process (``isotui.register_metric``): checked at once,
    with the installed plug-ins, so a bad one is refused here and not halfway through a run."""
    before = core.registered().get(getattr(metric, "name", ""))
    core.register(metric)
    try:
        in_force()
    except PluginError:
        core.unregister(metric.name)
        if before is not None:
            core.register(before)
        raise


def unregister_metric(name: str) -> None:
    """Take a metric registered with :func:`register_metric` out of force."""
    core.unregister(name)


def layer_metric_names() -> tuple[str, ...]:
    """The layer metrics a plot, a heatmap or ``--wide`` can show: the built-in ones, then the
    columns of the plug-ins in force."""
    return LAYER_METRICS + tuple(c for m in in_force() for c in m.columns)
