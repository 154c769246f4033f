"""Sharded layer runs (``isotui run --shard I/K``): each process measures one of K disjoint
slices of the samples and keeps its partial state in the cache; once all K are there, they merge
into the one-process result.

A shard's partial state (:func:`isotui.extract.runner.extract_state`: every layer's accumulator
and the run's facts) is one safetensors entry in ``shards/`` of the result cache, named by the
run's key (the key of the one-process run: the shard is not in it) and the shard
(``KEY-I-of-K``). Shard I takes samples I, I+K, I+2K...: deterministic, disjoint, and balanced
when a corpus is ordered by length or source. Corpus-level choices (the type weights of the
type-uniform view, the types self-similarity follows) are made from the whole corpus in every
shard (each tokenises all samples, then runs its own), so the merge is the one pass: sums to
float64 rounding, reservoir metrics exactly (reservoir keys depend on the global sample index).

One plan for every shard: the memory plan (which layers keep an exact covariance, the reservoir
size, the token types self-similarity follows) is made by the first shard to reach its first batch
and kept beside the states (``KEY-of-K.plan.json``, written once, first writer wins); every later
shard, on any machine, follows it or refuses in one sentence if its sums do not fit there. So
shards made under different free memory or ``--max-memory`` merge.

The last shard to finish merges, reading one state at a time into a running sum; so does a plain
run (no ``--shard``) that finds all K cached. The merged result is stored under the run's key as a
one-process run's would be, and the partial states and the plan are then removed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, cast

import numpy as np

from isotui.errors import IsotuiError
from isotui.experiments.json_types import JsonObject, JsonValue
from isotui.extract.progress import Progress, ProgressCallback, StopCheck, never_stop, no_progress
from isotui.store.cache import CacheProblem, CacheWriteError, ResultCache
from isotui.store.files import claim_bytes

if TYPE_CHECKING:
    from isotui.experiments.layer_pass import LoadFacts, Prepared
    from isotui.extract.memory_plan import MemoryPlan
    from isotui.results import ModelResult
    from isotui.spec import RunSpec

FOLDER = "shards"
SCHEMA = 1  # the partial state's layout; the layer metrics' schema is in the run key already
_NAME = re.compile(r"^(?P<key>[0-9a-f]+)-(?P<index>\d+)-of-(?P<count>\d+)$")

Notice = Callable[[str], None]
_ZERO_DIM = "__zero_dim__"  # a layer's 0-d tensors, by name (stored as 1-element arrays)

State = dict[str, object]  # an extract_state: "components" (per component, each layer's state) and the facts
Components = dict[str, list[dict[str, object]]]  # a state's "components"


class ShardMeta(TypedDict):
    """A shard entry's ``meta``: its data and samples."""

    data: str
    n_samples: int
    max_length: int | None
    created: str


class ShardHead(TypedDict):
    """A shard entry's ``shard``: which shard of which run, its options and load facts."""

    run: str
    index: int
    count: int
    group: str
    options: dict[str, object]
    loaded: LoadFacts


class ShardEntry(TypedDict):
    """A shard's cache entry, as :func:`_run_shard` writes it (beside its arrays)."""

    facts: dict[str, object]
    layers: dict[str, list[dict[str, JsonValue]]]
    model: str
    meta: ShardMeta
    shard: ShardHead


def _quiet(_text: str) -> None:
    """Default: drop notices."""


def shard_cache(root: Path) -> ResultCache:
    """The partial states' folder of the result cache at ``root``."""
    return ResultCache(root, folder=FOLDER, schema=SCHEMA)


def plan_name(run_key: str, count: int) -> str:
    """The file, beside the shard states, of the plan every shard of the run follows."""
    return f"{run_key}-of-{count}.plan.json"


def recorded_plan(root: Path, run_key: str, count: int) -> MemoryPlan | None:
    """The plan the run's first shard fixed: its plan file, else (shards cached by an isotui that
    kept no plan file) the plan a cached shard ran with; None when there is none yet. One
    sentence when the plan file is damaged."""
    from isotui.extract.memory_plan import MemoryPlan

    path = shard_cache(root).runs / plan_name(run_key, count)
    try:
        text = path.read_text()
    except FileNotFoundError:
        text = None
    except OSError as exc:
        reason = exc.strerror or exc
        raise IsotuiError(f"cannot read the plan of this sharded run, {path} ({reason})") from None
    if text is not None:
        try:
            return MemoryPlan.from_json(json.loads(text))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise IsotuiError(
                f"the plan of this sharded run, {path}, is damaged: remove the run's shards with "
                f"`isotui cache rm {run_key[:12]}` and run them again"
            ) from None
    cache = shard_cache(root)
    for i in range(count):
        try:
            head = ResultCache._header(cache.path_for(partial_key(run_key, i, count)))["result"]
            return MemoryPlan.from_json(head["facts"]["memory_plan"])
        except Exception:  # absent, damaged, or no plan in it: the next shard may tell
            continue
    return None


def _settle_plan(root: Path, run_key: str, index: int, count: int, own: MemoryPlan) -> MemoryPlan:
    """The plan shard ``index`` runs with: the run's recorded plan, followed here; when there is
    none yet, its own, recorded for the shards to come (a shard that loses the race to record
    it follows the winner's)."""
    who = f"shard {index}/{count}"
    recorded = recorded_plan(root, run_key, count)
    if recorded is None:
        data = json.dumps(own.to_json(), indent=1).encode()
        try:
            if claim_bytes(shard_cache(root).runs, plan_name(run_key, count), data):
                return own
        except OSError as exc:
            raise IsotuiError(
                f"cannot record the plan of this sharded run in {shard_cache(root).runs} "
                f"({exc.strerror or exc}); the shards could not merge without it"
            ) from None
        recorded = recorded_plan(root, run_key, count)
        assert recorded is not None  # another shard wrote it between the two reads
    return recorded.follow(own, who, run_key)


def forget_plan(root: Path, run_key: str, count: int) -> None:
    """Remove the run's plan once none of its shards is left (merged, or removed by the user)."""
    cache = shard_cache(root)
    if not any(cache.path_for(partial_key(run_key, i, count)).exists() for i in range(count)):
        with contextlib.suppress(FileNotFoundError):
            (cache.runs / plan_name(run_key, count)).unlink()


def forget_plans(root: Path) -> None:
    """``cache rm --all``: every plan none of whose shards is left (a first shard that recorded
    it and then failed leaves a plan with no state)."""
    for path in shard_cache(root).runs.glob("*-of-*.plan.json"):
        key, _, count = path.name.removesuffix(".plan.json").rpartition("-of-")
        if count.isdigit():
            forget_plan(root, key, int(count))


def remove_shard(root: Path, shard_key: str) -> bool:
    """``isotui cache rm``: one shard state, and its run's plan when it was the last one."""
    removed = shard_cache(root).remove(shard_key)
    m = _NAME.match(shard_key)
    if m:
        forget_plan(root, m["key"], int(m["count"]))
    return removed


def shard_ids(n: int, index: int, count: int) -> tuple[int, ...]:
    """Shard ``index`` of ``count`` over ``n`` samples: every count-th sample from ``index``."""
    return tuple(range(index, n, count))


def check_shard_count(n: int, count: int, what: str) -> None:
    """One sentence when ``count`` shards are more than the ``n`` samples: a shard without samples
    has nothing to measure, and a split with one can never merge."""
    if count > n:
        raise IsotuiError(
            f"{what}: the data has {n} sample{'s' if n != 1 else ''}, fewer than {count} shards "
            f"(each shard needs a sample of its own: at most {n} shards)"
        )


def partial_key(run_key: str, index: int, count: int) -> str:
    return f"{run_key}-{index}-of-{count}"


def _options(prepared: Prepared) -> dict[str, object]:
    """The resolved run options a shard's numbers depend on (what its run key hashes, readable;
    ``schema``: the layer metrics' schema, an isotui version's)."""
    from isotui.results import SCHEMA_VERSION

    spec = prepared.spec
    return {
        "schema": SCHEMA_VERSION,
        "max_length": prepared.max_length,
        "special_tokens": spec.special_tokens,
        "dtype": prepared.dtype,
        "seed": spec.seed,
        "reservoir": spec.reservoir,
        "map_units": spec.map_units,
        "tokenizer": spec.tokenizer,
        **({"modules": list(spec.modules)} if spec.modules else {}),
        **({"metrics": {m.name: m.version for m in prepared.metrics}} if prepared.metrics else {}),
    }


_NOT_FLAGS = {"schema": "the layer metrics' schema", "metrics": "the plug-in metrics"}


def _said(value: object) -> str:
    """An option's value as the command line gives it."""
    if value is None:
        return "not given"
    if isinstance(value, dict):  # plug-in metrics: name and version
        return ", ".join(f"{k} v{v}" for k, v in value.items()) or "none"
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "none"
    return str(value)


def option_differences(here: Mapping[str, object], theirs: Mapping[str, object], where: str) -> list[str]:
    """Each run option that differs, in the command line's terms: ``--max-length 32 here, 64
    in the cached shards`` (an option the other side did not record: ``not given``; the schema
    only when both recorded it, as states cached before it was recorded did not)."""
    said = []
    for name in dict.fromkeys([*here, *theirs]):
        if name == "schema" and (name not in here or name not in theirs):
            continue
        mine, other = here.get(name), theirs.get(name)
        if mine != other:
            flag = _NOT_FLAGS.get(name, "--" + name.replace("_", "-"))
            said.append(f"{flag} {_said(mine)} here, {_said(other)} {where}")
    return said


def _group(prepared: Prepared) -> str:
    """Model and data, without the run options: shards of one group with other options are
    another run's (said when this shard is the one they lack, never refused)."""
    both = f"{prepared.model_fingerprint}\n{prepared.data_fingerprint}"
    return hashlib.sha256(both.encode()).hexdigest()[:16]


# --- a partial state as a cache entry ---------------------------------------------------------------


def state_payload(state: Mapping[str, object]) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """An :func:`~isotui.extract.runner.extract_state` as JSON plus arrays (no pickle)."""
    import torch

    arrays: dict[str, np.ndarray] = {}
    layers: dict[str, list[dict[str, object]]] = {}
    for component, states in cast("Components", state["components"]).items():  # extract_state's
        layers[component] = []
        for i, layer in enumerate(states):
            zero_dim: list[str] = []
            scalars: dict[str, object] = {_ZERO_DIM: zero_dim}
            for name, value in layer.items():
                if isinstance(value, torch.Tensor):
                    arrays[f"{component}.{i}.{name}"] = value.detach().cpu().contiguous().numpy()
                    if value.ndim == 0:  # the cache stores arrays of at least one dimension
                        zero_dim.append(name)
                else:
                    scalars[name] = value
            layers[component].append(scalars)
    facts = {k: v for k, v in state.items() if k != "components"}
    return {"facts": facts, "layers": layers}, arrays


def state_from_payload(payload: ShardEntry, arrays: dict[str, np.ndarray]) -> State:
    """The state :func:`state_payload` stored."""
    import torch

    components: Components = {}
    for component, layers in payload["layers"].items():
        components[component] = []
        for i, scalars in enumerate(layers):
            prefix = f"{component}.{i}."
            tensors = {
                k[len(prefix) :]: torch.from_numpy(v) for k, v in arrays.items() if k.startswith(prefix)
            }
            kept = {k: v for k, v in scalars.items() if k != _ZERO_DIM}
            for name in cast("list[str]", scalars.get(_ZERO_DIM, [])):  # as state_payload wrote it
                tensors[name] = tensors[name].reshape(())
            components[component].append({**kept, **tensors})
    return {**payload["facts"], "components": components}


# what a damaged partial state raises when it is decoded, checked or merged (a valid checksum
# says the bytes are intact, not that they fit: an entry rewritten by hand, or by another version)
DAMAGE = (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError)


def checked_state(payload: Mapping[str, object], arrays: dict[str, np.ndarray]) -> State:
    """The state of a cached shard, every layer's accumulator rebuilt from it once, so that a
    damaged entry (an array of a wrong shape, a missing field) raises one of :data:`DAMAGE` here
    and not in the merge."""
    from isotui.core.accumulator import LayerAccumulator

    entry = cast("ShardEntry", payload)  # as _run_shard wrote it; a damaged one raises below
    state = state_from_payload(entry, arrays)
    for layers in cast("Components", state["components"]).values():  # as state_from_payload made it
        for layer in layers:
            LayerAccumulator.from_state(layer, copy=False)  # checked, not copied
    seconds = [state.get(n, 0.0) for n in ("tokenise_s", "forward_s", "metrics_s")]
    seconds.append(entry["shard"]["loaded"]["load_s"])
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in seconds):
        raise TypeError("timings that are not numbers")
    return state


def _why(exc: BaseException) -> str:
    """A damage's reason, short: the error's first line, or its type."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text[:200] if isinstance(exc, ValueError) and text else type(exc).__name__


# --- what the cache holds -------------------------------------------------------------------------


@dataclass(frozen=True)
class PartialRun:
    """The cached shards of one run split K ways (``isotui cache ls``)."""

    key: str  # the run's key
    count: int  # K
    have: tuple[int, ...]  # the shards cached
    model: str
    data: str
    n_samples: int  # of the shards cached
    created: str  # the newest shard's
    size_bytes: int
    group: str = ""
    options: tuple[tuple[str, object], ...] = ()


def partial_runs(root: Path) -> list[PartialRun]:
    """Every partial run in the cache at ``root``, newest first (headers only)."""
    found: dict[tuple[str, int], list[tuple[int, ShardEntry, int, str]]] = {}
    cache = shard_cache(root)
    for entry in cache.scan().entries:
        m = _NAME.match(entry.key)
        if not m:
            continue
        try:
            head = ResultCache._header(entry.path)["result"]
        except Exception:  # vanished or damaged since the scan: left out
            continue
        group = (m["key"], int(m["count"]))
        found.setdefault(group, []).append((int(m["index"]), head, entry.size_bytes, entry.created))
    runs = []
    for (key, count), shards in found.items():
        heads = [h for _, h, _, _ in shards]
        shard_meta = heads[0].get("shard", {})
        runs.append(
            PartialRun(
                key=key,
                count=count,
                have=tuple(sorted(i for i, *_ in shards)),
                model=str(heads[0].get("model", "?")),
                data=str(heads[0].get("meta", {}).get("data", "?")),
                n_samples=sum(int(h.get("meta", {}).get("n_samples", 0)) for h in heads),
                created=max(c for *_, c in shards),
                size_bytes=sum(s for _, _, s, _ in shards),
                group=str(shard_meta.get("group", "")),
                options=tuple(sorted(shard_meta.get("options", {}).items())),
            )
        )
    runs.sort(key=lambda r: r.created, reverse=True)
    return runs


def _check_split(prepared: Prepared, root: Path, index: int, count: int, on_notice: Notice = _quiet) -> None:
    """Before a shard runs: one sentence if it cannot merge with its run's shards already cached,
    split another number of ways or written by an isotui of another shard schema (whose states
    this one can neither read nor replace without losing them).

    Shards of another run (the same model and data with other run options: another key) are
    never refused, whatever order the tasks of two runs start in: they are that run's, under its
    own key. When this shard is the one they lack, that is said (not refused): it may be a shard
    given other options by mistake."""
    runs = partial_runs(root)
    mine = [r for r in runs if r.key == prepared.key]
    other_k = [r for r in mine if r.count != count]
    if other_k:
        r = other_k[0]
        held = ", ".join(f"{i}/{r.count}" for i in r.have)
        raise IsotuiError(
            f"the cache holds shards of this run split {r.count} ways ({held}), not {count}: run "
            f"--shard I/{r.count}, or remove them with `isotui cache rm {r.key[:12]}`"
        )
    _check_schemas(prepared.key, root, index, count)
    have = {index, *(i for r in mine for i in r.have)}
    options = _options(prepared)
    for r in runs:
        if r.key == prepared.key or r.group != _group(prepared) or r.count != count:
            continue
        if have.isdisjoint(r.have) and have | set(r.have) == set(range(count)):
            differ = option_differences(options, dict(r.options), "in the cached shards")
            held = ", ".join(f"{i}/{count}" for i in r.have)
            on_notice(
                f"shards {held} of this model and data are cached from a run with other options "
                f"({'; '.join(differ) or 'options this isotui did not record: another version'}), "
                f"so shard {index}/{count} does not complete them: it is a shard of its own run; "
                "to complete theirs, run it again with their options"
            )
            return


def _check_schemas(run_key: str, root: Path, index: int, count: int) -> None:
    """One sentence if a cached shard of this run was written by an isotui of another shard
    schema: this isotui cannot merge it, and running that shard again would replace another
    version's work; nothing is run, nothing removed."""
    cache = shard_cache(root)
    for i in range(count):
        try:
            schema = ResultCache._header(cache.path_for(partial_key(run_key, i, count))).get("schema")
        except Exception:  # absent, or damaged: the merge says it and runs that shard again
            continue
        if schema == SCHEMA:
            continue
        age = "a newer" if isinstance(schema, int) and schema > SCHEMA else "another"
        why = (
            "and this isotui can neither merge it nor measure it again without replacing that isotui's work"
            if i == index
            else f"so shard {index}/{count} can never merge with it here"
        )
        raise IsotuiError(
            f"shard {i}/{count} of this run is in the cache from {age} isotui (shard schema {schema}; "
            f"this isotui writes {SCHEMA}), {why}: run every shard with one isotui, or remove the "
            f"run's shards with `isotui cache rm {run_key[:12]}` and run them all again"
        )


# --- running a shard, merging shards -------------------------------------------------------------------


def measure_shard(
    spec: RunSpec,
    cache_root: Path | None,
    *,
    on_progress: ProgressCallback = no_progress,
    should_stop: StopCheck = never_stop,
    on_notice: Notice = _quiet,
) -> ModelResult | None:
    """Run shard ``spec.shard`` and keep its partial state; the merged result when it was the
    last of the K (or the whole run is cached already), else None (said in a notice)."""
    from isotui.experiments import layer_pass

    assert spec.shard is not None
    index, count = spec.shard
    if cache_root is None:
        raise IsotuiError("--shard keeps each shard's partial state in the cache: drop --no-cache")
    if spec.exact:
        raise IsotuiError(
            "--exact's second pass needs the whole corpus's mean and eigenvectors first, so it "
            "cannot run in shards: drop --exact or --shard"
        )
    on_progress(
        Progress(0, 0, 0, 0.0, stage="prepare", phase="resolving", detail="model, data and cache key")
    )
    runs = ResultCache(cache_root)
    prepared = layer_pass.prepare(spec, runs)
    check_shard_count(len(prepared.samples), count, f"shard {index}/{count}")
    hit = layer_pass.lookup(prepared, runs, on_notice)
    if hit is not None:
        on_notice(f"the whole run of {spec.model} is cached already (key {prepared.key[:12]}): shard not run")
        for r in partial_runs(cache_root):  # shards of a run cached whole are no longer needed
            if r.key == prepared.key:
                for i in r.have:
                    remove_shard(cache_root, partial_key(r.key, i, r.count))
        return hit
    _check_split(prepared, cache_root, index, count, on_notice)
    cache = shard_cache(cache_root)
    key = partial_key(prepared.key, index, count)
    heard: list[str] = []  # the merge's notices: said, or the sentence of the refusal below
    for _attempt in range(2):
        for text in heard:  # the first attempt's, before this shard is measured again
            on_notice(text)
        heard = []
        try:
            cached = cache.get_payload(key) is not None
        except CacheProblem as problem:
            on_notice(f"{problem}; recomputing")
            cached = False
        if cached:
            on_notice(f"shard {index}/{count} of {spec.model} is cached already")
        else:
            payload, arrays = _run_shard(prepared, cache_root, index, count, on_progress, should_stop)
            try:
                cache.put_payload(key, payload, arrays)
            except CacheWriteError as exc:
                raise IsotuiError(f"{exc}; a shard is kept only in the cache, so it is lost") from None
        merged = merge_cached(prepared, cache_root, on_notice=heard.append, on_progress=on_progress)
        if merged is not None or not cached or cache.path_for(key).is_file():
            break
        # this shard's own cached entry was damaged (the merge dropped it): measured again, once
    if merged is None:
        have = next(
            (r.have for r in partial_runs(cache_root) if r.key == prepared.key and r.count == count), ()
        )
        if heard and len(have) == count:  # all K cached, the merge said why not: a failure
            for text in heard[:-1]:
                on_notice(text)
            raise IsotuiError(heard[-1])  # what to do about it, never a wait for a merge
    for text in heard:
        on_notice(text)
    if merged is None:
        on_notice(
            f"shard {index}/{count} of {spec.model} is in the cache ({len(have)} of {count} shards: "
            f"{', '.join(map(str, have))}); the last shard to finish merges them"
        )
    return merged


def _run_shard(
    prepared: Prepared,
    cache_root: Path,
    index: int,
    count: int,
    on_progress: ProgressCallback,
    should_stop: StopCheck,
    settle: Callable[[MemoryPlan], MemoryPlan] | None = None,
) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """Load the model, stream this shard's samples, and return the entry to cache. ``settle``:
    how the shard comes to its run's plan (default: the plan file beside the states in
    ``cache_root``, :func:`_settle_plan`)."""
    import dataclasses

    from isotui.experiments.layer_pass import extract_options, load_prepared, loaded_facts, weights_size
    from isotui.extract.runner import extract_state

    spec = prepared.spec
    ids = shard_ids(len(prepared.samples), index, count)
    on_progress(Progress(0, len(ids), 0, 0.0, stage="prepare", phase="loading", detail=weights_size(spec)))
    started = time.perf_counter()
    loaded, device = load_prepared(prepared)
    load_s = time.perf_counter() - started
    state = extract_state(
        loaded,
        prepared.samples,
        device=device,
        opts=dataclasses.replace(
            extract_options(spec, prepared.metrics),
            sample_ids=ids,
            settle_plan=settle or functools.partial(_settle_plan, cache_root, prepared.key, index, count),
        ),
        on_progress=on_progress,
        should_stop=should_stop,
        model_name=spec.model,
        modality=spec.data.modality,
    )
    payload, arrays = state_payload(state)
    payload.update(
        model=spec.model,
        meta={
            "data": spec.data.describe(),
            "n_samples": len(ids),
            "max_length": state["max_length"] or None,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        shard={
            "run": prepared.key,
            "index": index,
            "count": count,
            "group": _group(prepared),
            "options": _options(prepared),
            "loaded": loaded_facts(loaded, device, load_s),
        },
    )
    return payload, arrays


def merge_cached(
    prepared: Prepared,
    cache_root: Path | None,
    *,
    on_notice: Notice = _quiet,
    on_progress: ProgressCallback = no_progress,
) -> ModelResult | None:
    """The run merged from its K cached shards, stored under the run's key as a one-process run
    (the shards then removed); None when no K of them are all cached."""
    from isotui.experiments import layer_pass
    from isotui.extract.runner import finish_extraction, merge_extraction_states

    if cache_root is None:
        return None
    mine = [r for r in partial_runs(cache_root) if r.key == prepared.key]
    complete = [r for r in mine if r.have == tuple(range(r.count))]
    if not complete:
        if mine and prepared.spec.shard is None:  # a plain run: say why it computes anyway
            r = mine[0]
            on_notice(
                f"the cache holds {len(r.have)} of {r.count} shards of this run "
                f"({', '.join(map(str, r.have))}); measuring it in one process instead"
            )
        return None
    count = complete[0].count
    try:  # the merge's own memory, on the machine that merges, before any read
        plan = recorded_plan(cache_root, prepared.key, count)
    except IsotuiError:  # a damaged plan file: the states merge without it (and it goes with them)
        plan = None
    if plan is not None:
        from isotui.extract.memory_plan import available_memory

        plan.refuse_merge(count, available_memory("cpu"))
    cache = shard_cache(cache_root)
    runs = ResultCache(cache_root)
    on_progress(Progress(0, 0, 0, 0.0, message=f"merging the {count} shards of this run"))
    loaded: list[LoadFacts] = []  # each shard's load facts
    timings = dict.fromkeys(("tokenise_s", "forward_s", "metrics_s"), 0.0)  # every shard's work
    said: list[str] = []
    damaged: list[int] = []

    def states() -> Iterator[State]:
        """Each shard's state, read and checked when the merge asks for it (one at a time in
        memory); a damaged one is removed (it runs again) and the others are only checked."""
        for i in range(count):
            name = partial_key(prepared.key, i, count)
            try:
                found = cache.get_payload(name)
            except CacheProblem as problem:
                found = None
                said.append(f"{problem}; run shard {i}/{count} again")
            if found is None:  # another process merged and removed them meanwhile, or damaged
                raise _Gone
            try:
                state = checked_state(*found)
            except DAMAGE as exc:
                damaged.append(i)
                cache.remove(name)
                on_notice(
                    f"cache entry {FOLDER}/{name}.safetensors is damaged ({_why(exc)}); removed it: "
                    f"shard {i}/{count} of this run runs again"
                )
                continue
            loaded.append(found[0]["shard"]["loaded"])
            del found
            if not damaged:
                for phase in timings:
                    timings[phase] += cast("float", state.get(phase, 0.0))  # a number: checked_state's check
                yield state
            del state  # not held while the next one is read

    try:
        merged = merge_extraction_states(states())
        if damaged:
            return None
        merged.update(timings)
        ex = finish_extraction(merged, own=True)  # one copy of the sums, not two (merge_bytes)
        ex.notes.append(f"merged from {count} shards")
        facts: LoadFacts = {**loaded[0], "load_s": sum(f["load_s"] for f in loaded)}
        result = layer_pass.build_result(prepared, ex, facts)
    except _Gone:
        hit = layer_pass.lookup(prepared, runs, on_notice)
        if hit is None and said:
            on_notice(said[0])
        return hit
    except DAMAGE as exc:  # each fine alone, not together: which is wrong cannot be told
        if damaged:  # every state was damaged: nothing was merged
            return None
        on_notice(
            f"the {count} cached shards of this run do not merge ({_why(exc)}): remove them with "
            f"`isotui cache rm {prepared.key[:12]}` and run them again"
        )
        return None
    layer_pass.store(result, runs, on_notice)
    if runs.path_for(prepared.key).is_file():  # kept: the shards and their plan are no longer needed
        for i in range(count):
            cache.remove(partial_key(prepared.key, i, count))
        forget_plan(cache_root, prepared.key, count)
    return result


class _Gone(Exception):
    """A shard state vanished or was damaged while merging."""


# --- shards measured on machines that do not share the driver's cache (a Ray sweep) ---------------------


def measure_shard_for_driver(
    spec: RunSpec, index: int, count: int, plan: JsonObject | None, cache_root: Path
) -> tuple[str, bytes]:
    """A sweep task's shard ``index`` of ``count`` (at least 2) on a machine that does not see
    the driver's cache (:func:`~isotui.experiments.layerwise.measure_for_driver`): measured here,
    and (the run's key, the bytes of its state's cache entry) returned for the driver to keep
    (:func:`keep_from_worker`). ``plan``: the run's plan (:meth:`MemoryPlan.to_json`), which
    this shard follows or refuses in one sentence; None for the shard that fixes it (its state
    records it). ``cache_root``: this machine's own cache (local weights' digests)."""
    from isotui.experiments import layer_pass
    from isotui.extract.memory_plan import MemoryPlan

    runs = ResultCache(cache_root)
    prepared = layer_pass.prepare(spec, runs)
    check_shard_count(len(prepared.samples), count, f"shard {index}/{count}")
    who = f"shard {index}/{count}"
    fixed = MemoryPlan.from_json(plan) if plan is not None else None

    def settle(own: MemoryPlan) -> MemoryPlan:
        return own if fixed is None else fixed.follow(own, who, prepared.key)

    payload, arrays = _run_shard(prepared, cache_root, index, count, no_progress, never_stop, settle)
    return prepared.key, shard_cache(cache_root).entry_bytes(payload, arrays)


def keep_from_worker(
    cache_root: Path, run_key: str, index: int, count: int, data: bytes
) -> JsonObject | None:
    """Keep in the driver's cache the entry a sweep task sent
    (:func:`~isotui.experiments.layerwise.measure_for_driver`): the shard state (beside it,
    the run's plan, recorded from the first state that comes: the plan the later shards are
    sent), or the whole run's result when ``count`` is 1. Returns
    the run's plan (:meth:`MemoryPlan.to_json`; None for a whole run). One sentence (IsotuiError)
    when the bytes are not a whole entry of this run: nothing of them is kept."""
    from isotui.experiments import layer_pass

    whole = count == 1
    cache = ResultCache(cache_root) if whole else shard_cache(cache_root)
    name = run_key if whole else partial_key(run_key, index, count)
    what = "the run" if whole else f"shard {index}/{count}"
    try:
        cache.put_bytes(name, data)
    except CacheWriteError as exc:
        raise IsotuiError(f"{exc}; {what} measured on a Ray worker is lost") from None
    try:
        if whole:
            if layer_pass.read(cache, run_key) is None:
                raise KeyError("not written")
            return None
        found = cache.get_payload(name)
        if found is None:
            raise KeyError("not written")
        mine = found[0]["shard"]
        if (mine["run"], mine["index"], mine["count"]) != (run_key, index, count):
            raise ValueError(f"it is shard {mine['index']}/{mine['count']} of run {str(mine['run'])[:12]}")
        checked_state(*found)
        plan = cast("JsonObject", found[0]["facts"]["memory_plan"])  # MemoryPlan.to_json's, as recorded
    except (CacheProblem, *DAMAGE) as exc:
        cache.remove(name)
        raise IsotuiError(f"the state of {what} sent by its Ray worker is damaged ({_why(exc)})") from None
    with contextlib.suppress(OSError):  # the plan is in every state too (recorded_plan reads it)
        claim_bytes(cache.runs, plan_name(run_key, count), json.dumps(plan, indent=1).encode())
    recorded = recorded_plan(cache_root, run_key, count)
    return recorded.to_json() if recorded is not None else plan
