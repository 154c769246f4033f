"""Streamed text corpora (``--stream``, and text or JSONL files above :data:`STREAM_AUTO_BYTES`).

A :class:`StreamedSamples` is the same samples :func:`isotui.data.sources.load_samples` would give
(stripped, non-empty, cut at :func:`line_cap` characters, the first ``max_samples``), read again
from the source each time it is iterated, so no list of the corpus is ever held. Opening one reads
the source once without a tokenizer or a model (the *scan*): it counts the samples and hashes them
exactly as :func:`isotui.data.sources.fingerprint` hashes a list, so a streamed run has the same
cache key as a plain run of the same samples and is looked up before any model is loaded. The
engine then tokenises it window by window (:mod:`isotui.extract.streaming`).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

from isotui.data.lazy import LazySamples
from isotui.data.sources import DataSpec, cut_note, jsonl_value, line_cap, load_samples
from isotui.errors import IsotuiError
from isotui.paths import builtin_corpus_path

STREAM_AUTO_BYTES = 256 << 20  # a text or JSONL file larger than 256 MiB streams without --stream
STREAMABLE = ("builtin", "text", "jsonl", "hf")


class StreamedSamples(LazySamples):
    """A text corpus read from its source on each iteration (see the module's doc).

    ``digest`` is the content hash, ``notes`` what reading did (cut samples); indexing walks the
    stream (for a few look-ups, never for batches).
    """

    def __init__(self, spec: DataSpec, max_samples: int | None, max_length: int | None) -> None:
        if spec.scheme not in STREAMABLE:
            raise IsotuiError(_cannot(spec))
        self.spec, self.max_samples, self.cap = spec, max_samples, line_cap(max_length)
        self.notes: list[str] = []
        h = hashlib.sha256()
        size = cut = 0
        for text in self._read():
            if len(text) > self.cap:
                cut += 1
            h.update(text[: self.cap].encode("utf-8"))
            h.update(b"\x00")
            size += 1
        if not size:
            raise IsotuiError(f"data source {spec.describe()} has no non-empty samples")
        self.size = size
        self.digest = "sha256:" + h.hexdigest()
        if cut:
            self.notes.append(cut_note(cut, self.cap))

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[str]:
        return (text[: self.cap] for text in self._read())

    def _item(self, index: int) -> str:
        return next(itertools.islice(self, index, None))

    def _items(self, indexes: range) -> list[str]:  # one pass over the file, not one per sample
        return list(itertools.islice(self, indexes.start, indexes.stop, indexes.step))

    def _read(self) -> Iterator[str]:
        """The stripped non-empty samples, uncut, the first ``max_samples``."""
        spec = self.spec
        if spec.scheme == "hf":
            texts = _hf_texts(spec)
        elif spec.scheme == "jsonl":
            path = Path(spec.path)
            texts = (jsonl_value(path, spec.field, n, line) for n, line in _lines(path, f"data file {path}"))
        else:
            path = builtin_corpus_path() if spec.scheme == "builtin" else Path(spec.path)
            what = "the built-in corpus" if spec.scheme == "builtin" else f"data file {spec.path}"
            texts = (line.strip() for _, line in _lines(path, what))
        return itertools.islice((t for t in texts if t), self.max_samples)


def open_samples(
    spec: DataSpec, max_samples: int | None, max_length: int | None, *, stream: bool = False
) -> Sequence[str]:
    """The run's samples: streamed with ``stream`` (or a text/JSONL file above
    :data:`STREAM_AUTO_BYTES`), else read whole by :func:`load_samples`."""
    if stream or auto_stream(spec):
        return StreamedSamples(spec, max_samples, max_length)
    return load_samples(spec, max_samples, max_length)


def auto_stream(spec: DataSpec) -> bool:
    """Whether ``spec`` is a text or JSONL file so large that it streams without ``--stream``."""
    if spec.scheme not in ("text", "jsonl"):
        return False
    try:
        return Path(spec.path).stat().st_size > STREAM_AUTO_BYTES
    except OSError:
        return False  # load_samples says what is wrong with it


def _cannot(spec: DataSpec) -> str:
    return (
        f"--stream reads text, JSONL and hf: text sources, not {spec.describe()}; drop --stream "
        "(image and audio files are already read batch by batch)"
    )


def _lines(path: Path, what: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 file, split as ``str.splitlines`` splits the whole text."""
    if not path.is_file():
        raise IsotuiError(f"{what} does not exist (or is not a file)")
    lineno = 0
    try:
        with path.open(encoding="utf-8", newline=None) as f:
            for raw in f:
                for line in raw.splitlines() or [""]:
                    lineno += 1
                    yield lineno, line
    except UnicodeDecodeError:
        raise IsotuiError(f"{what} is not UTF-8 text (after line {lineno}); convert it to UTF-8") from None
    except OSError as exc:
        raise IsotuiError(f"{what} cannot be read: {exc.strerror}") from None


def _hf_texts(spec: DataSpec) -> Iterator[str]:
    """The stripped values of a ``datasets`` split's text column, one record at a time: with
    ``streaming=True``, or, for a split slice or when streaming fails (offline, with only the
    datasets cache's Arrow files), the memory-mapped Arrow dataset read in chunks."""
    from isotui.data import hf

    datasets = hf.require_datasets(spec)  # one sentence when the package is missing
    records: Iterator[dict[str, object]] | None = None
    first: dict[str, object] | None = None
    field = spec.field  # "" until the column is picked as the plain reader picks it
    if "[" not in spec.split and not hf.saved_folder(spec.name):  # streaming takes whole hub splits
        try:
            streamed = datasets.load_dataset(spec.name, spec.config, split=spec.split, streaming=True)
            if not field and streamed.features is not None:
                field = _text_column(spec, hf.pick_column(spec, streamed))
            records = iter(streamed)
            first = next(records, None)
        except IsotuiError:
            raise
        except Exception:
            records = None
    if records is None:
        ds = hf.open_split(spec)  # the memory-mapped Arrow split (a slice, a saved folder, offline)
        if not field:
            field = _text_column(spec, hf.pick_column(spec, ds))
        if field in ds.column_names:
            ds = ds.select_columns([field])
        records = (row for chunk in ds.iter(batch_size=1024) for row in _rows(chunk))
        first = next(records, None)
    if first is None:
        return
    if not field:  # a stream that does not say its features: the plain reader's default column
        field = "text"
    if field not in first:
        raise IsotuiError(
            f"data source {spec.describe()} has no column {field!r} (it has: {', '.join(first)})"
        )
    for record in itertools.chain([first], records):
        value = record[field]
        if value is None:  # a missing text, skipped as the plain reader skips it
            continue
        if not isinstance(value, str):
            raise IsotuiError(
                f"--stream reads text columns; column {field!r} of {spec.describe()} is "
                f"{type(value).__name__}: drop --stream"
            )
        yield value.strip()


def _text_column(spec: DataSpec, picked: tuple[str, str]) -> str:
    """The picked column, when it is text (a stream is read as text)."""
    field, kind = picked
    if kind != "text":
        raise IsotuiError(
            f"--stream reads text columns; column {field!r} of {spec.describe()} is {kind}: drop --stream"
        )
    return field


def _rows(chunk: dict[str, list[object]]) -> Iterator[dict[str, object]]:
    """A column chunk (``Dataset.iter``) as records."""
    names = list(chunk)
    return (dict(zip(names, values, strict=True)) for values in zip(*chunk.values(), strict=True))
