"""The result cache: one safetensors file per run, arrays plus JSON metadata in its header.

One file per entry means one atomic rename per write: concurrent writers of the same key each
write a private temporary file and the last rename wins with a complete entry. A checksum of
the array bytes is kept in the header, so a damaged entry is detected, reported and recomputed.
"""

from __future__ import annotations

import hashlib
import json
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from isotui.errors import IsotuiError
from isotui.results import SCHEMA_VERSION
from isotui.store.files import temp_pattern, write_bytes_atomic

_META_KEY = "isotui"
_TEMPS = temp_pattern(r"[A-Za-z0-9_-]+(?:\.safetensors)?")  # any entry's temporary, old or new


@dataclass(frozen=True)
class CacheEntry:
    """What ``isotui cache ls`` shows about one entry, read from the file header only."""

    key: str
    path: Path
    model: str
    data: str
    n_samples: int
    created: str
    size_bytes: int
    schema: int
    max_length: int = 0


@dataclass
class Scan:
    """A cache folder's entries, and how many of its files were skipped: vanished while
    listing, not regular files (a dangling symlink), unreadable, or not isotui's."""

    entries: list[CacheEntry] = field(default_factory=list)
    skipped: int = 0


class CacheProblem(Exception):
    """An entry exists but cannot be used; the message says why, in one sentence."""


class CacheWriteError(IsotuiError):
    """The cache could not be written (a full disk, a read-only folder...); the result is fine
    and is kept: the message says so in one sentence. An :class:`IsotuiError`: where nothing
    catches it by name (the cached runs keep the result, a shard says it is lost), it reaches
    the user as that sentence, not as an internal error."""


def _digest(arrays: dict[str, np.ndarray], result: dict[str, Any]) -> str:
    """A checksum of the arrays and of the table (canonical JSON), so either damaged is caught."""
    h = hashlib.sha256(json.dumps(result, sort_keys=True).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        if a.size:  # an empty array (a sum with no reservoir) has no bytes, and no view to cast
            h.update(a.data.cast("B"))  # its bytes, not a copy of them
    return h.hexdigest()


class ResultCache:
    """A folder of entries named by their key: layer-wise runs in ``runs/``; an experiment's
    results (attention, drift-block...) in a folder of its own, with its own schema number.

    One API for every experiment: :meth:`get_payload` / :meth:`put_payload` hold a JSON payload
    and arrays; turning them into a result is the experiment's ``decode``
    (:func:`isotui.experiments.cached.read`)."""

    def __init__(self, root: Path, folder: str = "runs", schema: int = SCHEMA_VERSION) -> None:
        self.root = Path(root)
        self.runs = self.root / folder
        self.schema = schema

    def path_for(self, key: str) -> Path:
        return self.runs / f"{key}.safetensors"

    def get_payload(self, key: str) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        """An entry's JSON payload and arrays, checked against its schema and checksum."""
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        path = self.path_for(key)
        if not path.is_file():
            return None
        try:
            data = self._header(path)
            if data.get("schema") != self.schema:
                raise CacheProblem(
                    f"cache entry {path.name} has schema {data.get('schema')}, this isotui writes "
                    f"{self.schema}"
                )
            # read into the arrays (not mapped, then copied: that held each entry twice)
            arrays = load_file(str(path), backend="pread")
            if _digest(arrays, data["result"]) != data.get("digest"):
                raise CacheProblem(f"cache entry {path.name} is damaged (checksum mismatch)")
            return data["result"], arrays
        except CacheProblem:
            raise
        except (SafetensorError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CacheProblem(f"cache entry {path.name} is unreadable ({_why(path, exc)})") from None

    @staticmethod
    def _header(path: Path) -> dict[str, Any]:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
        if _META_KEY not in meta:
            raise ValueError("no isotui metadata")
        return json.loads(meta[_META_KEY])

    def put_payload(self, key: str, payload: dict[str, Any], arrays: dict[str, np.ndarray]) -> Path:
        """Write one entry atomically (temporary file in the same folder, then rename), with the
        umask's mode; :class:`CacheWriteError` if it cannot be written, nothing half-written left."""
        from safetensors import SafetensorError

        try:
            return self.put_bytes(key, self.entry_bytes(payload, arrays))
        except (SafetensorError, MemoryError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise CacheWriteError(
                f"could not write to the cache in {self.root} ({reason}); this result is not cached"
            ) from None

    def entry_bytes(self, payload: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
        """The bytes of the entry :meth:`put_payload` writes (a sweep's Ray task sends them to
        the driver through Ray's object store). Raises SafetensorError, MemoryError."""
        from safetensors.numpy import save

        arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
        payload = json.loads(json.dumps(payload))  # as it will read back
        header = {"schema": self.schema, "digest": _digest(arrays, payload), "result": payload}
        data: bytes = save(arrays, metadata={_META_KEY: json.dumps(header)})
        return data

    def put_bytes(self, key: str, data: bytes) -> Path:
        """Write an entry's bytes (:meth:`entry_bytes`, or a file of another cache) atomically;
        :class:`CacheWriteError` if it cannot be written. Read it back with :meth:`get_payload`
        to know it is whole."""
        try:
            return write_bytes_atomic(self.runs, f"{key}.safetensors", data, stale=_TEMPS)
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise CacheWriteError(
                f"could not write to the cache in {self.root} ({reason}); this result is not cached"
            ) from None

    def remove(self, key: str) -> bool:
        """Delete one entry; True if there was one (gone already is not an error)."""
        try:
            self.path_for(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def entries(self) -> list[CacheEntry]:
        """Every entry, newest first (see :meth:`scan`)."""
        return self.scan().entries

    def scan(self) -> Scan:
        """Every isotui entry of the folder, newest first, read from the headers only.

        A file that vanishes while listing, is not a regular file, cannot be read or is not
        isotui's is skipped and counted; an isotui entry whose fields are not what this version
        writes is listed with model '(unreadable)' so that ``cache rm KEY`` can remove it."""
        found = Scan()
        try:
            paths = sorted(self.runs.glob("*.safetensors"))
        except OSError:
            return found
        for path in paths:
            try:
                st = path.stat()
                if not stat.S_ISREG(st.st_mode):
                    raise ValueError("not a regular file")
                head = self._header(path)
            except Exception:
                found.skipped += 1
                continue
            found.entries.append(_entry(path, head, st.st_size))
        found.entries.sort(key=lambda e: e.created, reverse=True)
        return found


def _entry(path: Path, head: Any, size: int) -> CacheEntry:
    """The listing line of an isotui entry; '(unreadable)' when its fields have odd types."""
    try:
        result = head["result"]
        meta = result.get("meta", {})
        model, data, created = result["model"], meta.get("data", "?"), meta.get("created", "")
        if not all(isinstance(v, str) for v in (model, data, created)):
            raise TypeError("text fields that are not text")
        n_samples, max_length = meta.get("n_samples", 0), meta.get("max_length") or 0
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (n_samples, max_length)):
            raise TypeError("counts that are not integers")
        schema = head.get("schema", 0)
        schema = schema if isinstance(schema, int) else 0
        return CacheEntry(path.stem, path, model, data, n_samples, created, size, schema, max_length)
    except Exception:
        return CacheEntry(path.stem, path, "(unreadable)", "", 0, "", size, 0)


def _why(path: Path, exc: BaseException) -> str:
    """Why an entry could not be read, in words: the file system's reason where opening it fails
    (safetensors calls a file it may not open "not found"), else the kind of damage."""
    try:
        with open(path, "rb"):
            pass
    except OSError as os_exc:
        return os_exc.strerror or type(os_exc).__name__
    return type(exc).__name__
