"""Data sources. Text: ``builtin``, ``text:PATH``, ``jsonl:PATH[:FIELD]``. Media: ``images:DIR``,
``audio:DIR``, ``synthetic:images``, ``synthetic:audio``. Either: ``hf:NAME[:CONFIG]:SPLIT[:FIELD][:N]``
(a text, image or audio column of a Hugging Face dataset: :mod:`isotui.data.hf`).

Every source yields non-empty samples in a fixed order; ``max_samples`` keeps the first N. A text
sample is its text; a media sample is an absolute file path or a synthetic item's name, decoded
by :mod:`isotui.data.media` batch by batch (so a large folder never sits in memory). The cache
fingerprint is a hash of the samples actually used (file contents included, for media), so an
edited file is a new key.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from isotui.data.lazy import LazySamples
from isotui.errors import IsotuiError
from isotui.paths import builtin_corpus_path

SCHEMES = ("builtin", "text", "jsonl", "hf", "images", "audio", "synthetic")
MEDIA = {"images": "image", "audio": "audio"}  # scheme (or synthetic kind) -> modality
SYNTHETIC_KINDS = ("images", "audio")
SYNTHETIC_DEFAULT_COUNT = 256
SYNTHETIC_MAX = 10_000_000  # items a synthetic source gives at most (each one a forward pass)
LINE_CHARS_PER_TOKEN = 64  # a text sample is cut at 64 characters per token of --max-length ...
DEFAULT_MAX_LENGTH = 512  # ... or of the default limit, while reading: never tokenised whole
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg")  # Common Voice ships mp3
_SPLIT = re.compile(r"^(train|validation|valid|test|dev)(\[.*\])?$")
# a split as datasets reads it: NAME or NAME[START:END] (rows or percentages), joined with +
_SPLIT_SPEC = re.compile(r"^[\w.-]+(\[(-?\d+%?)?:(-?\d+%?)?\])?(\+[\w.-]+(\[(-?\d+%?)?:(-?\d+%?)?\])?)*$")
_COUNT = re.compile(r"^[-+]?\d[\d_,.]*$")  # a last hf: part meant as a row count


@dataclass(frozen=True)
class DataSpec:
    """A parsed ``--data`` value. ``path`` is absolute for file sources."""

    scheme: str
    path: str = ""
    field: str = "text"
    name: str = ""
    config: str | None = None
    split: str = ""

    @property
    def modality(self) -> str:
        """``text``, ``image`` or ``audio``: what the model must take."""
        if self.scheme == "synthetic":
            return MEDIA[self.name]
        if self.scheme == "hf":  # the column's type: the dataset is opened once to see it
            from isotui.data.hf import modality

            return modality(self)
        return MEDIA.get(self.scheme, "text")

    def describe(self) -> str:
        if self.scheme == "builtin":
            return "builtin"
        if self.scheme in MEDIA:
            return f"{self.scheme}:{self.path}"
        if self.scheme == "synthetic":
            return f"synthetic:{self.name}"
        if self.scheme == "text":
            return f"text:{self.path}"
        if self.scheme == "jsonl":
            return f"jsonl:{self.path}:{self.field}"
        parts = [self.name, *([self.config] if self.config else []), self.split, self.field]
        return "hf:" + ":".join(p for p in parts if p)


def parse_data(value: str, base_dir: Path | None = None) -> DataSpec:
    """Parse a ``--data`` value; relative paths are taken from ``base_dir`` (default: cwd)."""
    text = value.strip()
    scheme, _, rest = text.partition(":")
    if scheme == "builtin":
        if rest:
            raise IsotuiError(f"data source {value!r}: builtin takes no argument; use --data builtin")
        return DataSpec("builtin")
    if scheme not in SCHEMES:
        raise IsotuiError(
            f"data source {value!r} has an unknown scheme; use builtin, text:PATH, "
            "jsonl:PATH[:FIELD], hf:NAME[:CONFIG]:SPLIT[:FIELD][:N], images:DIR, audio:DIR, "
            "synthetic:images or synthetic:audio"
        )
    if not rest:
        raise IsotuiError(f"data source {value!r} says {scheme}: but gives nothing after it")
    base = base_dir or Path.cwd()
    if scheme in MEDIA:
        return DataSpec(scheme, path=str((base / Path(rest).expanduser()).resolve()))
    if scheme == "synthetic":
        if rest not in SYNTHETIC_KINDS:
            raise IsotuiError(f"data source {value!r}: use synthetic:images or synthetic:audio")
        return DataSpec("synthetic", name=rest)
    if scheme == "text":
        return DataSpec("text", path=str((base / Path(rest).expanduser()).resolve()))
    if scheme == "jsonl":
        path, field = rest, "text"
        if not (base / Path(rest).expanduser()).is_file() and ":" in rest:
            path, _, field = rest.rpartition(":")
        return DataSpec("jsonl", path=str((base / Path(path).expanduser()).resolve()), field=field or "text")
    parts = re.split(r":(?![^\[]*\])", rest)  # a split slice like train[:100] keeps its colon
    count = parts.pop() if len(parts) >= 3 and _COUNT.match(parts[-1]) else None
    if len(parts) == 2:
        name, config, split, field = parts[0], None, parts[1], ""
    elif len(parts) == 3 and _SPLIT.match(parts[1]):
        name, config, split, field = parts[0], None, parts[1], parts[2]
    elif len(parts) == 3:
        name, config, split, field = parts[0], parts[1], parts[2], ""
    elif len(parts) == 4:
        name, config, split, field = parts
    else:
        raise IsotuiError(f"data source {value!r} is not hf:NAME[:CONFIG]:SPLIT[:FIELD][:N]")
    split = _hf_slice(value, split, count)
    local = base / Path(name).expanduser()
    if name.startswith((".", "/", "~")) or local.is_dir():
        name = str(local.resolve())
    return DataSpec("hf", name=name, config=config, split=split, field=field)


def _hf_slice(value: str, split: str, count: str | None) -> str:
    """``SPLIT`` with ``:N`` folded in as ``SPLIT[:N]`` (the first N rows, as datasets slices)."""
    if count is not None:
        if not count.isdigit() or int(count) < 1:
            raise IsotuiError(
                f"data source {value!r}: the row count {count!r} is not a positive integer "
                "(hf:NAME[:CONFIG]:SPLIT[:FIELD]:N keeps the split's first N rows)"
            )
        if "[" in split:
            raise IsotuiError(f"data source {value!r} slices the split twice; give SPLIT[:N] or :N, not both")
        split = f"{split}[:{int(count)}]"
    if not _SPLIT_SPEC.match(split):
        raise IsotuiError(
            f"data source {value!r}: split {split!r} is not SPLIT or SPLIT[START:END] "
            "(rows or percentages, as in validation[:100] or train[10%:20%])"
        )
    return split


class Samples(list[str]):
    """A list of text samples with what reading them did to them (``notes``: cut lines)."""

    notes: list[str]
    source = ""  # the hf: spec they came from, for the sentence when the model takes no text


class SyntheticSamples(LazySamples):
    """``synthetic:NAME#0`` .. ``#count-1``, made on demand: a large --max-samples costs nothing
    until each item is fed."""

    def __init__(self, name: str, count: int) -> None:
        # not ``self.count``: that would hide Sequence.count(value)
        self.name, self.size = name, count
        self.notes: list[str] = []

    def __len__(self) -> int:
        return self.size

    def _item(self, index: int) -> str:
        return f"synthetic:{self.name}#{index}"

    def __iter__(self) -> Iterator[str]:
        return (f"synthetic:{self.name}#{i}" for i in range(self.size))


def line_cap(max_length: int | None) -> int:
    """Characters a text sample keeps while reading: far more than ``max_length`` tokens span."""
    return LINE_CHARS_PER_TOKEN * (max_length or DEFAULT_MAX_LENGTH)


def load_samples(
    spec: DataSpec, max_samples: int | None = None, max_length: int | None = None
) -> Sequence[str]:
    """The first ``max_samples`` non-empty samples of ``spec``, in source order.

    Text samples longer than :func:`line_cap` characters are cut as they are read (said in the
    samples' ``notes``); synthetic sources are lazy (:class:`SyntheticSamples`).
    """
    if spec.scheme == "synthetic":
        count = max_samples or SYNTHETIC_DEFAULT_COUNT
        if count > SYNTHETIC_MAX:
            raise IsotuiError(
                f"--max-samples {count:,} is more than synthetic:{spec.name} gives "
                f"(at most {SYNTHETIC_MAX:,} items); give a smaller number"
            )
        return SyntheticSamples(spec.name, count)
    cap = line_cap(max_length)
    if spec.scheme == "builtin":
        samples = _read_lines(builtin_corpus_path(), "the built-in corpus")
    elif spec.scheme == "text":
        samples = _read_lines(Path(spec.path), f"data file {spec.path}")
    elif spec.scheme == "jsonl":
        samples = _read_jsonl(Path(spec.path), spec.field, max_samples)
    elif spec.scheme in MEDIA:
        suffixes = IMAGE_SUFFIXES if spec.scheme == "images" else AUDIO_SUFFIXES
        samples = _list_media(Path(spec.path), suffixes, spec.scheme)
    elif spec.scheme == "hf" and spec.modality != "text":
        from isotui.data.hf import media_samples

        return media_samples(spec, max_samples)  # left in the Arrow table, decoded batch by batch
    else:
        samples = _read_hf(spec, max_samples)
    samples = Samples(samples[:max_samples] if max_samples is not None else samples)
    samples.notes = []
    if spec.scheme == "hf":
        samples.source = spec.describe()
    if not samples:
        raise IsotuiError(f"data source {spec.describe()} has no non-empty samples")
    if spec.modality == "text":
        cut = [i for i, s in enumerate(samples) if len(s) > cap]
        for i in cut:
            samples[i] = samples[i][:cap]
        if cut:
            samples.notes.append(cut_note(len(cut), cap))
    return samples


def cut_note(count: int, cap: int) -> str:
    """What the table says when ``count`` samples were cut at ``cap`` characters while reading."""
    return (
        f"{count} sample(s) longer than {cap:,} characters ({LINE_CHARS_PER_TOKEN} per token "
        "of the length limit) were cut while reading"
    )


def fingerprint(samples: Sequence[str], spec: DataSpec | None = None) -> str:
    """A hash of exactly the samples that are measured: texts, or media files' contents (a
    renamed folder with the same files is the same data), or the synthetic generator's version."""
    digest = getattr(samples, "digest", None)  # a streamed corpus hashed itself while read
    if isinstance(digest, str):
        return digest
    h = hashlib.sha256()
    if hasattr(samples, "fingerprint"):  # an hf: image or audio column: its rows' encoded bytes
        return str(samples.fingerprint())
    if spec is not None and spec.scheme in MEDIA:
        root = Path(spec.path)
        for s in samples:
            h.update(str(Path(s).relative_to(root)).encode("utf-8") + b"\x00")
            h.update(_file_digest(Path(s)))
        return "sha256:" + h.hexdigest()
    if spec is not None and spec.scheme == "synthetic":
        from isotui.data.media import SYNTHETIC_VERSION

        h.update(f"synthetic:{spec.name}:v{SYNTHETIC_VERSION}:{len(samples)}".encode())
        return "sha256:" + h.hexdigest()
    for s in samples:
        h.update(s.encode("utf-8"))
        h.update(b"\x00")
    return "sha256:" + h.hexdigest()


def _file_digest(path: Path) -> bytes:
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as exc:
        raise IsotuiError(f"data file {path} cannot be read: {exc.strerror}") from None
    return h.digest()


def check_source(spec: DataSpec) -> None:
    """Fail at once, in one sentence, when a data file or folder is missing: before any model is
    loaded or looked up, so a preset whose data is absent says so first."""
    if spec.scheme in ("text", "jsonl") and not Path(spec.path).is_file():
        raise IsotuiError(f"data file {spec.path} does not exist (or is not a file)")
    if spec.scheme == "hf":  # the dataset, split and column exist (remembered for the run)
        _ = spec.modality
    if spec.scheme in MEDIA:
        _require_dir(
            Path(spec.path), IMAGE_SUFFIXES if spec.scheme == "images" else AUDIO_SUFFIXES, spec.scheme
        )


def _require_dir(root: Path, suffixes: tuple[str, ...], scheme: str) -> None:
    if not root.is_dir():
        raise IsotuiError(
            f"data folder {root} does not exist (or is not a folder); give {scheme}:DIR a folder of "
            f"{'/'.join(s[1:] for s in suffixes)} files"
        )


def _list_media(root: Path, suffixes: tuple[str, ...], scheme: str) -> list[str]:
    """Every file under ``root`` (recursively) with one of ``suffixes``, in path order."""
    _require_dir(root, suffixes, scheme)
    files = sorted(str(p) for p in root.rglob("*") if p.suffix.lower() in suffixes and p.is_file())
    if not files:
        raise IsotuiError(f"data folder {root} has no {'/'.join(s[1:] for s in suffixes)} files")
    return files


def _read_text(path: Path, what: str) -> str:
    if not path.is_file():
        raise IsotuiError(f"{what} does not exist (or is not a file)")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise IsotuiError(f"{what} is not UTF-8 text (byte {exc.start}); convert it to UTF-8") from None
    except OSError as exc:
        raise IsotuiError(f"{what} cannot be read: {exc.strerror}") from None


def _read_lines(path: Path, what: str) -> list[str]:
    return [line.strip() for line in _read_text(path, what).splitlines() if line.strip()]


def _read_jsonl(path: Path, field: str, max_samples: int | None) -> list[str]:
    out: list[str] = []
    for lineno, line in enumerate(_read_text(path, f"data file {path}").splitlines(), 1):
        value = jsonl_value(path, field, lineno, line)
        if value:
            out.append(value)
            if max_samples is not None and len(out) >= max_samples:
                break
    return out


def jsonl_value(path: Path, field: str, lineno: int, line: str) -> str:
    """The stripped text of ``field`` on one JSONL line ("" for a blank line or value)."""
    if lineno == 1:
        line = line.removeprefix("\ufeff")  # a byte-order mark (Windows editors) starts no record
    if not line.strip():
        return ""
    try:
        record = json.loads(line)
    except ValueError:
        raise IsotuiError(f"data file {path} line {lineno} is not valid JSON") from None
    if not isinstance(record, dict) or field not in record:
        have = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise IsotuiError(
            f"data file {path} line {lineno} has no field {field!r} (it has: {have}); "
            f"name the field as jsonl:{path}:FIELD"
        )
    value = record[field]
    if not isinstance(value, str):
        raise IsotuiError(f"data file {path} line {lineno}: field {field!r} is not a string")
    return value.strip()


def _read_hf(spec: DataSpec, max_samples: int | None) -> list[str]:
    from isotui.data.hf import open_split, pick_column

    ds = open_split(spec)
    field, _ = pick_column(spec, ds)
    out: list[str] = []
    for value in ds[field] if max_samples is None else ds.select_columns([field]):
        value = value[field] if isinstance(value, dict) else value
        if isinstance(value, str) and value.strip():
            out.append(value.strip())
            if max_samples is not None and len(out) >= max_samples:
                break
    return out
