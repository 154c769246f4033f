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

if TYPE_CHECKING:
    from isotui.experiments.ablate.measure import Known
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
class AblateRequest(CachedRequest[AblationResult]):
    """Removals at sites, their loss and geometry (``isotui experiment ablate``)."""

    remove: tuple[Removal, ...] = (Removal("mean"),)
    modules: tuple[str, ...] = ()
    kind: ClassVar[str] = "ablate"

    def _folder(self) -> tuple[str, int, dict[str, object]]:
        return FOLDER, SCHEMA, {"remove": [r.label for r in self.remove], "modules": list(self.modules)}

    def _measure(self, cache: ResultCache | None, context: Context) -> AblationResult:
        """The whole result cached under the request's keys; else each (site, removal) row cached
        on its own (under the layer run's key, the site and the removal) is taken as it is and the
        others are measured, then the whole result and each new row are stored."""
        from isotui.experiments.cached import cached_run, experiment_key, keep, lookup
        from isotui.experiments.layer_pass import prepare

        folder, schema, params = self._folder()
        prepared = prepare(self.spec, cache)
        found: set[tuple[str, str]] = set()

        def row_key(site: str, removal: str) -> str:
            return experiment_key(prepared.keys[0], folder, schema, {"site": site, "remove": removal})

        def known(site: str, removal: str) -> AblationResult | None:
            hit = lookup(cache, [row_key(site, removal)], from_payload, context.notice)
            if hit is not None:
                found.add((site, removal))
            return hit

        def compute() -> AblationResult:
            result = self._compute_rows(prepared, context, known if cache is not None else None)
            for i, row in enumerate(result.rows):
                if (row.site, row.remove) not in found:
                    keep(cache, row_key(row.site, row.remove), *self._encode(result.one(i)), context.notice)
            return result

        return cached_run(
            cache,
            [experiment_key(k, folder, schema, params) for k in prepared.keys],
            decode=self._decode,
            relabel=self._relabel,
            compute=compute,
            encode=self._encode,
            notice=context.notice,
        )

    def _compute_rows(self, prepared: Prepared, context: Context, known: Known | None) -> AblationResult:
        from isotui.experiments.ablate.measure import measure_ablation

        return measure_ablation(
            self.spec,
            self.remove,
            self.modules,
            on_progress=context.on_progress,
            should_stop=context.should_stop,
            prepared=prepared,
            known=known,
        )

    def _compute(self, prepared: Prepared, context: Context) -> AblationResult:
        return self._compute_rows(prepared, context, None)

    def _encode(self, result: AblationResult) -> tuple[dict[str, object], Arrays]:
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
)
