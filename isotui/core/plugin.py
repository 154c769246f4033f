"""Your own layer metrics: the protocol a streaming metric follows, and the metrics in force.

A plug-in metric sees every kept vector of a layer (padding out, special tokens per
``--special-tokens``, the same units as ``avg_cos``) one batch at a time and keeps a *state*: a
dict of named float64 tensors of fixed shapes, so that it lives beside isotui's own sums in a
shard's cached state (safetensors, no pickle) and merges across shards::

    state = metric.empty(dim, device)                       # the state of no vectors
    state = metric.merge(state, metric.batch(x))            # per batch, x: (m, dim) float64
    merged = metric.merge(state_of_shard_0, state_of_shard_1)  # disjoint vectors, any order
    values = metric.finalize(state)                          # one float per column

``merge`` must be associative and commutative over disjoint sets of vectors, with ``empty`` its
identity (so any batching and any split into shards give the same numbers, to float64 rounding).
Each state tensor keeps the shape it has in ``empty(dim)`` (checked after every batch and merge).

This module is numerics only: the protocol, a checked wrapper (:class:`Plugged`) that turns a
plug-in's mistakes into one sentence naming it, and the registry of metrics in force (those
registered from Python, :func:`register`, and those found through the ``isotui.metrics`` entry
point group, set by :mod:`isotui.plugins`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar, runtime_checkable

from isotui.errors import IsotuiError

if TYPE_CHECKING:
    import torch

State: TypeAlias = "dict[str, torch.Tensor]"  # a plug-in's state: named float64 tensors
_T = TypeVar("_T")
STATE_PREFIX = "plugin."  # a plug-in's tensors in a layer state: plugin.<name>.<tensor>


@runtime_checkable
class StreamingMetric(Protocol):
    """What a plug-in metric provides. ``name`` identifies it (letters, digits, ``_``); bump
    ``version`` whenever its numbers change (it is part of the cache key); ``columns`` are the
    per-layer float columns it adds (CSV, JSON, table, ``--wide``, the app's plot cycle)."""

    name: str
    version: str
    columns: tuple[str, ...]

    def empty(self, dim: int, device: torch.device) -> State:
        """The state of no vectors of dimension ``dim`` (the identity of :meth:`merge`)."""
        ...

    def batch(self, x: torch.Tensor) -> State:
        """The state of one batch's vectors ``x`` ((m, dim) float64, on the layer's device)."""
        ...

    def merge(self, a: State, b: State) -> State:
        """The state of the union of two disjoint sets of vectors."""
        ...

    def finalize(self, state: State) -> Sequence[float]:
        """One value per column (NaN where undefined, e.g. no vectors)."""
        ...


class PluginError(IsotuiError):
    """A plug-in metric that broke its protocol: one sentence naming it."""


def describe_exit(exc: BaseException) -> str:
    """``ValueError: bad`` for a failure inside a plug-in; ``it called sys.exit(3)`` for a
    :class:`SystemExit` (a plug-in's end of the process is its failure, not isotui's exit)."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r}), which isotui takes as the plug-in's failure"
    return f"{type(exc).__name__}: {exc}"


def _identifier(text: object) -> bool:
    return isinstance(text, str) and text.isidentifier() and text.isascii()


def check_declaration(metric: object, origin: str = "") -> StreamingMetric:
    """``metric`` if it declares what the protocol asks (a name, a version, columns and the four
    methods), else :class:`PluginError` naming it (``origin``: where it came from)."""
    name = getattr(metric, "name", None)
    said = f"metric plug-in {name!r}" if isinstance(name, str) else f"metric plug-in {metric!r}"
    said += f" ({origin})" if origin else ""
    if not _identifier(name):
        raise PluginError(f"{said} needs a name of letters, digits and _ (got {name!r})")
    if not isinstance(getattr(metric, "version", None), str):
        raise PluginError(f"{said} needs a version string (it is part of the cache key)")
    columns = getattr(metric, "columns", None)
    if not isinstance(columns, tuple) or not columns or not all(_identifier(c) for c in columns):
        raise PluginError(f"{said} needs columns: a non-empty tuple of names of letters, digits and _")
    if len(set(columns)) != len(columns):
        raise PluginError(f"{said} names a column twice: {', '.join(columns)}")
    missing = [m for m in ("empty", "batch", "merge", "finalize") if not callable(getattr(metric, m, None))]
    if missing:
        raise PluginError(
            f"{said} has no {', '.join(missing)} method (see isotui.core.plugin.StreamingMetric)"
        )
    assert isinstance(metric, StreamingMetric)
    return metric


class Plugged:
    """A plug-in metric for one layer of dimension ``dim``, every call checked: an exception or
    a state of other names or shapes becomes one :class:`PluginError` sentence naming it."""

    def __init__(self, metric: StreamingMetric, dim: int, device: torch.device) -> None:
        self.metric = metric
        self.name = metric.name
        self.dim = dim
        self.device = device
        empty = self._call("empty", lambda: metric.empty(dim, device))
        self.shapes = self._shapes("empty", empty)
        self.empty_state = empty

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        """``fn()``, its failure the plug-in's: any exception, and any BaseException short of
        KeyboardInterrupt (``sys.exit`` in a plug-in would end isotui without a word and lose
        the other models' results), becomes one sentence naming it; out of memory stays itself
        (the batch loop backs off and retries)."""
        try:
            return fn()
        except (PluginError, KeyboardInterrupt):
            raise
        except (MemoryError, RuntimeError) as exc:
            if "out of memory" in str(exc).lower() or isinstance(exc, MemoryError):
                raise  # the device's memory, not the plug-in: the batch loop backs off and retries
            raise self._failed(what, exc) from exc
        except BaseException as exc:
            raise self._failed(what, exc) from exc

    def _failed(self, what: str, exc: BaseException) -> PluginError:
        said = describe_exit(exc)
        return PluginError(
            f"metric plug-in {self.name!r} failed in {what}() on a layer of dimension {self.dim}: {said}"
        )

    def _shapes(self, what: str, state: object) -> dict[str, tuple[int, ...]]:
        import torch

        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise PluginError(
                f"metric plug-in {self.name!r}: {what}() must return a dict of named tensors "
                f"(got {type(state).__name__})"
            )
        bad = [k for k in state if not _identifier(k)]
        if bad:
            raise PluginError(
                f"metric plug-in {self.name!r}: state names must be identifiers (got {bad[0]!r})"
            )
        return {k: tuple(v.shape) for k, v in state.items()}

    def check(self, what: str, state: object) -> State:
        """``state`` if it has the names and shapes of the empty state, else a PluginError."""
        shapes = self._shapes(what, state)
        if shapes != self.shapes:
            want = ", ".join(f"{k} {list(s)}" for k, s in self.shapes.items())
            got = ", ".join(f"{k} {list(s)}" for k, s in shapes.items())
            raise PluginError(
                f"metric plug-in {self.name!r}: {what}() returned a state of shapes {got}, not those "
                f"of its empty state for dimension {self.dim} ({want})"
            )
        assert isinstance(state, dict)
        return state

    def batch(self, x: torch.Tensor) -> State:
        return self.check("batch", self._call("batch", lambda: self.metric.batch(x)))

    def merge(self, a: State, b: State) -> State:
        return self.check("merge", self._call("merge", lambda: self.metric.merge(a, b)))

    def finalize(self, state: State) -> dict[str, float]:
        """Column -> value; a PluginError unless one real number per column."""
        values = self._call("finalize", lambda: self.metric.finalize(state))
        columns = self.metric.columns
        try:
            out = [float(v) for v in values]
        except (TypeError, ValueError):
            out = []
        if len(out) != len(columns):
            raise PluginError(
                f"metric plug-in {self.name!r}: finalize() must return {len(columns)} numbers, one per "
                f"column ({', '.join(columns)}), got {values!r}"
            )
        return dict(zip(columns, out, strict=True))  # inf and -inf as they are, NaN where undefined


# --- the metrics in force ------------------------------------------------------------------------

_registered: dict[str, StreamingMetric] = {}  # from Python: register()
_discovered: dict[str, StreamingMetric] = {}  # from entry points: set by isotui.plugins


def register(metric: StreamingMetric) -> None:
    """Put ``metric`` in force for this process (replacing one of the same name)."""
    checked = check_declaration(metric)
    _registered[checked.name] = checked


def unregister(name: str) -> None:
    """Take the metric ``name`` registered with :func:`register` out of force (no-op if none)."""
    _registered.pop(name, None)


def registered() -> dict[str, StreamingMetric]:
    """The metrics registered from Python, by name."""
    return dict(_registered)


def set_discovered(metrics: Mapping[str, StreamingMetric]) -> None:
    """The metrics the entry points give now (:func:`isotui.plugins.in_force` refreshes them)."""
    global _discovered
    _discovered = dict(metrics)  # replaced whole: a lookup in another thread sees one or the other


def column_owner(column: str) -> StreamingMetric | None:
    """The metric in force that declares ``column``, if any (its description in the tables)."""
    for metric in (*_registered.values(), *_discovered.values()):
        if column in metric.columns:
            return metric
    return None


def lookup(name: str) -> StreamingMetric:
    """The metric ``name`` in force (a state holding it is being rebuilt); ValueError if none."""
    found = _registered.get(name) or _discovered.get(name)
    if found is None:
        raise ValueError(f"the layer state holds plug-in metric {name!r}, which is not in force")
    return found
