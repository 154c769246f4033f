"""RunSpec: the validated settings of a layer-wise run, shared by the CLI, config files and TUI.

Each run option is declared once, here: a :class:`RunSpec` field whose metadata is a
:class:`RunOption` (help, TOML types, validation, its scope, its field in the app's options
dialog). Which experiments take it is said by each experiment: the scopes it declares
(``Experiment.run_options``; every experiment that streams a model takes the ``model`` scope:
``--data``, ``--device``, ``--max-samples``, ``--seed``...). The command line's flags
(``cli.common.add_run_flags``), the config file's keys (``config.RUN_SETTINGS``), the settings file's
``[run]`` table, :func:`make_spec`, the options dialog and README's option table all read
:data:`RUN_OPTIONS`; adding an option is one field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from isotui.data.sources import DataSpec, parse_data
from isotui.errors import IsotuiError
from isotui.extract.device import DTYPE_ALIASES, DTYPES, validate_device
from isotui.extract.memory_values import DEVICE_MAPS, parse_max_memory
from isotui.extract.threads import check_threads

MAP_UNITS = ("auto", "image", "position")
SPECIAL_TOKENS = ("exclude", "include")

# The scopes of the run options; an experiment declares the ones it takes (Experiment.run_options).
MODEL = "model"  # streaming a model over data: every experiment that does (not drift-block)
LAYER_METRICS = "layer-metrics"  # the layer metrics of every kept vector (conv map units, --exact)
RESERVOIR = "reservoir"  # a reservoir sample of each layer's vectors
SHARD = "shard"  # one slice of the samples, merged with the others later
SCOPES = (MODEL, LAYER_METRICS, RESERVOIR, SHARD)

Parse = Callable[[Any, Path | None], Any]


@dataclass(frozen=True)
class RunOption:
    """One run option as every front end sees it. ``name`` is the RunSpec field, the keyword of
    :func:`make_spec` and the config key; ``flag`` its command-line spelling."""

    name: str
    default: Any  # the value when not given (as a user would give it: "builtin", not a DataSpec)
    help: str  # the flag's help; README's option table says the same
    toml: tuple[type, ...]  # the types a TOML value may have (config and settings files)
    parse: Parse  # (value given, folder relative paths start from) -> the RunSpec's value
    choices: tuple[str, ...] = ()  # the command line refuses anything else (argparse)
    switch: bool = False  # an on/off flag: ``--exact`` turns it on
    repeat: bool = False  # a flag given once per value: ``--modules A --modules B``
    metavar: str | None = None
    scope: str = MODEL  # the experiments that declare this scope take it
    in_settings: bool = True  # the app's settings file ``[run]`` may set it
    label: str = ""  # its field in the app's options dialog ("": not in the dialog)
    hint: str = ""  # a free-text field's placeholder
    menu: tuple[str, ...] = ()  # a dialog field offering these values (else free text, or on/off)
    aliases: tuple[tuple[str, str], ...] = ()  # other spellings of choices: ("fp16", "float16")

    def unalias(self, value: Any) -> Any:
        """``fp16`` -> ``float16``: a choice's other spelling as the choice (else as given)."""
        return dict(self.aliases).get(value.lower(), value) if isinstance(value, str) else value

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _option(*, default: Any = None, required: bool = False, **meta: Any) -> Any:
    """A RunSpec field declared as a run option (``required``: a field without a default)."""
    info = {"run_option": meta | {"default": default}}
    return field(metadata=info) if required else field(default=default, metadata=info)


def _positive(name: str, value: object, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(str(value))
        except ValueError:
            raise IsotuiError(f"{name} must be a positive integer (got {value!r})") from None
    if value <= 0:
        raise IsotuiError(f"{name} must be a positive integer (got {value})")
    return value


def _count(name: str, allow_none: bool = True) -> Parse:
    return lambda value, _base: _positive(name, value, allow_none)


def _choice(
    name: str, choices: tuple[str, ...], said: str, aliases: tuple[tuple[str, str], ...] = ()
) -> Parse:
    def parse(value: Any, _base: Path | None) -> str:
        value = dict(aliases).get(value.lower(), value) if isinstance(value, str) else value
        if value not in choices:
            raise IsotuiError(f"{name} must be {said} (got {value!r})")
        return str(value)

    return parse


def _data(value: Any, base: Path | None) -> DataSpec:
    return value if isinstance(value, DataSpec) else parse_data(str(value), base)


def _threads(value: Any) -> int | None:
    """A positive count within :func:`isotui.extract.threads.max_threads` (checked before any work)."""
    count = _positive("threads", value)
    return None if count is None else check_threads(count)


def _batch_size(value: Any, _base: Path | None) -> int | None:
    return None if value == "auto" else _positive("batch-size", value)


def _seed(value: Any, _base: Path | None) -> int:
    try:
        seed = int(value)
    except (TypeError, ValueError):
        raise IsotuiError(f"seed must be an integer (got {value!r})") from None
    if not 0 <= seed < 2**32:
        raise IsotuiError(f"seed must be between 0 and 4294967295 (got {seed})")
    return seed


def _tokenizer(value: object, _base: Path | None = None) -> str | None:
    """A hub id as given; a local folder (``./tok``, ``~/tok``, an existing path) made absolute
    (a config file has made its own relative folders absolute already)."""
    if value is None:
        return None
    if not isinstance(value, str | Path):  # the API's tokenizer= (the flag and the TOML are text)
        kind = type(value).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise IsotuiError(
            f"tokenizer= with a model name takes the name of a tokenizer (a hub id, minilm, or a "
            f"folder), not {article} {kind}; a tokenizer object goes with a model object, "
            "isotui.run(model, tokenizer=tok)"
        )
    text = str(value).strip()
    if not text:
        raise IsotuiError("tokenizer must name a tokenizer: a hub id, minilm, or a folder")
    local = Path(text).expanduser()
    if text.startswith((".", "/", "~")) or local.is_dir():
        if not local.is_dir():
            raise IsotuiError(f"tokenizer folder {local} does not exist")
        return str(local.resolve())
    return text


def _switch(name: str) -> Parse:
    """The parse of an on/off option ``name`` (a TOML or API value must be a bool)."""

    def parse(value: Any, _base: Path | None) -> bool:
        if not isinstance(value, bool):
            raise IsotuiError(f"{name} must be true or false (got {value!r})")
        return value

    return parse


def _modules(value: Any, _base: Path | None) -> tuple[str, ...] | None:
    """``--modules``: module name globs and named sites (a flag per value, a TOML list, or one
    string of them split at commas), in the order given; None when none."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(v, str) for v in items):
        raise IsotuiError(f"modules must be module name globs or named sites, as strings (got {value!r})")
    globs = tuple(dict.fromkeys(v.strip() for v in items if v.strip()))
    if items and not globs:
        raise IsotuiError(
            "modules must name modules: a glob of names in model.named_modules() (encoder.layer.*.output) "
            "or a named site (resid_post, attn_out, mlp_out, norm_in)"
        )
    return globs or None


MAX_SHARDS = 10_000  # K of --shard I/K and [sweep] shards: each shard is a process and a cache entry
SHARD_FORM = "I/K, the I-th of K slices counted from 0 as $SLURM_ARRAY_TASK_ID is (0/4 to 3/4 of 4)"


def _shard(value: Any, _base: Path | None) -> tuple[int, int] | None:
    """``I/K`` (or an (I, K) pair from the Python API) -> (I, K), 0 <= I < K."""
    if value is None:
        return None
    if isinstance(value, tuple | list) and len(value) == 2:
        text = f"{value[0]}/{value[1]}"
    else:
        text = str(value).strip()
    index, _, count = text.partition("/")
    if not (index.strip().isdigit() and count.strip().isdigit()):
        raise IsotuiError(f"shard must be {SHARD_FORM} (got {value!r})")
    i, k = int(index), int(count)
    if k < 1:
        raise IsotuiError(f"shard {text} splits the samples into no slices: K must be at least 1")
    if k > MAX_SHARDS:
        raise IsotuiError(
            f"shard {text}: K must be at most {MAX_SHARDS:,} (each shard is a process of its own and "
            "needs samples of its own)"
        )
    if i >= k:
        raise IsotuiError(
            f"shard {text} does not exist: shards count from 0 as $SLURM_ARRAY_TASK_ID does, so {k} "
            f"shards are 0/{k} to {k - 1}/{k}"
        )
    return i, k


@dataclass(frozen=True)
class RunSpec:
    """How to measure one model. Validated on construction (see :func:`make_spec`). The fields
    after ``model`` are the run options, in the order the command line's help and the options
    dialog list them."""

    model: str
    data: DataSpec = _option(  # noqa: RUF009 (dataclasses.field with metadata: no default)
        required=True,
        default="builtin",
        help="builtin (default), text:PATH, jsonl:PATH[:FIELD], hf:NAME[:CONFIG]:SPLIT[:FIELD][:N], "
        "images:DIR, audio:DIR, synthetic:images, synthetic:audio",
        toml=(str,),
        parse=_data,
        label="data source",
        hint="builtin, text:PATH, jsonl:PATH, hf:NAME:SPLIT, images:DIR, audio:DIR, synthetic:images",
    )
    max_samples: int | None = _option(
        help="keep the first N samples",
        toml=(int,),
        parse=_count("max-samples"),
        label="max samples",
        hint="empty: all samples",
    )
    max_length: int | None = _option(
        help="truncate each sample to L tokens (default: model limit, at most 512)",
        toml=(int,),
        parse=_count("max-length"),
        label="max length",
        hint="tokens per sample; empty: model limit, at most 512",
    )
    batch_size: int | None = _option(
        help="samples per batch (default auto: a token budget)",
        toml=(int, str),
        parse=_batch_size,
        label="batch size",
        hint="empty: auto (a token budget; halves on out-of-memory)",
    )
    device: str = _option(
        default="auto",
        help="auto (cuda, mps, cpu), cpu, cuda, cuda:N, mps",
        toml=(str,),
        parse=lambda value, _base: validate_device(str(value)),
        label="device",
        menu=("auto", "cpu", "cuda", "mps"),
    )
    # across devices through accelerate: where the model sits, never what is measured (not in the key)
    device_map: str | None = _option(
        help="place the model across devices through accelerate, as transformers' from_pretrained "
        "does: auto, balanced, balanced_low_0 or sequential (parts that fit nowhere go to disk); "
        "each layer's sums stay on the device of its hidden states",
        toml=(str,),
        parse=lambda value, _base: (
            None
            if value in (None, "", "none")
            else _choice("device-map", DEVICE_MAPS, "one of " + ", ".join(DEVICE_MAPS))(value, _base)
        ),
        choices=DEVICE_MAPS,
        label="device map",
        menu=("none", *DEVICE_MAPS),
    )
    max_memory: tuple[tuple[int | str, int], ...] | None = _option(
        help="what each device may hold under --device-map (alone: --device-map auto), as "
        "0=70GiB,1=70GiB,cpu=200GiB (GPU numbers, cpu, disk)",
        toml=(str, dict),
        parse=lambda value, _base: parse_max_memory(value if value != "" else None),
        metavar="DEV=SIZE,...",
        label="max memory",
        hint="with a device map: 0=70GiB,1=70GiB,cpu=200GiB",
    )
    # CPU threads: how fast, never what is measured (not in the cache key; see extract/threads.py)
    threads: int | None = _option(
        help="CPU threads for torch (default: the cores this process may use, fewer when the "
        "load average says the machine is busy)",
        toml=(int,),
        parse=lambda value, _base: _threads(value),
        label="threads",
        hint="empty: the usable cores, fewer on a loaded machine",
    )
    dtype: str = _option(
        default="auto",
        help="auto: float32 on CPU, the checkpoint's half dtype on a GPU (fp32, bf16, fp16 also said so)",
        toml=(str,),
        parse=_choice("dtype", DTYPES, "one of " + ", ".join(DTYPES), DTYPE_ALIASES),
        choices=DTYPES,
        aliases=DTYPE_ALIASES,
        label="dtype",
        menu=DTYPES,
    )
    special_tokens: str = _option(
        default="exclude",
        help="count CLS/SEP/BOS/EOS... (default exclude)",
        toml=(str,),
        parse=_choice("special-tokens", SPECIAL_TOKENS, "exclude or include"),
        choices=SPECIAL_TOKENS,
        label="special tokens",
        menu=SPECIAL_TOKENS,
    )
    seed: int = _option(
        default=0,
        help="seed for random init and the reservoir sample (default 0)",
        toml=(int,),
        parse=_seed,
    )
    # a text model's tokenizer when not its own
    tokenizer: str | None = _option(
        help="a text model's tokenizer, for a model folder without a usable one of its own "
        "(a hub id, minilm, or a folder)",
        toml=(str,),
        parse=_tokenizer,
        metavar="NAME_OR_DIR",
    )
    trust_remote_code: bool = _option(
        default=False,
        help="allow a model's own code from the hub (off by default)",
        toml=(bool,),
        parse=lambda value, _base: bool(value),
        switch=True,
        in_settings=False,  # remote code stays explicit: only the command line turns it on
    )
    # conv maps: auto, image (one flattened vector each) or position
    map_units: str = _option(
        default="auto",
        help="conv feature maps: image = each image's map flattened to one vector (Godey et al. "
        "Fig. 4), position = each spatial position's channel vector; auto: image for CNNs, "
        "position for token grids (SegFormer, timm ViTs)",
        toml=(str,),
        parse=_choice("map-units", MAP_UNITS, "auto, image or position"),
        choices=MAP_UNITS,
        scope=LAYER_METRICS,
        label="conv map units",
        menu=MAP_UNITS,
    )
    reservoir: int = _option(
        default=4096,
        help="vectors per layer kept for centred metrics (default 4096)",
        toml=(int,),
        parse=_count("reservoir", allow_none=False),
        scope=RESERVOIR,
    )
    # a second pass: the reservoir metrics over every vector
    exact: bool = _option(
        default=False,
        help="a second pass over the data: avg_cos_centered, I(W), all-but-the-top and "
        "standardised avg_cos over every vector rather than the reservoir (about twice the time)",
        toml=(bool,),
        parse=_switch("exact"),
        switch=True,
        scope=LAYER_METRICS,
        label="exact (2nd pass)",
    )
    # the outputs of chosen modules instead of the hidden states (extract/modules.py)
    modules: tuple[str, ...] | None = _option(
        help="measure the output of every module whose name in model.named_modules() matches GLOB "
        "(repeatable; * within one dotted name, ** across dots) or of a named site: resid_post (the "
        "default rows), attn_out, mlp_out, norm_in; one row per module, in the order they run, named in "
        "the CSV's module column",
        toml=(str, list),
        parse=_modules,
        repeat=True,
        metavar="GLOB",
        scope=LAYER_METRICS,
        in_settings=False,  # what one run measures, not a lasting setting of the app
    )
    # read a text corpus as a stream (window by window) rather than whole: flat memory
    stream: bool = _option(
        default=False,
        help="read text, JSONL and hf: text data as a stream, tokenised and length-sorted in "
        "windows of 4096 samples, so memory does not grow with the corpus (automatic for a text or "
        "JSONL file over 256 MiB)",
        toml=(bool,),
        parse=_switch("stream"),
        switch=True,
        label="stream",
    )
    # one of K disjoint slices of the samples, its partial state cached to merge with the others
    shard: tuple[int, int] | None = _option(
        help="run the I-th of K disjoint slices of the samples (I from 0 to K-1, as "
        "$SLURM_ARRAY_TASK_ID of --array=0-(K-1)) and keep its partial state in the cache; the "
        "last of the K shards, or a plain run once all are cached, merges them",
        toml=(str,),
        parse=_shard,
        metavar="I/K",
        scope=SHARD,
        in_settings=False,  # one process's slice: never a lasting setting of the app
    )
    # the app's max length is a ceiling: longer than the model accepts is capped (with a notice),
    # where the CLI's explicit --max-length is refused
    cap_max_length: bool = False
    # a model object handed to the Python API (isotui.models.given.GivenModel): measured where it
    # sits instead of loading ``model`` (then its label); keyed by its weights' fingerprint
    given: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_memory is not None and self.device_map is None:  # budgets are for a device map
            object.__setattr__(self, "device_map", "auto")

    def with_model(self, model: str) -> RunSpec:
        return replace(self, model=model)


RUN_OPTIONS: tuple[RunOption, ...] = tuple(
    RunOption(name=f.name, **f.metadata["run_option"]) for f in fields(RunSpec) if "run_option" in f.metadata
)
OPTIONS_BY_NAME: dict[str, RunOption] = {o.name: o for o in RUN_OPTIONS}
# make_spec's keyword options: what a config file, the settings file or the app may set.
SPEC_OPTIONS = ("base_dir", *OPTIONS_BY_NAME)


def options_in(scopes: tuple[str, ...]) -> tuple[RunOption, ...]:
    """The run options of ``scopes`` (what an experiment declares), in declaration order."""
    return tuple(o for o in RUN_OPTIONS if o.scope in scopes)


def make_spec(model: str, data: Any = "builtin", *, base_dir: Path | None = None, **options: Any) -> RunSpec:
    """Build a :class:`RunSpec` from run options as given (strings from flags, TOML values, the
    dialog's text); an option not given takes its default. Each bad value is one sentence naming
    the setting, checked in declaration order."""
    unknown = set(options) - set(OPTIONS_BY_NAME)
    if unknown:
        raise TypeError(f"make_spec() got unknown run options: {', '.join(sorted(unknown))}")
    given = {"data": data, **options}
    values = {o.name: o.parse(given.get(o.name, o.default), base_dir) for o in RUN_OPTIONS}
    if values["device_map"] is not None and values["device"] != "auto":
        raise IsotuiError(
            f"--device {values['device']} and --device-map {values['device_map']} both say where the model "
            "goes; give one (--device-map spreads it over the devices --max-memory names)"
        )
    return RunSpec(model=model, **values)


def given_options(settings: Mapping[str, Any], options: Sequence[RunOption] = RUN_OPTIONS) -> dict[str, Any]:
    """The run options ``settings`` (parsed flags, a config file's keys) gives among ``options``
    (a command's: :func:`isotui.experiments.registry.options_for`; else any): None means not
    given, so the option keeps its default."""
    names = {o.name for o in options}
    return {k: v for k, v in settings.items() if k in names and v is not None}
