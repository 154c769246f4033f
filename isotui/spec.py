"""RunSpec: the validated settings of a layer-wise run, shared by the CLI, config files and TUI."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from isotui.data.sources import DataSpec, parse_data
from isotui.errors import IsotuiError
from isotui.extract.device import DTYPES, validate_device

MAP_UNITS = ("auto", "image", "position")
# make_spec's keyword options: what a config file, the settings file or the app may set.
SPEC_OPTIONS = (
    "data",
    "base_dir",
    "max_samples",
    "max_length",
    "special_tokens",
    "batch_size",
    "device",
    "dtype",
    "seed",
    "reservoir",
    "trust_remote_code",
    "map_units",
    "tokenizer",
    "exact",
)

SPECIAL_TOKENS = ("exclude", "include")


@dataclass(frozen=True)
class RunSpec:
    """How to measure one model. Validated on construction (see :func:`make_spec`)."""

    model: str
    data: DataSpec
    max_samples: int | None = None
    max_length: int | None = None
    special_tokens: str = "exclude"
    batch_size: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    reservoir: int = 4096
    trust_remote_code: bool = False
    map_units: str = "auto"  # conv maps: auto, image (one flattened vector each) or position
    # the app's max length is a ceiling: longer than the model accepts is capped (with a notice),
    # where the CLI's explicit --max-length is refused
    cap_max_length: bool = False
    tokenizer: str | None = None  # a text model's tokenizer when not its own (--tokenizer)
    exact: bool = False  # a second pass: the reservoir metrics over every vector

    def with_model(self, model: str) -> RunSpec:
        return replace(self, model=model)


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


def make_spec(
    model: str,
    data: str | DataSpec = "builtin",
    *,
    base_dir: Path | None = None,
    max_samples: object = None,
    max_length: object = None,
    special_tokens: str = "exclude",
    batch_size: object = None,
    device: str = "auto",
    dtype: str = "auto",
    seed: object = 0,
    reservoir: object = 4096,
    trust_remote_code: bool = False,
    map_units: str = "auto",
    tokenizer: str | None = None,
    exact: object = False,
) -> RunSpec:
    """Build a :class:`RunSpec`, turning each bad value into one sentence naming the setting."""
    if special_tokens not in SPECIAL_TOKENS:
        raise IsotuiError(f"special-tokens must be exclude or include (got {special_tokens!r})")
    if dtype not in DTYPES:
        raise IsotuiError(f"dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    if map_units not in MAP_UNITS:
        raise IsotuiError(f"map-units must be auto, image or position (got {map_units!r})")
    if not isinstance(exact, bool):
        raise IsotuiError(f"exact must be true or false (got {exact!r})")
    if batch_size == "auto":
        batch_size = None
    try:
        seed_value = int(seed)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise IsotuiError(f"seed must be an integer (got {seed!r})") from None
    if not 0 <= seed_value < 2**32:
        raise IsotuiError(f"seed must be between 0 and 4294967295 (got {seed_value})")
    return RunSpec(
        model=model,
        data=data if isinstance(data, DataSpec) else parse_data(str(data), base_dir),
        max_samples=_positive("max-samples", max_samples),
        max_length=_positive("max-length", max_length),
        special_tokens=special_tokens,
        batch_size=_positive("batch-size", batch_size),
        device=validate_device(str(device)),
        dtype=dtype,
        seed=seed_value,
        reservoir=_positive("reservoir", reservoir, allow_none=False) or 4096,
        trust_remote_code=bool(trust_remote_code),
        map_units=map_units,
        tokenizer=_tokenizer(tokenizer),
        exact=exact,
    )


def _tokenizer(value: object) -> str | None:
    """A hub id as given; a local folder (``./tok``, ``~/tok``, an existing path) made absolute
    (a config file has made its own relative folders absolute already)."""
    if value is None:
        return None
    text = str(value).strip()
    if not text:
        raise IsotuiError("tokenizer must name a tokenizer: a hub id, minilm, or a folder")
    local = Path(text).expanduser()
    if text.startswith((".", "/", "~")) or local.is_dir():
        if not local.is_dir():
            raise IsotuiError(f"tokenizer folder {local} does not exist")
        return str(local.resolve())
    return text
