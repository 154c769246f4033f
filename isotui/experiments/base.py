"""The Experiment contract: what every experiment declares, so that the CLI (its parser and its
one loop over models or series), the result cache, the CSV/JSON export, ``cache ls/rm``, the
Python API and the app read one table (:mod:`isotui.experiments.registry`) instead of knowing
each experiment.

An experiment is:

- a **request** type (:class:`Request`): one hashable job (a model's spec and the experiment's
  parameters, a checkpoint series, a drift-block configuration) that knows how to answer from the
  cache (quick: ``lookup``) and how to compute (long: ``compute``, which also stores the result);
  and both in one pass (``measure``, the CLI's and the API's path, see :meth:`Experiment.run`);
  the app's backend runs requests as they are;
- a **result** type (whatever ``compute`` returns; a list of results for final-norm);
- its cache **folder** and **schema** number under the result cache's root, and the **keys** its
  result is stored under (:meth:`Request.keys`);
- **rows** (the ``--csv`` rows, dicts in column order) and **payload** (the ``--json``
  document) of a list of results;
- **decode**: a cache entry back into a result (``isotui.load``, ``isotui show``);
- its terminal **view**: a *name*, resolved in the views layer (:mod:`isotui.views`), so that no
  experiment imports rich tables, plotext figures or the CLI;
- its own **parameters** (``params``: a frozen dataclass declared with
  :func:`isotui.experiments.params.param`, beyond what its ``inputs`` kind and the run options
  give: the command line's flags, the API's keywords come from its fields) and how a request is
  made from them;
- its **lab tab**, if it has one: a ``"module:attr"`` string naming the tab's class in
  :mod:`isotui.tui` (imported when the app's lab opens, never here), from which the lab composes
  its tabs, their keys and their result slots.

Nothing here imports torch, argparse, rich or a front end.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Generic, Literal, Protocol, TypeVar, runtime_checkable

import numpy as np

from isotui.experiments.params import NoParams
from isotui.extract.progress import ProgressCallback, StopCheck, never_stop, no_progress

if TYPE_CHECKING:
    from isotui.experiments.checkpoint import Checkpoint
    from isotui.experiments.plans import ExperimentPlan
    from isotui.extract.memory_plan import MemoryPlan
    from isotui.spec import RunSpec
    from isotui.store.cache import ResultCache

Notice = Callable[[str], None]
Rows = list[dict[str, object]]  # the --csv rows, each a dict in column order
Payload = dict[str, object]  # the --json document
Arrays = dict[str, np.ndarray]
Inputs = Literal["models", "series", "config"]
PartProgress = Callable[[int, "Checkpoint"], AbstractContextManager[ProgressCallback]]

S = TypeVar("S")  # what an experiment's request is made of: a RunSpec, a series triple or None
R = TypeVar("R")  # what one request gives: its experiment's result (a list of them for final-norm)
R_co = TypeVar("R_co", covariant=True)
P = TypeVar("P")  # an experiment's parameters (the options its front ends take)
Q = TypeVar("Q", bound="Request[object]")  # an experiment's request: one job
T = TypeVar("T")  # an experiment's result, as its rows, payload and views read it


class Attempt(Protocol):
    """``attempt(name, fn, *args)``: ``fn(*args)``'s value, or None once its failure is said."""

    def __call__(self, name: str, fn: Callable[..., R], /, *args: object) -> R | None: ...


def ignore_notice(_text: str) -> None:
    """Default: drop notices."""


@dataclass(frozen=True)
class Context:
    """Where and how a request runs.

    ``cache_root``: the result cache's root (None: ``--no-cache``, read nothing, store nothing);
    ``on_progress``/``should_stop``: progress events and cancellation; ``notice``: one sentence
    worth saying that is not a failure (a damaged cache entry, a cache that cannot be written).
    For a series: ``attempt`` runs one checkpoint, says its failure and goes on (None: the first
    failure ends the series); ``part_progress(i, checkpoint)`` gives that checkpoint's progress
    callback (None: one bar over the whole series, from ``on_progress``).
    """

    cache_root: Path | None = None
    on_progress: ProgressCallback = no_progress
    should_stop: StopCheck = never_stop
    notice: Notice = ignore_notice
    attempt: Attempt | None = None
    part_progress: PartProgress | None = None


@runtime_checkable
class Request(Protocol[R_co]):
    """One job of an experiment, giving ``R_co`` (its result): hashable (identical jobs in flight
    are merged), with what the jobs pane shows (``model``), which device lane it runs on
    (``device``) and the two steps the app's backend calls (signatures kept as the backend calls
    them)."""

    kind: ClassVar[str]

    @property
    def model(self) -> str: ...

    @property
    def device(self) -> str: ...

    def keys(self, cache_root: Path | None) -> list[str]:
        """The cache keys its result is (or would be) stored under, in its experiment's folder."""
        ...

    def lookup(self, cache_root: Path | None, notice: Notice) -> R_co | None:
        """The cached result, or None (nothing computed; a damaged entry is said and ignored)."""
        ...

    def measure(self, context: Context) -> R_co:
        """The cached result when there is one, else computed and stored (one resolution)."""
        ...

    def compute(self, context: Context) -> R_co:
        """Compute (loading the model) and store the result; raises IsotuiError in one sentence."""
        ...


class OneModelJob:
    """What the jobs pane reads of a job over one model's run spec: the model it names and the
    device lane it runs on (the layer run's, attention's and the cached experiments' requests)."""

    spec: RunSpec

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def device(self) -> str:
        return self.spec.device


@dataclass(frozen=True)
class Experiment(Generic[S, P, Q, T]):
    """One registered experiment (see the module's docstring for each field's meaning), generic
    in its input ``S`` (a model's RunSpec, a series' (series, checkpoints, spec) triple, or None
    for a config experiment), its parameters ``P``, its request ``Q`` and its result ``T`` (a
    request of final-norm gives a list of ``T``)."""

    name: str  # the subcommand: `isotui experiment NAME` (or `isotui run` for layers)
    help: str
    request_type: type[Q]
    result_type: type[T]
    folder: str | None  # cache folder under the root; None: its parts are cached by others
    make_request: Callable[[S, P], Q]  # (spec | series | None, params) -> request
    rows: Callable[[list[T]], Rows]  # of every request's results, flattened
    payload: Callable[[list[T]], Payload]
    schema: int = 1  # its cache entries' schema: raised when old entries cannot be read
    inputs: Inputs = "models"  # models (-m, repeatable), series (--model/--checkpoints) or config
    # the terminal view's name in isotui.views.VIEWS; None: the one named as the experiment, else
    # (no view of that name) its CSV rows as a table
    view: str | None = None
    # its own parameters (a dataclass of param() fields); the default fits only P = NoParams, a
    # constraint on a type argument that a default cannot state
    params: type[P] = NoParams  # type: ignore[assignment]
    # one cache entry: its JSON as read back (json.loads' untyped value) and its arrays
    decode: Callable[[dict[str, object], Arrays], T | list[T]] | None = None
    check: Callable[[P], None] = lambda _params: None  # parameters said before any work
    command: str = "experiment"  # "run": a top-level command of its own
    # the scopes of run options it takes (isotui.spec: MODEL, LAYER_METRICS, RESERVOIR, SHARD);
    # every experiment that streams a model takes "model" (--data, --device, --max-samples,
    # --seed...); () for one that builds its own model from its own options (drift-block)
    run_options: tuple[str, ...] = ("model",)
    what: str = "models"  # what the closing failure line counts
    # --dry-run: a request's memory plan from the config alone (isotui.experiments.plans); None
    # for an experiment that streams no model
    # (the layer run's a MemoryPlan, the other experiments' an ExperimentPlan)
    plan: Callable[[Q], MemoryPlan | ExperimentPlan] | None = None
    # its tab in the app's lab: "module:attr" of a LabTab subclass (isotui.tui.lab_tab); None: no tab
    lab_tab: str | None = None

    @property
    def run_flags(self) -> bool:
        """Whether it takes run options at all (the data and extraction flags of ``isotui run``)."""
        return bool(self.run_options)

    def request(self, spec: S, params: P) -> Q:
        """The request ``spec`` (a RunSpec; a (series, checkpoints, spec) triple; None for a
        config experiment, which reads its own parameters) and the parameters stand for."""
        return self.make_request(spec, params)

    def lookup(self, request: Request[R], context: Context) -> R | None:
        """The cached result of ``request``, or None."""
        return request.lookup(context.cache_root, context.notice)

    def compute(self, request: Request[R], context: Context) -> R:
        """Compute ``request`` (and store its result when ``context`` has a cache)."""
        return request.compute(context)

    def run(self, request: Request[R], context: Context) -> R:
        """The cached result when there is one, else computed and stored, in one pass (the
        CLI's and the Python API's path; a series' checkpoints each cached on their own)."""
        return request.measure(context)

    def cache(self, root: Path) -> ResultCache:
        """This experiment's folder of the result cache at ``root``."""
        from isotui.store.cache import ResultCache

        if self.folder is None:
            raise ValueError(f"experiment {self.name} has no cache folder of its own")
        return ResultCache(root, folder=self.folder, schema=self.schema)


def flatten(results: list[T | list[T]]) -> list[T]:
    """Results of several requests as one list (a request may give a list, as final-norm does)."""
    out: list[T] = []
    for r in results:
        out.extend(r if isinstance(r, list) else [r])
    return out
