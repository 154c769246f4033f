"""The local Hugging Face cache: resolve a revision to a commit and list cached models.

Reads the cache's own files (``refs/``, ``snapshots/``) so that a cache lookup in isotui needs
neither torch nor transformers, and works offline.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isotui.errors import IsotuiError

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache directory (HF_HUB_CACHE, else HF_HOME/hub), read from the
    environment at each call: huggingface_hub reads it once, at import."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """True when the user told the Hugging Face libraries not to use the network."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in {"1", "true", "yes", "on"}


def _repo_dir(repo_id: str) -> Path:
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def resolve_commit(repo_id: str, revision: str | None) -> str:
    """The commit hash that ``repo_id@revision`` names, from the local cache or the hub."""
    rev = revision or "main"
    repo = _repo_dir(repo_id)
    if _COMMIT.match(rev) and (repo / "snapshots" / rev).is_dir():
        return rev
    ref = repo / "refs" / rev
    if ref.is_file():
        commit = ref.read_text().strip()
        if (repo / "snapshots" / commit).is_dir():
            return commit
    guess = "" if repo.is_dir() else spelling_guess(repo_id)  # in the cache: the revision is what lacks
    if offline():
        if guess:
            raise IsotuiError(
                f"model {repo_id!r} is not in the local Hugging Face cache ({hub_cache_dir()}); "
                f"{guess} (else download it with `hf download {repo_id}` on a machine with network)"
            )
        raise IsotuiError(
            f"model {repo_id!r} (revision {rev}) is not in the local Hugging Face cache "
            f"({hub_cache_dir()}) and HF_HUB_OFFLINE is set; download it first with "
            f"`hf download {repo_id}` on a machine with network, or check the spelling"
        )
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        sha = HfApi().model_info(repo_id, revision=rev).sha
    except RevisionNotFoundError:
        raise IsotuiError(f"model {repo_id!r} has no revision {rev!r} on the hub") from None
    except RepositoryNotFoundError:
        raise IsotuiError(
            f"no model {repo_id!r} on the Hugging Face hub or in the local cache; "
            + (guess or "check the spelling, or give a local directory")
        ) from None
    except Exception as exc:  # no network: HTTP errors, OSError, httpx's ConnectError, timeouts
        raise IsotuiError(
            f"model {repo_id!r} is not in the local Hugging Face cache ({hub_cache_dir()}) and "
            f"the hub could not be reached ({type(exc).__name__}); "
            + (
                f"{guess} (else download it first or give a local directory)"
                if guess
                else "download it first or give a local directory"
            )
        ) from None
    if sha is None:  # the hub's answer may leave it out
        raise IsotuiError(
            f"the Hugging Face hub gave no commit for model {repo_id!r} (revision {rev}); try again"
        )
    return sha


def cached_repo_ids() -> list[str]:
    """The model ids of the local Hugging Face cache, from its folder names alone (no scan)."""
    try:
        return [p.name[len("models--") :].replace("--", "/") for p in hub_cache_dir().glob("models--*")]
    except OSError:
        return []


def spelling_guess(name: str) -> str:
    """For a model name found nowhere: ``did you mean minilm?`` when a bundled model, a preset
    (``isotui run PRESET``) or a model of the local Hugging Face cache is spelled nearly so
    (``""`` if none is)."""
    from isotui.paths import BUNDLED, resource_dir
    from isotui.suggest import nearest

    try:
        presets = [p.stem for p in resource_dir("sample_configs").glob("*.toml")]
    except FileNotFoundError:
        presets = []
    guess = nearest(name, [n for n in [*BUNDLED, *cached_repo_ids()] if n.lower() != name.lower()])
    if guess is not None:
        return f"did you mean {guess}?"
    preset = nearest(name, presets)
    return f"did you mean the preset {preset} (`isotui run {preset}`)?" if preset else ""


@dataclass(frozen=True)
class CachedModel:
    """A model repository found in the local Hugging Face cache."""

    repo_id: str
    revisions: tuple[str, ...]  # its refs: main, step1000, refs/pr/1 (a pull request)
    size_bytes: int


def cached_repos() -> list[Any]:
    """Every model repository of the local Hugging Face cache (``CachedRepoInfo``, by id) that
    huggingface_hub's ``scan_cache_dir`` reads as whole; one it calls corrupted is left out."""
    root = hub_cache_dir()
    if not root.is_dir():  # (before the import: huggingface_hub's scanner brings its HTTP client)
        return []
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(root)
    return sorted((r for r in info.repos if r.repo_type == "model"), key=lambda r: r.repo_id)


def cached_models() -> list[CachedModel]:
    """Every model repository in the local Hugging Face cache with a snapshot (empty if there is
    no cache). A ref's name is its path under ``refs/``: a pull request is ``refs/pr/1``."""
    return [
        CachedModel(repo.repo_id, tuple(sorted(repo.refs)), repo.size_on_disk)
        for repo in cached_repos()
        if repo.revisions
    ]
