"""``hf:`` data: a Hugging Face ``datasets`` split, text, image or audio.

Where it comes from: a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
(read with ``load_from_disk``), else ``load_dataset(NAME, CONFIG, split=SPLIT)``, which finds a
dataset in the local datasets cache when the hub cannot be reached (``HF_HUB_OFFLINE=1``). The
split may be sliced as ``datasets`` slices splits (``validation[:100]``, ``train[10%:20%]``).

Which column: the one named, else the split's one image or audio column, else its column named
``text``, else its one string column. Text is read into a list as before; image and audio columns
stay in the memory-mapped Arrow table and are decoded batch by batch (:class:`HFMedia`), by
isotui itself (Pillow, soundfile, mixed to mono and resampled as for folders), never by
``datasets`` (whose audio decoding needs torchcodec and FFmpeg). Their cache fingerprint hashes
the encoded bytes of exactly the rows measured, so two slices never share an entry.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import numpy as np

from isotui.data.lazy import LazySamples
from isotui.data.media import audio_frames, read_audio, read_image
from isotui.errors import IsotuiError

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage


class DataSpec(Protocol):
    """What this module reads of a parsed ``--data hf:...`` value (isotui.data.sources.DataSpec,
    which calls into this module: a protocol here, so the two do not import each other)."""

    @property
    def name(self) -> str: ...
    @property
    def config(self) -> str | None: ...
    @property
    def split(self) -> str: ...
    @property
    def field(self) -> str: ...
    def describe(self) -> str: ...
    def __hash__(self) -> int: ...  # a frozen dataclass: the key of the cached column kinds


KINDS = ("text", "image", "audio")
NOUN = {"text": "text", "image": "images", "audio": "audio"}
HASH_ROWS = 64  # rows read at once while hashing a media column


def require_datasets(spec: DataSpec) -> Any:
    try:
        import datasets
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "datasets":
            raise IsotuiError(
                f"data source {spec.describe()} needs the `datasets` package: pip install datasets"
            ) from None
        # installed but broken, e.g. pyarrow 26+ under numpy 1.x: say what failed
        raise IsotuiError(
            f"data source {spec.describe()} needs the `datasets` package, which is installed but does "
            f"not import: {type(exc).__name__}: {exc}"
        ) from None
    return datasets


@contextlib.contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """No progress bars or cache warnings from ``datasets`` over isotui's own progress; the
    caller's settings are restored after."""
    from datasets.utils import logging as dlogging

    level, bars = dlogging.get_verbosity(), datasets.is_progress_bar_enabled()
    dlogging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        dlogging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def saved_folder(name: str) -> bool:
    """Whether ``name`` is a folder written by ``save_to_disk`` (a Dataset or a DatasetDict)."""
    root = Path(name)
    return (root / "dataset_dict.json").is_file() or (root / "state.json").is_file()


def open_split(spec: DataSpec) -> Any:
    """The ``datasets.Dataset`` of ``spec``'s (sliced) split; one sentence if it cannot be had."""
    datasets = require_datasets(spec)
    try:
        with _quiet(datasets):
            if saved_folder(spec.name):
                return _saved_split(datasets, spec)
            return datasets.load_dataset(spec.name, spec.config, split=spec.split)
    except IsotuiError:
        raise
    except Exception as exc:
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        first = "; ".join(lines[:2])[:300] or type(exc).__name__
        missing = re.match(r'Unknown split "([^"]*)"\. Should be one of \[(.*)\]', first)
        if missing:
            have = missing.group(2).replace("'", "")
            raise IsotuiError(
                f"data source {spec.describe()} has no split {missing.group(1)!r} (it has: {have})"
            ) from None
        cache = getattr(getattr(datasets, "config", None), "HF_DATASETS_CACHE", "")
        raise IsotuiError(
            f"data source {spec.describe()} could not be loaded ({first}); it must be in the local "
            f"Hugging Face datasets cache ({cache}), a folder written by save_to_disk, or on the hub"
        ) from None


def _saved_split(datasets: Any, spec: DataSpec) -> Any:
    """The split (and slice) of a ``save_to_disk`` folder, sliced as ``load_dataset`` slices."""
    from datasets.arrow_reader import ReadInstruction

    if spec.config:
        raise IsotuiError(
            f"data source {spec.describe()}: a folder written by save_to_disk has no configs; "
            "use hf:DIR:SPLIT[:FIELD]"
        )
    saved = datasets.load_from_disk(spec.name)
    # a saved Dataset is one split: its own name, or "train" (load_dataset's name for unsplit data)
    splits = dict(saved) if isinstance(saved, datasets.DatasetDict) else {str(saved.split or "train"): saved}
    parts = []
    for part in ReadInstruction.from_spec(spec.split).to_absolute({k: len(v) for k, v in splits.items()}):
        parts.append(splits[part.splitname].select(range(part.from_, part.to)))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _kind(datasets: Any, feature: Any) -> str | None:
    if isinstance(feature, datasets.Image):
        return "image"
    if isinstance(feature, datasets.Audio):
        return "audio"
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        return "text"
    return None


def _type_name(feature: Any) -> str:
    return str(getattr(feature, "dtype", None) or type(feature).__name__)


def pick_column(spec: DataSpec, ds: Any) -> tuple[str, str]:
    """(field, kind) of the column ``spec`` measures: the one named, else the one image or audio
    column, else ``text``, else the one string column; one sentence when that does not decide."""
    datasets = require_datasets(spec)
    features = dict(ds.features)
    kinds = {name: _kind(datasets, f) for name, f in features.items()}
    listing = ", ".join(f"{n} ({kinds[n] or _type_name(f)})" for n, f in features.items())
    if spec.field:
        if spec.field not in features:
            raise IsotuiError(
                f"data source {spec.describe()} has no column {spec.field!r} (it has: {listing})"
            )
        kind = kinds[spec.field]
        if kind is None:
            raise IsotuiError(
                f"data source {spec.describe()}: column {spec.field!r} is "
                f"{_type_name(features[spec.field])}, not text, image or audio (the columns: {listing})"
            )
        return spec.field, kind
    media = [n for n, k in kinds.items() if k in ("image", "audio")]
    texts = [n for n, k in kinds.items() if k == "text"]
    if len(media) == 1:
        return media[0], kinds[media[0]] or "image"
    if not media and "text" in texts:
        return "text", "text"
    if not media and len(texts) == 1:
        return texts[0], "text"
    raise IsotuiError(
        f"data source {spec.describe()} does not say which column to measure (the columns: "
        f"{listing}); name one as hf:NAME[:CONFIG]:SPLIT:FIELD"
    )


def _stamp(spec: DataSpec) -> int:
    """When a saved folder last changed (0 for a hub name): a re-saved folder is looked at anew."""
    root = Path(spec.name)
    files = [root / n for n in ("dataset_dict.json", "state.json", "dataset_info.json")]
    return max((f.stat().st_mtime_ns for f in files if f.is_file()), default=0)


@functools.lru_cache(maxsize=32)
def _column_kind(spec: DataSpec, stamp: int) -> tuple[str, str]:
    return pick_column(spec, open_split(spec))


def modality(spec: DataSpec) -> str:
    """``text``, ``image`` or ``audio``: the kind of the column ``spec`` measures (opens the
    dataset once per spec; remembered)."""
    return _column_kind(spec, _stamp(spec))[1]


def media_samples(spec: DataSpec, max_samples: int | None) -> HFMedia:
    """The first ``max_samples`` non-empty rows of ``spec``'s image or audio column."""
    ds = open_split(spec)
    field, kind = pick_column(spec, ds)
    return HFMedia.of(spec, ds, field, kind, max_samples)


class HFMedia(LazySamples):
    """The non-empty rows of an image or audio column, decoded on demand. Item ``i`` is its name,
    ``hf:...#ROW`` (what an error names); :meth:`image` and :meth:`audio` decode it."""

    def __init__(self, table: Any, field: str, kind: str, rows: np.ndarray, source: str) -> None:
        self.table, self.field, self.kind, self.rows, self.source = table, field, kind, rows, source
        self.notes: list[str] = []

    @classmethod
    def of(cls, spec: DataSpec, ds: Any, field: str, kind: str, max_samples: int | None) -> HFMedia:
        """The first ``max_samples`` rows whose value has bytes or a path (found in Arrow, nothing
        decoded)."""
        import pyarrow.compute as pc

        column = ds.select_columns([field]).with_format("arrow")  # the stored structs: nothing decoded
        rows: list[np.ndarray] = []
        start, found = 0, 0
        for batch in column.iter(batch_size=4096):
            values = batch.column(0)
            stored = pc.or_(
                pc.is_valid(pc.struct_field(values, "bytes")), pc.is_valid(pc.struct_field(values, "path"))
            )
            ok = pc.and_(pc.is_valid(values), stored)
            kept = start + np.flatnonzero(ok.to_numpy(zero_copy_only=False))
            rows.append(kept)
            found += len(kept)
            start += len(values)
            if max_samples is not None and found >= max_samples:
                break
        kept = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        kept = kept[:max_samples] if max_samples is not None else kept
        if not len(kept):
            raise IsotuiError(f"data source {spec.describe()} has no non-empty samples")
        media = cls(column, field, kind, kept.astype(np.int64), spec.describe())
        if start > len(kept) and max_samples is None:
            media.notes.append(f"{start - len(kept)} row(s) without {NOUN[kind]} were skipped")
        return media

    def __len__(self) -> int:
        return len(self.rows)

    def _item(self, index: int) -> str:
        return f"{self.source}#{int(self.rows[index])}"

    def encoded(self, idx: Sequence[int]) -> list[dict[str, Any]]:
        """The stored ``{"bytes", "path"}`` of samples ``idx`` (one Arrow read)."""
        values: list[dict[str, Any]] = self.table[[int(self.rows[i]) for i in idx]].column(0).to_pylist()
        return values

    def _file(self, value: dict[str, Any], i: int) -> str | BinaryIO:
        if value.get("bytes") is not None:
            return io.BytesIO(value["bytes"])
        path = value.get("path")
        if path and Path(path).is_file():
            return str(path)
        raise IsotuiError(
            f"{self.kind} {self[i]} has no stored bytes and its file {path} is not on this machine; "
            "load the dataset fully (not streamed) or save it with save_to_disk"
        )

    def what(self, i: int) -> str:
        return f"{self.kind} {self[i]}"

    def images(self, idx: Sequence[int]) -> list[PILImage]:
        """Samples ``idx`` as RGB images."""
        values = zip(idx, self.encoded(idx), strict=True)
        return [read_image(self._file(v, i), self.what(i)) for i, v in values]

    def waves(self, idx: Sequence[int], rate: int) -> list[np.ndarray]:
        """Samples ``idx`` as mono float32 waves at ``rate`` Hz."""
        values = zip(idx, self.encoded(idx), strict=True)
        return [read_audio(self._file(v, i), self.what(i), rate) for i, v in values]

    def wave_lengths(self, rate: int) -> np.ndarray:
        """Every sample's length at ``rate`` Hz, from the audio headers."""
        out = np.zeros(len(self), dtype=np.int64)
        for start in range(0, len(self), HASH_ROWS):
            idx = list(range(start, min(start + HASH_ROWS, len(self))))
            for i, v in zip(idx, self.encoded(idx), strict=True):
                out[i] = audio_frames(self._file(v, i), self.what(i), rate)
        return out

    def fingerprint(self) -> str:
        """A hash of the encoded bytes of every measured row, in order (files read when only a
        path is stored): the same rows anywhere are the same data, another slice is not."""
        h = hashlib.sha256(f"hf-{self.kind}\x00".encode())
        for start in range(0, len(self), HASH_ROWS):
            idx = list(range(start, min(start + HASH_ROWS, len(self))))
            for i, v in zip(idx, self.encoded(idx), strict=True):
                source = self._file(v, i)
                data = source.getvalue() if isinstance(source, io.BytesIO) else Path(str(source)).read_bytes()
                h.update(len(data).to_bytes(8, "little"))
                h.update(data)
        return "sha256:" + h.hexdigest()
