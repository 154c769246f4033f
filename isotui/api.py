"""The Python API, for notebooks: ``isotui.run``, ``isotui.experiment``, ``isotui.load``.

Each call stands on the service (:mod:`isotui.service`), as the command line does: the keywords
are the experiment's run options (:mod:`isotui.spec`) and parameters (its ``params`` dataclass),
checked by the same code and said in the same sentences (raised as
:class:`~isotui.errors.IsotuiError`); the same requests run through the same result cache. So the
numbers, the cache entries and the files of :meth:`Result.to_csv` / :meth:`Result.to_json` are
the CLI's, byte for byte. Nothing here imports argparse, rich, textual or a front end; showing a
result's tables loads the terminal views by name (:meth:`Experiment.terminal_view`) only then,
and torch loads only when a model must run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isotui.errors import IsotuiError

if TYPE_CHECKING:
    from tqdm import tqdm as Tqdm

    from isotui.experiments.base import Experiment
    from isotui.extract.progress import Progress, ProgressCallback
    from isotui.results import Outcome

# keywords that are command-line outputs, not options of the Python API
_NOT_OPTIONS = ("csv", "json", "quiet", "wide_csv", "verbose", "no_cache", "dry_run")


@dataclass
class Result:
    """One command's result, as the CLI prints and writes it.

    ``rows``: the ``--csv`` rows (dicts, keys in column order); ``payload``: the ``--json``
    document; ``results``: the experiment's own result objects (a layer run's
    :class:`~isotui.results.ModelResult`, with ``.rows``, ``.meta``, ``.arrays``...); ``tables``:
    the rich tables the CLI prints (drawn on first use: ``show()``, or display the object in a
    notebook).
    """

    command: str
    models: list[str]
    rows: list[dict[str, Any]] = field(repr=False)
    payload: dict[str, Any] = field(repr=False)
    results: list = field(repr=False)
    params: Any = field(default=None, repr=False)  # the experiment's parameters (what a view shows)
    _tables: list | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        key = f", key={self.key[:12]}" if self.key else ""
        return f"Result({self.command}, models={self.models}, {len(self.rows)} rows{key})"

    @property
    def result(self):
        """The one result object (a run of one model), e.g. a ``ModelResult``."""
        if len(self.results) != 1:
            raise IsotuiError(f"this result holds {len(self.results)} results; use .results")
        return self.results[0]

    @property
    def key(self) -> str | None:
        """The cache key (``isotui.load(key)`` reopens it), for results that are cached by one."""
        return getattr(self.results[0], "key", None) if len(self.results) == 1 else None

    @property
    def tables(self) -> list:
        """The renderables the CLI prints for this result, in order (rich tables, figures)."""
        if self._tables is None:
            self._tables = _tables(self.command, self.results, self.params)
        return self._tables

    def sample(self, layer: int, component: str | None = None) -> Any:
        """Layer ``layer``'s reservoir sample, for a layer run made with ``save_sample=PATH``
        (the cache keeps no sample): an :class:`~isotui.extract.sample.LayerSample` with
        ``vectors`` (n x d float32, by sample then position), ``sample_index`` and ``position``
        (where each came from in the data), ``token_ids`` and ``tokens`` (their text; -1 and ""
        where the units are not tokens: images, audio). ``component``: ``encoder`` or
        ``decoder`` for an encoder-decoder model."""
        found = getattr(self.result, "sample", None)
        if found is None:
            raise IsotuiError(
                "this result holds no reservoir sample: run it with save_sample=PATH (the cache keeps none)"
            )
        if component is None:
            if len(found) != 1:
                raise IsotuiError(f"give component=, one of {', '.join(found)}")
            component = next(iter(found))
        if component not in found:
            raise IsotuiError(f"no component {component!r}; this model has {', '.join(found)}")
        layers = found[component]
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(layers):
            raise IsotuiError(f"layer must be 0 to {len(layers) - 1} (got {layer!r})")
        return layers[layer]

    def to_csv(self, path: str | Path) -> Path:
        """Write the table as the CLI's ``--csv`` does (the same bytes); returns the path."""
        from isotui.store.export import write_dicts_csv

        return write_dicts_csv(self.rows, Path(path))

    def to_json(self, path: str | Path) -> Path:
        """Write everything as the CLI's ``--json`` does (NaN as null); returns the path."""
        from isotui.store.export import write_payload_json

        return write_payload_json(self.payload, Path(path))

    def to_pandas(self):
        """The rows as a pandas DataFrame (columns in CSV order); needs pandas installed."""
        try:
            import pandas as pd
        except ImportError:
            raise IsotuiError("to_pandas needs pandas: pip install pandas") from None
        return pd.DataFrame.from_records(self.rows, columns=list(self.rows[0]) if self.rows else None)

    def show(self, console=None) -> None:
        """Print the tables the CLI prints (to ``console``, default a new rich console)."""
        _display().show(self.tables, console)

    def __rich_console__(self, console, options):
        yield from self.tables

    def _repr_html_(self) -> str:
        """Jupyter shows the tables, coloured as in the terminal."""
        return str(_display().html(self.tables))


class Results(list):
    """Several models' :class:`Result` (one per model, in the order asked), plus their common
    table: ``rows``, ``to_csv`` and ``to_json`` give what the CLI writes for all of them at once
    (``isotui run -m A -m B --csv ...``)."""

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [row for r in self for row in r.rows]

    @property
    def payload(self) -> dict[str, Any]:
        return {"results": [x for r in self for x in r.payload["results"]]}

    to_csv = Result.to_csv
    to_json = Result.to_json
    to_pandas = Result.to_pandas

    def show(self, console=None) -> None:
        for r in self:
            r.show(console)


def run(
    model: str | Sequence[str] | Any = None,
    data: str | None = None,
    *,
    tokenizer: Any = None,
    processor: Any = None,
    name: str | None = None,
    config: str | Path | None = None,
    max_samples: int | None = None,
    max_length: int | None = None,
    special_tokens: str | None = None,
    batch_size: int | str | None = None,
    device: str | None = None,
    device_map: str | None = None,
    max_memory: str | dict[int | str, str | int] | None = None,
    dtype: str | None = None,
    seed: int | None = None,
    reservoir: int | None = None,
    map_units: str | None = None,
    trust_remote_code: bool | None = None,
    shard: str | None = None,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    progress: bool | None = None,
    **more: Any,
) -> Result | Results:
    """Layer-wise anisotropy, as ``isotui run`` (same defaults: ``data`` builtin, the model's
    length limit up to 512, 4096-vector reservoir, seed 0, ...; ``config`` a TOML file or preset
    whose settings the keywords override). One model name gives a :class:`Result`; a list gives
    :class:`Results`, one per model. ``cache=False`` recomputes and stores nothing; progress shows
    where a person is watching (see :func:`watching`), ``progress=False`` silences it and
    ``progress=True`` shows it anywhere. ``shard="I/K"``: one slice of a
    sharded run (``--shard``), an empty result until the shard that merges all K.
    ``device_map="auto"`` with ``max_memory="0=70GiB,cpu=200GiB"`` (or ``{0: "70GiB", "cpu": ...}``):
    the model across devices through accelerate (``--device-map``, ``--max-memory``). Any other
    flag of ``isotui run`` is a keyword too (``threads=4``, ``exact=True``, ``stream=True``,
    ``tokenizer="minilm"``, ``modules=["attn_out"]``: any module's output, see ``--modules``); a
    keyword it does not have is an :class:`IsotuiError` naming them.

    ``model`` may also be a model object already in memory: a transformers model (with
    ``tokenizer=`` for text, ``processor=`` for images or audio), a timm model, or a plain
    ``torch.nn.Module`` (see :mod:`isotui.models.given` for its call convention), measured on
    whatever device it sits, never copied, moved or cast, through the same extraction as a model
    named (the same numbers on the same weights). It runs in eval mode and gets its train/eval flags
    back afterwards, and the process its torch thread count. Its rows are named ``name=``, else the
    folder or id it was loaded from (``config.name_or_path``), else its class. The cache keys it by
    a SHA-256 of its weights, structure and tokenizer (a changed weight is a new key;
    ``cache=False`` skips the hash, about 2 s per GB on one CPU core). The keywords that say how to
    load a name (``device``, ``device_map``, ``max_memory``, ``dtype``, ``trust_remote_code``,
    ``shard``) are refused with an object."""
    from isotui import service
    from isotui.experiments.registry import LAYERS

    if _is_object(model):
        options: dict[str, Any] = {"data": data, "max_samples": max_samples, "max_length": max_length}
        options |= {"special_tokens": special_tokens, "batch_size": batch_size, "device": device}
        options |= {"device_map": device_map, "max_memory": max_memory, "dtype": dtype, "seed": seed}
        options |= {"reservoir": reservoir, "map_units": map_units, "trust_remote_code": trust_remote_code}
        given, requests, params, settings = _object_layers(
            model, tokenizer, processor, name, config, cache_dir, {**options, **more}, shard
        )
        root = _cache_root(cache, settings.get("cache_dir"))
        with given.kept():
            outcome = _one(LAYERS, requests, root, progress)
        return _results(LAYERS, [([given.name], outcome)], params, True)
    if processor is not None or name is not None:
        raise IsotuiError(
            f"{'processor' if processor is not None else 'name'}= goes with a model object; a model "
            "given by name loads its own processor and is named as given"
        )
    if tokenizer is not None:
        more["tokenizer"] = tokenizer

    if isinstance(max_memory, dict):  # the flag's own form
        max_memory = ",".join(f"{k}={v}" for k, v in max_memory.items())
    options = {
        "data": data,
        "max_samples": max_samples,
        "max_length": max_length,
        "special_tokens": special_tokens,
        "batch_size": batch_size,
        "device": device,
        "device_map": device_map,
        "max_memory": max_memory,
        "dtype": dtype,
        "seed": seed,
        "reservoir": reservoir,
        "map_units": map_units,
        "trust_remote_code": trust_remote_code,
        "shard": shard,
        **more,
    }
    run_options, params = _split(LAYERS, "isotui.run", options)
    models = None if model is None else _model_names(model)
    path = service.config_path(config)
    settings = service.run_settings(path, {"models": models, "cache_dir": cache_dir, **run_options})
    requests = service.layer_requests(settings, path, params)
    root = _cache_root(cache, settings.get("cache_dir"))
    outcomes = [([r.model], _one(LAYERS, [r], root, progress)) for r in requests]
    single = isinstance(model, str | Path) or (model is None and len(requests) == 1)
    return _results(LAYERS, outcomes, params, single)


def experiment(
    name: str,
    *,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    progress: bool | None = None,
    **options: Any,
) -> Result | Results:
    """One of the experiments of ``isotui experiment NAME`` (attention, final-norm, gradients,
    qk-dynamics, checkpoints, drift-block, token-types, ablate), with its flags as keywords
    (``max_samples=200``, ``every_layer=True``, ``checkpoints=["step1000", "step2000"]``...).
    Experiments over models
    take ``model`` (a name, or a list: :class:`Results`; or a model object with ``tokenizer=``
    or ``processor=`` and ``name=``, as :func:`run` takes one); the series experiments take
    ``model`` and ``checkpoints`` (and ``skip_duplicates``); drift-block takes its own sizes.
    ``shard="I/K"`` (ablate, as :func:`run`): a shard that is not the last keeps its partial
    state and gives no results (``.results == []``); the last gives the merged one."""
    from isotui import service
    from isotui.experiments.registry import EXPERIMENTS

    if not isinstance(name, str) or name not in EXPERIMENTS:
        raise IsotuiError(f"no experiment {name!r}; experiments: {', '.join(EXPERIMENTS)}")
    exp = EXPERIMENTS[name]
    what = f"experiment {name!r}"
    inputs = {"models": ("model",), "series": ("model", "checkpoints", "skip_duplicates"), "config": ()}
    given = {k: options.pop(k) for k in inputs[exp.inputs] if k in options}
    root = _cache_root(cache, cache_dir)
    model = given.get("model")
    if _is_object(model) and exp.inputs != "models":
        raise IsotuiError(f"{what} takes model names, not a model object")
    if _is_object(model):  # its tokenizer=, processor= and name= are the object's, not options
        obj, requests, params = _object_requests(exp, model, options)
        with obj.kept():
            outcome = _one(exp, requests, _cache_root(cache, cache_dir), progress)
        return _results(exp, [([obj.name], outcome)], params, True)
    run_options, params = _split(exp, what, options)
    if exp.inputs == "models":
        model = given.get("model", "minilm")
        names = _model_names(model)
        requests = service.make_requests(exp, params, models=names, options=run_options, notice=_say)
        outcomes = [([r.model], _one(exp, [r], root, progress)) for r in requests]
        return _results(exp, outcomes, params, isinstance(model, str | Path))
    if exp.inputs == "series":
        checkpoints = given.get("checkpoints")
        if not checkpoints:
            raise IsotuiError(
                f"{what} needs checkpoints=: the series' revisions, model ids or folders "
                "(a list, or one comma-separated string)"
            )
        series = service.Series(
            None if given.get("model") is None else str(given["model"]),
            tuple(str(c) for c in ([checkpoints] if isinstance(checkpoints, str | Path) else checkpoints)),
            bool(given.get("skip_duplicates", False)),
        )
        requests = service.make_requests(exp, params, series=series, options=run_options, notice=_say)
        names = [] if series.model is None else [series.model]
    else:
        requests, names = service.make_requests(exp, params), []
    return _results(exp, [(names, _one(exp, requests, root, progress))], params, True)


def check_object(
    name: str,
    model: Any,
    data: str | None = None,
    *,
    tokenizer: Any = None,
    processor: Any = None,
    **options: Any,
) -> None:
    """What ``run(model, data, tokenizer=..., processor=..., **options)`` (``name`` "layers") or
    ``experiment(name, model=model, data=data, ...)`` checks of a model object before it measures
    (its keywords, the data spec, the object's tokenizer or processor): the same sentences
    (:class:`IsotuiError`), with nothing measured, loaded or written. The training callbacks
    check their probe with it before the first training step."""
    from isotui.experiments.registry import EXPERIMENTS

    if name == "layers":
        _object_layers(model, tokenizer, processor, None, None, None, {"data": data, **options}, None)
        return
    if name not in EXPERIMENTS or EXPERIMENTS[name].inputs != "models":
        raise IsotuiError(f"no experiment {name!r} over a model object")
    given = {"data": data, "tokenizer": tokenizer, "processor": processor, **options}
    _object_requests(EXPERIMENTS[name], model, given)


def _object_layers(
    model: Any,
    tokenizer: Any,
    processor: Any,
    name: Any,
    config: str | Path | None,
    cache_dir: str | Path | None,
    options: dict[str, Any],
    shard: Any,
) -> tuple[Any, list[Any], Any, dict[str, Any]]:
    """A model object's layer run: (the object, its requests, the parameters, the settings), every
    keyword checked, nothing run (:func:`run`, :func:`check_object`)."""
    from isotui import service
    from isotui.experiments.registry import LAYERS

    given = _given(model, tokenizer, processor, name, {**options, "shard": shard})
    run_options, params = _split(LAYERS, "isotui.run", options)
    path = service.config_path(config)
    settings = service.run_settings(path, {"models": [given.name], "cache_dir": cache_dir, **run_options})
    _refuse_loading(settings)
    return given, service.layer_requests(settings, path, params, given=given), params, settings


def _object_requests(exp: Experiment, model: Any, options: dict[str, Any]) -> tuple[Any, list[Any], Any]:
    """A model object's requests of ``exp`` (its ``tokenizer``, ``processor`` and ``name`` taken
    out of ``options``): (the object, the requests, the parameters), nothing run."""
    from isotui import service

    tok, proc, label = (options.pop(k, None) for k in ("tokenizer", "processor", "name"))
    obj = _given(model, tok, proc, label, options)
    run_options, params = _split(exp, f"experiment {exp.name!r}", options)
    return obj, service.make_requests(exp, params, models=[obj.name], options=run_options, given=obj), params


def load(key: str, cache_dir: str | Path | None = None) -> Result:
    """Reopen a cached result by its key or a unique prefix of it (``isotui cache ls`` lists
    them; ``Result.key`` gives one): a layer run, or the result of any registered experiment
    cached one result per entry (attention, final-norm, gradients)."""
    from isotui.experiments.cached import read
    from isotui.experiments.params import make_params
    from isotui.experiments.registry import cached_entries
    from isotui.paths import cache_dir as default_cache_dir
    from isotui.store.cache import CacheProblem

    root = default_cache_dir(str(cache_dir) if cache_dir is not None else None)
    matches = cached_entries(root, key) if key else []
    if len(matches) != 1:
        what = "no cached result" if not matches else f"{len(matches)} cached results"
        raise IsotuiError(f"key {key!r} matches {what} in {root}; see `isotui cache ls`")
    exp, full = matches[0]
    assert exp.decode is not None  # cached_entries lists the experiments that read an entry back
    try:
        found = read(exp.cache(root), full, exp.decode)
    except CacheProblem as problem:
        raise IsotuiError(str(problem)) from None
    if found is None:
        raise IsotuiError(f"cached result {full[:12]} was removed meanwhile")
    results = found if isinstance(found, list) else [found]
    models = sorted({r.model for r in results})
    params: Any = make_params(exp.params, {})
    return Result(_command(exp), models, exp.rows(results), exp.payload(results), results, params)


# --- progress where a person is watching ---------------------------------------------------------


def watching() -> str | None:
    """Where the default progress goes: ``"notebook"`` in Jupyter (or Colab...: tqdm's notebook
    widget), ``"terminal"`` when stderr is a terminal (tqdm's bar on stderr), None when output
    goes to files or pipes (a script's log: nothing)."""
    if _in_notebook():
        return "notebook"
    isatty = getattr(sys.stderr, "isatty", None)
    return "terminal" if isatty is not None and isatty() else None


def _in_notebook() -> bool:
    """A Jupyter kernel (or Colab, Databricks) runs this, as IPython's shell class says."""
    import builtins
    import os

    get_ipython = getattr(builtins, "get_ipython", None)
    if get_ipython is None:
        return False
    shell = get_ipython()
    kind = type(shell).__name__
    return (
        "google.colab" in str(type(shell))
        or bool(os.getenv("DATABRICKS_RUNTIME_VERSION"))
        or kind == "ZMQInteractiveShell"
    )


def _has_tqdm() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("tqdm.auto") is not None
    except (ImportError, ValueError):  # a stand-in module without a spec
        return False


# What tqdm's bar shows, by what the job counts: words alone while it resolves, loads and tokenises
# (no "0/600 ?sample/s" before a sample runs), then the bar with the job's own status words (one
# rate and one ETA, the CLI's and the app's, not tqdm's second pair counted from the start). The
# words go into the format itself (tqdm's ``{postfix}`` starts with a comma).
WORDS = "{desc}: "
COUNTED = "{desc}: {percentage:3.0f}%|{bar}| "
UNCOUNTED = ("resolving", "loading", "tokenising", "writing")  # phases that count nothing yet


@contextmanager
def tqdm_bar(name: str) -> Iterator[ProgressCallback]:
    """A job's progress as a tqdm bar (``tqdm.auto``: the notebook's widget where it can, else
    a bar on stderr), opened at the job's first news: the status words while it prepares, then
    a bar of samples while running and of layers while finalising, each with its own words."""
    from tqdm.auto import tqdm

    bar: Tqdm | None = None

    def on_progress(ev: Progress) -> None:
        nonlocal bar
        if ev.message:
            (bar or tqdm).write(f"{name}: {ev.message}", file=sys.stderr)
            return
        finalising = ev.phase == "finalising"
        total = ev.layers_total if finalising else ev.samples_total
        counted = total > 0 and ev.phase not in UNCOUNTED
        words = ev.status().replace("{", "{{").replace("}", "}}")
        shown = (COUNTED if counted else WORDS) + words
        if bar is None:
            bar = tqdm(
                total=total or None,
                desc=name,
                leave=False,
                dynamic_ncols=True,
                file=sys.stderr,
                bar_format=shown,
            )
        bar.bar_format = shown  # the format first: a new total redraws at once
        bar.unit = "layer" if finalising else "sample"
        if counted and total != bar.total:
            bar.reset(total=total)
        bar.n = (ev.layers_done if finalising else ev.samples_done) if counted else 0
        bar.refresh()

    try:
        yield on_progress
    finally:
        if bar is not None:
            bar.close()


def _bar(progress: bool | None) -> Callable[[str], AbstractContextManager[ProgressCallback]]:
    """The progress of each job: tqdm's bar where a person watches (or ``progress=True``)."""
    from isotui.service import no_bar

    shown = None if progress is False else watching() or ("terminal" if progress else None)
    return tqdm_bar if shown is not None and _has_tqdm() else no_bar


# --- keywords to the service ----------------------------------------------------------------------


def _split(exp: Experiment, what: str, options: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """(run options, the experiment's parameters) from the keywords ``options``; a keyword the
    experiment does not take is said with the ones it does."""
    from isotui.experiments.params import make_params, params_of
    from isotui.experiments.registry import options_for

    command = "run" if exp.command == "run" else exp.name
    run_names = [o.name for o in options_for(command)] if exp.run_flags else []
    param_names = [p.name for p in params_of(exp.params)]
    for name in options:
        if name in _NOT_OPTIONS:
            raise IsotuiError(
                f"{name}= is not an option of the Python API: "
                + (
                    "use progress="
                    if name in ("quiet", "verbose")
                    else "use cache=False"
                    if name == "no_cache"
                    else "use isotui.run's plan with the command line's --dry-run"
                    if name == "dry_run"
                    else f"write files with result.to_{name.removeprefix('wide_')}(path)"
                )
            )
        if name not in run_names and name not in param_names:
            inputs = {"models": ["model"], "series": ["model", "checkpoints", "skip_duplicates"]}
            known = sorted(
                [*inputs.get(exp.inputs, []), *run_names, *param_names, "cache", "cache_dir", "progress"]
            )
            raise IsotuiError(f"{what} has no option {name!r}; its options: {', '.join(known)}")
    run_options = {k: v for k, v in options.items() if k in run_names}
    return run_options, make_params(exp.params, {k: v for k, v in options.items() if k in param_names})


def _is_object(model: Any) -> bool:
    """Whether ``model`` is an object rather than a name, names or None (torch not imported)."""
    return model is not None and not isinstance(model, str | Path | list | tuple)


def _given(model: Any, tokenizer: Any, processor: Any, name: Any, options: Mapping[str, Any]) -> Any:
    """A model object as :func:`isotui.models.given.given_model` takes it in, after refusing
    the keywords that say how to load a name."""
    from isotui.models.given import given_model

    _refuse_loading(options)
    if name is not None and not isinstance(name, str):
        raise IsotuiError(f"name= must be a string, the model column's label (got {name!r})")
    return given_model(model, tokenizer=tokenizer, processor=processor, name=name)


def _refuse_loading(options: Mapping[str, Any]) -> None:
    from isotui.models.given import refuse_loading_options

    refuse_loading_options(dict(options))


def _model_names(model: Any) -> list[str]:
    if isinstance(model, str | Path):
        return [str(model)]
    if not isinstance(model, list | tuple) or not all(isinstance(m, str | Path) for m in model):
        raise IsotuiError(
            f"model must be a model name (a string such as 'minilm') or a list of names (got {model!r})"
        )
    if not model:
        raise IsotuiError("give at least one model")
    return [str(m) for m in model]


def _cache_root(cache: bool, cache_dir: str | Path | None) -> Path | None:
    from isotui.paths import cache_dir as default_cache_dir

    return default_cache_dir(str(cache_dir) if cache_dir is not None else None) if cache else None


def _say(text: str) -> None:
    """A notice (a damaged cache entry, a skipped duplicate checkpoint), on stderr."""
    print(f"isotui: {text}", file=sys.stderr)


def _one(exp: Experiment, requests: list[Any], root: Path | None, progress: bool | None) -> Outcome:
    """Run ``requests`` through the service; the first failure raised as its sentence."""
    from isotui import service

    outcome = service.run(exp, requests, service.Session(root, bar=_bar(progress), notice=_say))
    if outcome.failed:
        raise IsotuiError(outcome.failed[0][1])
    return outcome


def _command(exp: Experiment) -> str:
    return "run" if exp.command == "run" else exp.name


def _results(
    exp: Experiment, outcomes: list[tuple[list[str], Outcome]], params: Any, single: bool
) -> Result | Results:
    """A :class:`Result` per outcome (one per model asked, with its names as asked); one of them
    alone when one was asked."""
    made = [Result(_command(exp), names, o.rows, o.payload, o.results, params) for names, o in outcomes]
    return made[0] if single and len(made) == 1 else Results(made)


# --- display, loaded by name when a result is shown ------------------------------------------------


def _display() -> Any:
    """The terminal views' display functions (rich), loaded only when a result is shown."""
    import importlib

    return importlib.import_module("isotui.views")


def _tables(command: str, results: list[Any], params: Any) -> list[Any]:
    """The renderables the CLI prints for ``results`` of experiment ``command``."""
    return list(_display().result_tables(command, results, params, 200))
