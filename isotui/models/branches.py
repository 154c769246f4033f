"""A hub model's branches and the identity of its weight files, known before anything is downloaded.

Online, huggingface_hub answers: ``HfApi.list_repo_refs`` (branches and tags, e.g. Pythia's
``step0`` ... ``step143000``) and ``HfApi.list_repo_tree`` (each file's LFS sha256, or its git blob
id when it is not an LFS file). Offline (``HF_HUB_OFFLINE``), or when the hub cannot be reached,
the local hub cache answers, read with ``huggingface_hub.scan_cache_dir``: a ref's name is its
path under ``refs/`` (a pull request is ``refs/pr/1``), and a snapshot's file links to a blob
named by the same sha256 (or git blob id), so both sources name a file's content alike.

Two checkpoints serve the same weights when the weight files of one format (safetensors, else
PyTorch .bin) have the same names and contents in both: EleutherAI/pythia #205, where 86 of the
154 step branches of pythia-2.8b serve the final weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from isotui.errors import IsotuiError
from isotui.models.hub import cached_repos, hub_cache_dir, offline

Notice = Callable[[str], None]
Weights = dict[str, frozenset[tuple[str, str]]]  # format -> {(file, content id)}
_FORMATS = ("safetensors", "bin")
_NOT_WEIGHTS = ("training_args", "optimizer", "scheduler", "rng_state", "trainer_state")
_WORKERS = 8  # tree listings in flight at once: 154 Pythia branches in a few seconds


class HubUnreachable(Exception):
    """The hub did not answer (no network, a timeout): the cache is asked instead."""


@dataclass(frozen=True)
class Ref:
    """A branch or tag and the commit it points at."""

    name: str
    commit: str


def weight_format(path: str) -> str | None:
    """``safetensors`` or ``bin`` for a top-level weight file, else None (configs, tokenizers,
    training state)."""
    p = PurePosixPath(path)
    if len(p.parts) != 1 or p.name.startswith(_NOT_WEIGHTS):
        return None
    if p.suffix == ".safetensors":
        return "safetensors"
    if p.suffix == ".bin" and p.name.startswith(("pytorch_model", "model")):
        return "bin"
    return None


def _weights(files: Iterable[tuple[str, str]]) -> Weights:
    """(path, content id) pairs grouped by weight format; other files left out."""
    out: dict[str, set[tuple[str, str]]] = {}
    for path, content in files:
        fmt = weight_format(path)
        if fmt is not None:
            out.setdefault(fmt, set()).add((path, content))
    return {fmt: frozenset(found) for fmt, found in out.items()}


def same_weights(a: Weights, b: Weights) -> bool:
    """Whether two checkpoints serve the same weights: the first format both have (safetensors,
    then .bin, as they are loaded) has the same files with the same contents."""
    for fmt in _FORMATS:
        if fmt in a and fmt in b:
            return a[fmt] == b[fmt]
    return False


# --- the local hub cache ------------------------------------------------------------------------


def cached_repo(repo_id: str) -> Any:
    """The cache's record of model ``repo_id`` (a ``CachedRepoInfo``), or None."""
    return next((r for r in cached_repos() if r.repo_id == repo_id), None)


def cached_refs(repo: Any) -> list[Ref]:
    """The refs of a cached repository (``main``, ``step1000``, ``refs/pr/1``), by name."""
    return sorted(
        (Ref(name, rev.commit_hash) for rev in repo.revisions for name in rev.refs), key=lambda r: r.name
    )


def _cached_weights(repo: Any, revision: str) -> Weights | None:
    """The weight files of ``revision`` (a ref or a commit) as far as the cache holds them; None
    when it holds no weight file of it."""
    for rev in repo.revisions:
        if revision in rev.refs or revision == rev.commit_hash:
            found = _weights(
                (f.file_path.relative_to(rev.snapshot_path).as_posix(), f.blob_path.name) for f in rev.files
            )
            return found or None
    return None


# --- the hub ------------------------------------------------------------------------------------


def _hub_call(repo_id: str, call: Callable[[], Any], revision: str | None = None) -> Any:
    """``call()`` with the hub's failures in one sentence (or :class:`HubUnreachable`)."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return call()
    except GatedRepoError:
        raise IsotuiError(
            f"model {repo_id!r} is gated on the hub: accept its terms on its page and log in (hf auth login)"
        ) from None
    except RevisionNotFoundError:
        raise IsotuiError(f"model {repo_id!r} has no revision {revision!r} on the hub") from None
    except RepositoryNotFoundError:
        raise IsotuiError(
            f"no model {repo_id!r} on the Hugging Face hub; check the spelling, or give a local directory"
        ) from None
    except Exception as exc:  # no network: HTTP errors, OSError, httpx's ConnectError, timeouts
        raise HubUnreachable(type(exc).__name__) from None


def _hub_refs(repo_id: str) -> list[Ref]:
    from huggingface_hub import HfApi

    found = _hub_call(repo_id, lambda: HfApi().list_repo_refs(repo_id))
    refs = {r.name: Ref(r.name, r.target_commit) for r in [*found.tags, *found.branches]}
    return sorted(refs.values(), key=lambda r: r.name)


def _hub_weights(repo_id: str, revision: str) -> Weights:
    """The top-level weight files of ``repo_id@revision`` from the hub's tree listing (the LFS
    sha256 the listing carries; no expand: it adds last commits and scans, not hashes)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    def listing() -> list[Any]:
        return list(HfApi().list_repo_tree(repo_id, revision=revision))

    entries = _hub_call(repo_id, listing, revision)
    return _weights(
        (e.path, e.lfs.sha256 if e.lfs is not None else e.blob_id) for e in entries if isinstance(e, RepoFile)
    )


# --- what the series resolution asks --------------------------------------------------------------


def list_refs(repo_id: str, flag: str, notice: Notice | None = None) -> list[Ref]:
    """Every branch and tag of hub model ``repo_id``: from the hub, or from the local cache when
    offline or when the hub cannot be reached. ``flag`` (``--checkpoints``) is what a failure
    names."""
    if not offline():
        try:
            return _hub_refs(repo_id)
        except HubUnreachable as exc:
            repo = cached_repo(repo_id)
            if repo is None:
                raise IsotuiError(
                    f"{flag} lists the branches of {repo_id}, but the hub could not be reached ({exc}) "
                    f"and the local Hugging Face cache ({hub_cache_dir()}) does not hold it"
                ) from None
            if notice is not None:
                notice(
                    f"the hub could not be reached ({exc}): {flag} picks among the branches of {repo_id} "
                    "in the local cache"
                )
            return cached_refs(repo)
    repo = cached_repo(repo_id)
    if repo is None:
        raise IsotuiError(
            f"{flag} lists the branches of {repo_id}, which is not in the local Hugging Face cache "
            f"({hub_cache_dir()}) and HF_HUB_OFFLINE is set; download its branches first, or unset "
            "HF_HUB_OFFLINE"
        )
    return cached_refs(repo)


def weight_files(
    wanted: list[tuple[str, str]], notice: Notice | None = None
) -> dict[tuple[str, str], Weights]:
    """The weight files of each ``(repo id, revision)``: from the local cache where it holds them
    (no network), else from the hub's tree listing (several at once). Left out: what neither
    can tell (offline and not cached, or the hub unreachable; said once through ``notice``)."""
    out: dict[tuple[str, str], Weights] = {}
    repos = {r.repo_id: r for r in cached_repos()}
    ask: list[tuple[str, str]] = []
    for repo_id, revision in dict.fromkeys(wanted):
        found = _cached_weights(repos[repo_id], revision) if repo_id in repos else None
        if found is not None:
            out[repo_id, revision] = found
        elif not offline():
            ask.append((repo_id, revision))
    if not ask:
        return out
    with ThreadPoolExecutor(max_workers=min(_WORKERS, len(ask))) as pool:
        futures = {pair: pool.submit(_hub_weights, *pair) for pair in ask}
        unreachable = None
        for pair, future in futures.items():
            try:
                out[pair] = future.result()
            except HubUnreachable as exc:
                unreachable = str(exc)
    if unreachable is not None and notice is not None:
        notice(
            f"the hub could not be reached ({unreachable}): checkpoints not in the local cache were not "
            "checked for duplicate weights"
        )
    return out
