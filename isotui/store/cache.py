"""The result cache: one safetensors file per run, arrays plus JSON metadata in its header.

One file per entry means one atomic rename per write: concurrent writers of the same key each
write a private temporary file and the last rename wins with a complete entry. A checksum of
the array bytes is kept in the header, so a damaged entry is detected, reported and recomputed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from isotui.results import SCHEMA_VERSION, ModelResult

_META_KEY = "isotui"


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


class CacheProblem(Exception):
    """An entry exists but cannot be used; the message says why, in one sentence."""


def _digest(arrays: dict[str, np.ndarray], result: dict[str, Any]) -> str:
    """A checksum of the arrays and of the table (canonical JSON), so either damaged is caught."""
    h = hashlib.sha256(json.dumps(result, sort_keys=True).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


class ResultCache:
    """A folder of entries named by their key: layer-wise runs in ``runs/``; an experiment's
    results (attention, drift-block...) in a folder of its own, with its own schema number."""

    def __init__(self, root: Path, folder: str = "runs", schema: int = SCHEMA_VERSION) -> None:
        self.root = Path(root)
        self.runs = self.root / folder
        self.schema = schema

    def path_for(self, key: str) -> Path:
        return self.runs / f"{key}.safetensors"

    def get(self, key: str) -> ModelResult | None:
        """The cached result for ``key``, None if absent; :class:`CacheProblem` if unusable."""
        found = self.get_payload(key)
        if found is None:
            return None
        payload, arrays = found
        try:
            return ModelResult.from_json(payload, arrays)
        except (KeyError, TypeError, ValueError) as exc:
            raise CacheProblem(
                f"cache entry {key}.safetensors is unreadable ({type(exc).__name__})"
            ) from None

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
            arrays = load_file(str(path))
            if _digest(arrays, data["result"]) != data.get("digest"):
                raise CacheProblem(f"cache entry {path.name} is damaged (checksum mismatch)")
            return data["result"], arrays
        except CacheProblem:
            raise
        except (SafetensorError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CacheProblem(f"cache entry {path.name} is unreadable ({type(exc).__name__})") from None

    @staticmethod
    def _header(path: Path) -> dict[str, Any]:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
        if _META_KEY not in meta:
            raise ValueError("no isotui metadata")
        return json.loads(meta[_META_KEY])

    def put(self, result: ModelResult) -> Path:
        """Write ``result`` atomically (temporary file in the same folder, then rename)."""
        return self.put_payload(result.key, result.to_json(), result.arrays)

    def put_payload(self, key: str, payload: dict[str, Any], arrays: dict[str, np.ndarray]) -> Path:
        """Write one entry atomically (temporary file in the same folder, then rename)."""
        from safetensors.numpy import save_file

        self.runs.mkdir(parents=True, exist_ok=True)
        arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
        payload = json.loads(json.dumps(payload))  # as it will read back
        header = {"schema": self.schema, "digest": _digest(arrays, payload), "result": payload}
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.runs)
        os.close(fd)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a cache shared by a group must stay readable
        try:
            save_file(arrays, tmp, metadata={_META_KEY: json.dumps(header)})
            os.replace(tmp, self.path_for(key))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return self.path_for(key)

    def remove(self, key: str) -> bool:
        """Delete one entry; True if there was one."""
        path = self.path_for(key)
        if path.is_file():
            path.unlink()
            return True
        return False

    def entries(self) -> list[CacheEntry]:
        """Every entry, newest first; unreadable ones are listed with model '(unreadable)'."""
        out = []
        if not self.runs.is_dir():
            return out
        for path in self.runs.glob("*.safetensors"):
            key = path.stem
            size = path.stat().st_size
            try:
                head = self._header(path)
                result, meta = head["result"], head["result"]["meta"]
                out.append(
                    CacheEntry(
                        key,
                        path,
                        result["model"],
                        meta.get("data", "?"),
                        int(meta.get("n_samples", 0)),
                        meta.get("created", ""),
                        size,
                        int(head.get("schema", 0)),
                        int(meta.get("max_length") or 0),
                    )
                )
            except Exception:
                out.append(CacheEntry(key, path, "(unreadable)", "", 0, "", size, 0))
        return sorted(out, key=lambda e: e.created, reverse=True)
