"""ablate's entry in the experiment registry (the contract of :mod:`isotui.experiments.base`):
its parameters, request, cache folder and schema, CSV rows, JSON document and cache entry.
Import-light: no torch, no rich, no CLI."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from isotui.errors import IsotuiError
from isotui.experiments import plans
from isotui.experiments.ablate.removal import FORM, Removal, check_rows, parse_removal
from isotui.experiments.ablate.result import AblationResult, csv_rows, from_payload, json_payload
from isotui.experiments.base import Arrays, Context, Experiment
from isotui.experiments.cached_request import CachedRequest
from isotui.experiments.params import param
from isotui.spec import MODEL, SHARD

if TYPE_CHECKING:
    from isotui.experiments.ablate.measure import EditedSums, Known
    from isotui.experiments.layer_pass import Prepared
    from isotui.spec import RunSpec
    from isotui.store.cache import ResultCache

HELP = (
    "remove a direction at each site (mean, top PCs, rogue dims) and measure the loss and the geometry after"
)
FOLDER = "ablate"
SCHEMA = 1
MAX_SITES = 256  # --modules values (a glob's matches are counted when the model is read)


def _words(value: object) -> list[str]:
    """A flag's values (argparse's list) or an API keyword's (a string or a list of them)."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return [w for v in value for w in v.split()]
    raise IsotuiError(f"expected strings, got {value!r}")


def parse_removals(value: object) -> tuple[Removal, ...]:
    """``--remove``: one or more removals, each said once."""
    try:
        words = _words(value)
    except IsotuiError:
        raise IsotuiError(f"remove must be one or more of {FORM}, as strings (got {value!r})") from None
    if not words:
        raise IsotuiError(f"remove needs one or more of {FORM}")
    removals = tuple(dict.fromkeys(parse_removal(w) for w in words))
    check_rows(1, len(removals))
    return removals


def parse_sites(value: object) -> tuple[str, ...]:
    """``--modules``: module name globs or named sites (none: every block's output)."""
    try:
        words = _words(value)
    except IsotuiError:
        raise IsotuiError(
            f"modules must be module name globs or named sites, as strings (got {value!r})"
        ) from None
    if len(words) > MAX_SITES:
        raise IsotuiError(f"modules names {len(words)} sites; at most {MAX_SITES} at once")
    return tuple(dict.fromkeys(words))


@dataclass(frozen=True)
class AblateParams:
    """ablate's own parameters (the front ends add the models and the run options)."""

    remove: tuple[Removal, ...] = param(
        (Removal("mean"),),
        parse=parse_removals,
        nargs="+",
        metavar="WHAT",
        help="what to remove at each site, one or more of: mean (the site's corpus mean), pc:K (its top K "
        "principal directions), rogue:K (the K dimensions that add most to avg_cos, set to their mean), "
        "dims:I,J (those coordinates, set to their mean); default mean",
    )
    modules: tuple[str, ...] = param(
        (),
        parse=parse_sites,
        nargs="+",
        metavar="GLOB",
        help="the sites, one at a time: module name globs (* within one dotted name, ** across dots) or "
        "named sites (resid_post, attn_out, mlp_out, norm_in); default every block's output",
    )


@dataclass(frozen=True)
class AblateRequest(CachedRequest["AblationResult | None"]):
    """Removals at sites, their loss and geometry (``isotui experiment ablate``)."""

    remove: tuple[Removal, ...] = (Removal("mean"),)
    modules: tuple[str, ...] = ()
    kind: ClassVar[str] = "ablate"

    def _folder(self) -> tuple[str, int, dict[str, object]]:
        return FOLDER, SCHEMA, {"remove": [r.label for r in self.remove], "modules": list(self.modules)}

    def _measure(self, cache: ResultCache | None, context: Context) -> AblationResult | None:
        """The whole result cached under the request's keys; else, unsharded, each (site, removal)
        row cached on its own (under the layer run's key, the site and the removal) is taken as
        it is and the others are measured, then the whole result and each new row are stored.
        A shard (``--shard I/K``) measures every row over its samples and keeps its partial
        state; the last of the K, or a plain run finding all K, merges them (then stored as an
        unsharded result); a shard that is not the last gives None (said in a notice)."""
        from isotui.experiments.ablate import sharded
        from isotui.experiments.cached import experiment_key, keep, lookup
        from isotui.experiments.layer_pass import prepare
        from isotui.experiments.shards import check_shard_count, partial_key, shard_ids

        folder, schema, params = self._folder()
        shard, notice = self.spec.shard, context.notice
        if shard is not None and cache is None:
            raise IsotuiError("--shard keeps each shard's partial state in the cache: drop --no-cache")
        prepared = prepare(self.spec, cache)
        keys = [experiment_key(k, folder, schema, params) for k in prepared.keys]
        found: set[tuple[str, str]] = set()

        def row_key(site: str, removal: str) -> str:
            return experiment_key(prepared.keys[0], folder, schema, {"site": site, "remove": removal})

        def known(site: str, removal: str) -> AblationResult | None:
            hit = lookup(cache, [row_key(site, removal)], from_payload, notice)
            if hit is not None:
                found.add((site, removal))
            return hit

        if shard is not None:
            check_shard_count(len(prepared.samples), shard[1], f"shard {shard[0]}/{shard[1]}")
        hit = lookup(cache, keys, self._decode, notice)
        if hit is not None:
            self._relabel(hit)
            if shard is not None and cache is not None:
                notice(
                    f"this ablation of {self.spec.model} is cached whole already "
                    f"(key {keys[0][:12]}): shard not run"
                )
                sharded.forget(cache, keys[0])
            return hit
        if shard is not None and cache is not None:
            index, count = shard
            if cache.path_for(partial_key(keys[0], index, count)).is_file():
                notice(f"shard {index}/{count} of {self.spec.model} is cached already")
            else:
                ids = shard_ids(len(prepared.samples), index, count)
                part, sums = self._compute_rows(prepared, context, None, ids)
                assert sums is not None  # no row known: every one measured
                sharded.keep(cache, keys[0], index, count, part, sums)
        merge = sharded.merged(cache, keys[0], notice) if cache is not None else None
        if merge is None and shard is not None and cache is not None:
            hit = lookup(cache, keys, self._decode, notice)  # merged by another shard meanwhile
            if hit is not None:
                self._relabel(hit)
                return hit
            got = sharded.have(cache, keys[0], shard[1])
            notice(
                f"shard {shard[0]}/{shard[1]} of {self.spec.model} is in the cache ({len(got)} of {shard[1]} "
                f"shards: {', '.join(map(str, got))}); the last shard to finish merges them"
            )
            return None
        if merge:  # named as this run asks (the shards may have named the model otherwise)
            result = merge[0]
            self._relabel(result)
            result.from_cache = False
        else:
            result = self._compute_rows(prepared, context, known if cache is not None else None)[0]
        keep(cache, keys[0], *self._encode(result), notice)
        for i, row in enumerate(result.rows):
            if (row.site, row.remove) not in found:
                keep(cache, row_key(row.site, row.remove), *self._encode(result.one(i)), notice)
        if cache is not None and cache.path_for(keys[0]).is_file():
            sharded.forget(cache, keys[0])  # kept whole: no partial state is read again
        return result

    def _compute_rows(
        self, prepared: Prepared, context: Context, known: Known | None, ids: tuple[int, ...] | None = None
    ) -> tuple[AblationResult, EditedSums | None]:
        from isotui.experiments.ablate.measure import measure_rows

        on_progress, stop = context.on_progress, context.should_stop
        return measure_rows(self.spec, self.remove, self.modules, on_progress, stop, prepared, known, ids)

    def _compute(self, prepared: Prepared, context: Context) -> AblationResult:
        return self._compute_rows(prepared, context, None)[0]

    def _encode(self, result: AblationResult | None) -> tuple[dict[str, object], Arrays]:
        assert result is not None  # a shard that is not the last stores no result
        return result.to_payload(), {}

    def _decode(self, payload: Mapping[str, object], arrays: Arrays) -> AblationResult:
        return from_payload(payload, arrays)


EXPERIMENT: Experiment[RunSpec, AblateParams, AblateRequest, AblationResult] = Experiment(
    name="ablate",
    help=HELP,
    request_type=AblateRequest,
    result_type=AblationResult,
    folder=FOLDER,
    schema=SCHEMA,
    make_request=lambda spec, params: AblateRequest(spec, remove=params.remove, modules=params.modules),
    rows=csv_rows,
    payload=json_payload,
    params=AblateParams,
    decode=from_payload,
    plan=plans.ablate,
    lab_tab="isotui.experiments.ablate.tab:AblateTab",
    run_options=(MODEL, SHARD),
)
