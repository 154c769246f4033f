"""Checkpoint series picked from a model's branches (all, every:N, stepA..stepB), and checkpoints
serving another step's weights flagged before anything is downloaded.

The hub's answers are recorded: the test builds them as the objects huggingface_hub returns
(GitRefs/GitRefInfo, RepoFile with its LFS sha256) and puts them behind HfApi's methods. The
offline path reads a hub cache laid out here (refs/, snapshots/ linking into blobs/, a pull
request ref) with huggingface_hub's own scan_cache_dir, and a tiny model is measured from it.
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from isotui.cli import main
from isotui.errors import IsotuiError
from isotui.experiments.series import resolve_checkpoints

from .conftest import corpus

REPO = "EleutherAI/pythia-2.8b"
# Pythia's schedule: step0, the log-spaced 1 .. 512, then every 1000 to 143000 (154 branches)
SCHEDULE = [0, *(2**k for k in range(10)), *range(1000, 143001, 1000)]
# 86 of the step branches serve the final weights, as in EleutherAI/pythia #205 (which 86 is made up)
SERVING_FINAL = set(range(57000, 143000, 1000))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def hub(monkeypatch):
    """HfApi answering from a recorded listing of a Pythia-like model; what it was asked."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import GitRefInfo, GitRefs, RepoFile

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    asked: list[str] = []

    def commit(name: str) -> str:
        return hashlib.sha1(name.encode()).hexdigest()

    branches = [GitRefInfo(name="main", ref="refs/heads/main", target_commit=commit("main"))] + [
        GitRefInfo(name=f"step{s}", ref=f"refs/heads/step{s}", target_commit=commit(f"step{s}"))
        for s in SCHEDULE
    ]
    refs = GitRefs(branches=branches, converts=[], tags=[])

    def tree(step: int | str) -> list[RepoFile]:
        owner = 143000 if step in SERVING_FINAL or step == "main" else step
        lfs = [
            RepoFile(
                path=name,
                size=5_000_000_000,
                oid=commit(f"{name} {owner}"),
                lfs={"size": 5_000_000_000, "oid": _sha(f"{name} {owner}"), "pointerSize": 135},
            )
            for name in ("model.safetensors", "pytorch_model.bin")
        ]
        small = [
            RepoFile(path="config.json", size=570, oid=commit(f"config {step}")),  # differs on every branch
            RepoFile(path="training_args.bin", size=3000, oid=commit(f"args {step}")),
        ]
        return lfs + small

    def list_repo_refs(self, repo_id, **_kw):
        assert repo_id == REPO
        asked.append("refs")
        return refs

    def list_repo_tree(self, repo_id, path_in_repo=None, *, revision=None, **_kw):
        assert repo_id == REPO and path_in_repo is None
        asked.append(revision)
        return iter(tree("main" if revision == "main" else int(revision.removeprefix("step"))))

    def no_download(*_a, **_kw):
        raise AssertionError("nothing is downloaded to resolve a series")

    monkeypatch.setattr(HfApi, "list_repo_refs", list_repo_refs)
    monkeypatch.setattr(HfApi, "list_repo_tree", list_repo_tree)
    monkeypatch.setattr(HfApi, "hf_hub_download", no_download)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", no_download)
    return asked


def test_all_is_every_step_branch_by_step_with_the_duplicates_flagged(hub):
    notes: list[str] = []
    series = resolve_checkpoints(REPO, ["all"], notice=notes.append)
    assert [c.step for c in series] == sorted(SCHEDULE) and len(series) == 154
    assert [c.model for c in series[:3]] == [f"{REPO}@step0", f"{REPO}@step1", f"{REPO}@step2"]
    flagged = {c.step for c in series if c.duplicate_of}
    assert flagged == SERVING_FINAL and len(flagged) == 86
    assert {c.duplicate_of for c in series if c.duplicate_of} == {"step143000"}
    assert series[-1].label == "step143000" and series[-1].duplicate_of is None  # the genuine one
    assert hub.count("refs") == 1 and sorted(r for r in hub if r != "refs") == sorted(
        f"step{s}" for s in SCHEDULE
    )
    (said,) = notes
    assert said.startswith("86 of 154 checkpoints serve the same weights as a later step")
    assert "--skip-duplicates leaves them out" in said

    kept = resolve_checkpoints(REPO, ["all"], skip_duplicates=True)
    assert [c.step for c in kept] == [s for s in SCHEDULE if s not in SERVING_FINAL]


def test_every_n_is_the_steps_that_are_multiples_of_n(hub):
    thousands = resolve_checkpoints(REPO, ["every:1000"])
    assert [c.step for c in thousands] == [s for s in sorted(SCHEDULE) if s % 1000 == 0]
    assert len(thousands) == 144  # step0 and the 143 thousands; the log-spaced 1 .. 512 left out
    assert [c.step for c in resolve_checkpoints(REPO, ["every:50k"])] == [0, 50000, 100000]
    assert [c.step for c in resolve_checkpoints(REPO, ["every:128"])] == [
        s for s in sorted(SCHEDULE) if s % 128 == 0
    ]


def test_ranges_and_unions(hub):
    early = resolve_checkpoints(REPO, ["step0..step512"])
    assert [c.step for c in early] == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert all(c.duplicate_of is None for c in early)
    assert "step143000" in hub  # the last step is compared even when it is not in the series
    # a range of branches that all serve the final weights: flagged though step143000 is not asked for
    late = resolve_checkpoints(REPO, ["step100000..step102000"])
    assert [(c.label, c.duplicate_of) for c in late] == [
        (f"step{s}", "step143000") for s in (100000, 101000, 102000)
    ]
    with pytest.raises(IsotuiError, match="names 0 checkpoint once --skip-duplicates left out"):
        resolve_checkpoints(REPO, ["step100000..step102000"], skip_duplicates=True)
    mixed = resolve_checkpoints(REPO, ["every:50000", "step0..4,step100000", "step1"], skip_duplicates=True)
    assert [c.step for c in mixed] == [0, 1, 2, 4, 50000]
    assert [c.step for c in resolve_checkpoints(REPO, ["..step2"])] == [0, 1, 2]
    assert [c.step for c in resolve_checkpoints(REPO, ["step142000.."])] == [142000, 143000]
    # named revisions are checked too, before anything is downloaded
    named = resolve_checkpoints(REPO, ["step1000,step100000,step143000"])
    assert [c.duplicate_of for c in named] == [None, "step143000", None]


@pytest.mark.parametrize(
    ("model", "given", "said"),
    [
        (REPO, "every:0", "--checkpoints every:0: N must be a positive number of steps"),
        (REPO, "every:x", "--checkpoints every:x: N must be a positive number of steps"),
        (REPO, "step9..step1", "--checkpoints step9..step1: the range runs backwards"),
        (None, "all", "--checkpoints all picks among the branches of --model"),
        ("random:gpt2", "all", "--model random:gpt2 is not one"),
        (f"{REPO}@step1000", "all", "without @revision"),
        (REPO, "step200000..", "--checkpoints step200000.. matches no branch of EleutherAI/pythia-2.8b"),
    ],
)
def test_bad_selectors_are_one_sentence(hub, model, given, said):
    with pytest.raises(IsotuiError, match=re.escape(said)):
        resolve_checkpoints(model, [given])


def test_bad_selectors_on_the_command_line_exit_2(tmp_path, tiny_models, capsys):
    for args, said in (
        (["-m", REPO, "-c", "every:0"], "--checkpoints every:0"),
        (["-m", REPO, "-c", "step9..step1"], "--checkpoints step9..step1: the range runs backwards"),
        (["-m", str(tiny_models["gpt2"]), "-c", "all"], "is a local folder with no branches"),
        (["-m", "someorg/not-cached", "-c", "all"], "not in the local Hugging Face cache"),
    ):
        assert main(["experiment", "checkpoints", *args, "-q"]) == 2, args
        err = capsys.readouterr().err
        assert said in err and "--checkpoints" in err and "Traceback" not in err


def test_an_unreachable_hub_without_the_model_cached_is_one_sentence(monkeypatch):
    from huggingface_hub import HfApi

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")

    def unreachable(self, repo_id, **_kw):
        raise OSError("no route to host")

    monkeypatch.setattr(HfApi, "list_repo_refs", unreachable)
    with pytest.raises(
        IsotuiError, match=r"--checkpoints lists the branches of someorg/m, but the hub could not"
    ):
        resolve_checkpoints("someorg/m", ["all"])


# --- offline: a hub cache laid out here, read by scan_cache_dir -----------------------------------


def _snapshot(repo: Path, folder: Path, refs: list[str]) -> str:
    """``folder``'s files as a snapshot of the cached ``repo`` (blobs named by their sha256,
    linked from snapshots/COMMIT/), and ``refs`` pointing at it; its commit."""
    hashes = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}
    commit = hashlib.sha1(json.dumps(hashes, sort_keys=True).encode()).hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for name, sha in hashes.items():
        blob = repo / "blobs" / sha
        if not blob.exists():
            blob.write_bytes((folder / name).read_bytes())
        if not (snap / name).exists():
            os.symlink(os.path.relpath(blob, snap), snap / name)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture
def cached_series(tiny_models, tmp_path):
    """someorg/tiny-gpt2 in the hub cache: step0 (init), step20 (trained), and step10, a branch
    that serves step20's weights (its own config, the same weight file); main at step20, and a
    pull request ref refs/pr/1 at step0."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    repo = Path(os.environ["HF_HUB_CACHE"]) / "models--someorg--tiny-gpt2"
    tok = AutoTokenizer.from_pretrained(str(tiny_models["gpt2"]))
    trained = tmp_path / "trained"
    model = AutoModel.from_pretrained(str(tiny_models["gpt2"]))
    with torch.no_grad():
        model.wte.weight += 0.3 * torch.randn(
            model.wte.weight.shape, generator=torch.Generator().manual_seed(1)
        )
    model.save_pretrained(trained)
    tok.save_pretrained(trained)
    _snapshot(repo, tiny_models["gpt2"], ["step0", "refs/pr/1"])
    _snapshot(repo, trained, ["step20", "main"])
    relabelled = tmp_path / "step10"  # step20's weights under step10's name (another config file)
    relabelled.mkdir()
    for f in trained.iterdir():
        (relabelled / f.name).write_bytes(f.read_bytes())
    config = json.loads((trained / "config.json").read_text())
    (relabelled / "config.json").write_text(json.dumps({**config, "_name_or_path": "step10"}))
    _snapshot(repo, relabelled, ["step10"])
    return repo


def _weights_sha(repo: Path, ref: str) -> str:
    commit = (repo / "refs" / ref).read_text()
    return hashlib.sha256((repo / "snapshots" / commit / "model.safetensors").read_bytes()).hexdigest()


def test_the_cache_lists_pull_requests_by_their_ref(cached_series):
    from isotui.models.hub import cached_models

    (found,) = cached_models()
    assert found.repo_id == "someorg/tiny-gpt2"
    assert found.revisions == ("main", "refs/pr/1", "step0", "step10", "step20")  # not a revision "refs"


def test_offline_series_from_the_cache_is_measured_with_its_duplicate_flagged(
    cached_series, tmp_path, capsys
):
    assert _weights_sha(cached_series, "step10") == _weights_sha(cached_series, "step20")
    assert _weights_sha(cached_series, "step0") != _weights_sha(cached_series, "step20")
    data = tmp_path / "d.txt"
    data.write_text("\n".join(corpus(6)) + "\n")
    out, doc = tmp_path / "s.csv", tmp_path / "s.json"
    run = ["experiment", "checkpoints", "-m", "someorg/tiny-gpt2", "-c", "all", "--data", f"text:{data}"]
    assert main([*run, "--csv", str(out), "--json", str(doc), "-q"]) == 0
    captured = capsys.readouterr()
    assert "1 of 3 checkpoints serve the same weights as a later step" in captured.err
    assert "10*" in captured.out and "step10 = step20" in captured.out  # the heatmap's column and caption
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0])[:4] == ["series", "checkpoint", "step", "duplicate_of"]
    assert {(r["checkpoint"], r["duplicate_of"]) for r in rows} == {
        ("step0", ""),
        ("step10", "step20"),
        ("step20", ""),
    }
    payload = json.loads(doc.read_text())
    assert [(c["label"], c["duplicate_of"]) for c in payload["checkpoints"]] == [
        ("step0", None),
        ("step10", "step20"),
        ("step20", None),
    ]
    # what the flag says holds: the duplicate measures exactly what step20 measures
    by = {(r["checkpoint"], r["layer"]): r["avg_cos"] for r in rows}
    assert all(by["step10", layer] == by["step20", layer] for ckpt, layer in by if ckpt == "step20")
    assert main([*run, "--skip-duplicates", "--csv", str(out), "-q"]) == 0
    assert {r["checkpoint"] for r in csv.DictReader(out.open())} == {"step0", "step20"}
    capsys.readouterr()
    # the figure hatches the duplicate's column and its CSV says which it is
    fig = tmp_path / "heat.svg"
    figure = [
        "figure",
        "machina2024-heatmap",
        "-m",
        "someorg/tiny-gpt2",
        "-c",
        "all",
        "--data",
        f"text:{data}",
    ]
    assert main([*figure, "--out", str(fig), "-q"]) == 0
    assert fig.read_text().count('id="duplicate:') == 1 and 'id="duplicate:step10"' in fig.read_text()
    assert {
        r["duplicate_of"]
        for r in csv.DictReader(fig.with_suffix(".csv").open())
        if r["checkpoint"] == "step10"
    } == {"step20"}


def test_named_revisions_in_the_cache_need_no_hub(cached_series, monkeypatch):
    """Online, cached checkpoints are compared from the cache: the hub is not asked for their
    files; an unreachable hub for the branch list falls back to the cache, said once."""
    from huggingface_hub import HfApi

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")

    def unreachable(self, *_a, **_kw):
        raise OSError("no route to host")

    def not_asked(self, *_a, **_kw):
        raise AssertionError("the cache holds these files")

    monkeypatch.setattr(HfApi, "list_repo_refs", unreachable)
    monkeypatch.setattr(HfApi, "list_repo_tree", not_asked)
    notes: list[str] = []
    series = resolve_checkpoints("someorg/tiny-gpt2", ["step0..step20"], notice=notes.append)
    assert [(c.label, c.duplicate_of) for c in series] == [
        ("step0", None),
        ("step10", "step20"),
        ("step20", None),
    ]
    assert notes[0].startswith(
        "the hub could not be reached (OSError): --checkpoints picks among the branches"
    )
    assert notes[1].startswith("1 of 3 checkpoints serve the same weights")


@pytest.mark.slow
def test_the_apps_checkpoints_tab_takes_a_selector_and_marks_the_duplicate(cached_series, tmp_path):
    from textual.widgets import DataTable, Input

    from .test_tui import _app, _wait

    async def scenario():
        app = _app(tmp_path)
        async with app.run_test(size=(120, 36)) as pilot:
            await _wait(pilot, lambda: app.entries)
            await pilot.pause()
            app.selected = "someorg/tiny-gpt2"
            await pilot.press("A")
            await pilot.pause()
            await pilot.press("4")
            await pilot.pause()
            box = app.screen.query_one("#ckpt-input", Input)
            box.value = "all"
            await pilot.press("enter")
            await _wait(pilot, lambda: app.lab_results["checkpoints"] is not None)
            heat = app.screen.query_one("#ckpt-table", DataTable)
            assert [str(c.label) for c in heat.columns.values()] == ["layer", "0", "10*", "20"]
            assert "step10 = step20" in str(app.screen.query_one("#ckpt-info").render())

    asyncio.run(scenario())


def test_the_hubs_refusals_are_one_sentence(monkeypatch):
    """Recorded refusals: a gated model, no such model, no such branch (before any download)."""
    try:  # the HTTP library whose responses huggingface_hub's errors carry: httpx2 from hub 2.0
        import httpx2 as httpx
    except ImportError:
        import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.hf_api import GitRefInfo, GitRefs

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    url = "https://huggingface.co/api/models/someorg/m/refs"

    def answer(status: int):
        return httpx.Response(status, request=httpx.Request("GET", url))

    for error, said in (
        (GatedRepoError("gated", response=answer(403)), "'someorg/m' is gated on the hub: accept its terms"),
        (RepositoryNotFoundError("404", response=answer(404)), "no model 'someorg/m' on the Hugging Face"),
    ):

        def refuse(self, repo_id, error=error, **_kw):
            raise error

        monkeypatch.setattr(HfApi, "list_repo_refs", refuse)
        with pytest.raises(IsotuiError, match=re.escape(said)):
            resolve_checkpoints("someorg/m", ["every:1000"])

    refs = GitRefs(branches=[GitRefInfo("step1", "refs/heads/step1", "a" * 40)], converts=[], tags=[])
    monkeypatch.setattr(HfApi, "list_repo_refs", lambda self, repo_id, **_kw: refs)

    def tree(self, repo_id, path_in_repo=None, *, revision=None, **_kw):
        if revision != "step1":
            raise RevisionNotFoundError("no branch", response=answer(404))
        return iter([])

    monkeypatch.setattr(HfApi, "list_repo_tree", tree)
    with pytest.raises(IsotuiError, match="model 'someorg/m' has no revision 'step2' on the hub"):
        resolve_checkpoints("someorg/m", ["step1,step2"])
    # branches without a weight file at the top (an odd layout) are not compared, nor flagged
    monkeypatch.setattr(HfApi, "list_repo_tree", lambda self, repo_id, **_kw: iter([]))
    assert [c.duplicate_of for c in resolve_checkpoints("someorg/m", ["step1,step3"])] == [None, None]


def test_a_folder_of_step_folders_is_a_models_branches(tmp_path):
    """``-m runs/tiny -c every:20``: a train-tiny-style folder's step folders are picked by step."""
    for step in (0, 10, 20, 30):
        (tmp_path / "run" / f"step_{step:06d}").mkdir(parents=True)
        (tmp_path / "run" / f"step_{step:06d}" / "config.json").write_text("{}")
    run = str(tmp_path / "run")
    assert [c.step for c in resolve_checkpoints(run, ["every:20"])] == [0, 20]
    assert [c.label for c in resolve_checkpoints(run, ["step10..step30"])] == [
        "step_000010",
        "step_000020",
        "step_000030",
    ]
    assert all(c.duplicate_of is None for c in resolve_checkpoints(run, ["all"]))  # folders: not compared


def test_identical_local_checkpoint_folders_are_flagged_as_hub_revisions_are(tiny_models, tmp_path, capsys):
    """Three step folders, two with the same weights (a copy): the earlier copy is flagged, its
    numbers are the later one's, and --skip-duplicates leaves it out (issue 24)."""
    import shutil

    series = tmp_path / "run"
    series.mkdir()
    shutil.copytree(tiny_models["gpt2"], series / "step10")
    shutil.copytree(tiny_models["gpt2"], series / "step20")
    shutil.copytree(tiny_models["gpt2"], series / "step0")
    other = next((series / "step0").glob("*.safetensors"))
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(other))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1  # another step's weights
    save_file(weights, str(other), metadata={"format": "pt"})
    digest = {
        s: hashlib.sha256(next((series / s).glob("*.safetensors")).read_bytes()).hexdigest()
        for s in ("step0", "step10", "step20")
    }
    assert digest["step10"] == digest["step20"] != digest["step0"]  # by hand: which folders are one
    data = tmp_path / "d.txt"
    data.write_text("\n".join(corpus(6)) + "\n")
    out = tmp_path / "s.csv"
    run = ["experiment", "checkpoints", "-c", str(series), "--data", f"text:{data}", "--max-length", "16"]
    assert main([*run, "--csv", str(out), "-q"]) == 0
    assert "1 of 3 checkpoints serve the same weights as a later step" in capsys.readouterr().err
    rows = list(csv.DictReader(out.open()))
    assert {(r["checkpoint"], r["duplicate_of"]) for r in rows} == {
        ("step0", ""),
        ("step10", "step20"),
        ("step20", ""),
    }
    assert main([*run, "--skip-duplicates", "--csv", str(out), "-q"]) == 0
    assert {r["checkpoint"] for r in csv.DictReader(out.open())} == {"step0", "step20"}
