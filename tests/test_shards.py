"""``isotui run --shard I/K``: K processes sharing a cache folder give the one-process result.

Each shard runs through the real CLI (``main``) on a tiny random model; the last shard (or a
plain run that finds all K cached) merges. The merged table, CSV and cache entry are compared
with a one-pass run in another cache folder, and avg_cos with plain numpy over all pairs of every
layer's vectors (``tests/reference.py``). Batches of one sample and float64 batch products, as in
``test_merge.py``: what is compared is the sharding, not float32 rounding.
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from isotui.cli import main

from .conftest import corpus
from .reference import hidden_vectors
from .test_merge import assert_close

N = 17  # not a multiple of 2 or 3: the shards differ in size
MAX_LENGTH = 24


@pytest.fixture
def float64_products(monkeypatch):
    """Products in float64: two batchings of the same data then agree to 1e-12."""
    from isotui.core import products

    monkeypatch.setattr(products, "FLOAT64_PRODUCTS", True)


@pytest.fixture
def texts(tmp_path):
    lines = corpus(N)
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return lines, f"text:{path}"


def _run(model, data, cache, *extra, batch_size: int | None = 1) -> int:
    """``isotui run`` in this process; ``batch_size`` None: the default batches."""
    argv = ["run", "-m", str(model), "--data", data, "--max-length", str(MAX_LENGTH)]
    argv += ["--batch-size", str(batch_size)] if batch_size is not None else []
    return main([*argv, "--reservoir", "40", "--cache-dir", str(cache), "-q", *extra])


def _rows(path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _entry(cache):
    from isotui.experiments.layer_pass import read
    from isotui.store.cache import ResultCache

    runs = ResultCache(cache)
    (entry,) = runs.entries()
    return entry.key, read(runs, entry.key)


def _assert_rows_equal(one: list[dict[str, str]], merged: list[dict[str, str]], rel: float = 1e-12) -> None:
    """The same CSV: text and integers exactly, numbers to ``rel`` relative."""
    assert [list(r) for r in one] == [list(r) for r in merged]
    for a, b in zip(one, merged, strict=True):
        for k, x in a.items():
            y = b[k]
            try:
                fx, fy = float(x), float(y)
            except ValueError:
                assert x == y, k
                continue
            if x.lstrip("-").isdigit():
                assert x == y, k
            elif math.isnan(fx):
                assert math.isnan(fy), k
            else:
                assert_close(fx, fy, f"layer {a['layer']} {k}", rel=rel)


@pytest.mark.parametrize("k", [2, 3])
def test_last_shard_merges_to_the_one_pass_run_and_numpy_all_pairs(
    tiny_models, texts, tmp_path, float64_products, k, capsys
):
    lines, data = texts
    model = tiny_models["bert"]
    one_csv, merged_csv = tmp_path / "one.csv", tmp_path / "merged.csv"
    assert _run(model, data, tmp_path / "one", "--csv", str(one_csv)) == 0
    shared = tmp_path / "shared"
    for i in range(k):
        assert _run(model, data, shared, "--shard", f"{i}/{k}", "--csv", str(merged_csv)) == 0
        err = capsys.readouterr().err
        if i < k - 1:
            assert f"shard {i}/{k}" in err and f"{i + 1} of {k} shards" in err
            assert not merged_csv.exists()  # nothing measured yet: no table, no CSV
    one_rows, merged_rows = _rows(one_csv), _rows(merged_csv)
    _assert_rows_equal(one_rows, merged_rows)
    # the cache entry: the one-process run's key, rows, arrays, counts; the notes say it merged
    key_one, one = _entry(tmp_path / "one")
    key_merged, merged = _entry(shared)
    assert key_one == key_merged
    assert f"merged from {k} shards" in merged.meta["notes"]

    # (the thread count's note quotes the load average of the moment each process started)
    def steady(notes: list[str]) -> list[str]:
        return [n for n in notes if "merged from" not in n and not n.startswith("the machine is loaded")]

    assert steady(merged.meta["notes"]) == steady(one.meta["notes"])
    for f in ("n_samples", "n_tokens", "max_length", "model_class", "modality", "dtype", "reservoir"):
        assert merged.meta[f] == one.meta[f], f
    assert one.arrays.keys() == merged.arrays.keys()
    for name, a in one.arrays.items():
        assert_close(a, merged.arrays[name], name)
    for a, b in zip(one.rows, merged.rows, strict=True):
        assert a.n_sample == b.n_sample == 40 < a.n_vectors  # the reservoir metrics are sampled
    # the partial states are gone once merged; the cache lists the run, not the shards
    from isotui.experiments.shards import partial_runs

    assert partial_runs(shared) == []
    # avg_cos over all pairs of every layer's vectors, plain numpy
    layers, _ = hidden_vectors(model, lines, max_length=MAX_LENGTH)
    assert len(layers) == len(merged_rows)
    for row, x in zip(merged_rows, layers, strict=True):
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        g = u @ u.T
        n = len(x)
        assert int(row["n_vectors"]) == n
        assert float(row["avg_cos"]) == pytest.approx((g.sum() - np.trace(g)) / (n * (n - 1)), rel=1e-9)


def test_plain_run_merges_the_cached_shards_instead_of_recomputing(
    tiny_models, texts, tmp_path, float64_products, monkeypatch, capsys
):
    """Shards 0/3 and 1/3 cached, 2/3 stored as if by another machine: the plain run merges."""
    _, data = texts
    model = tiny_models["gpt2"]
    assert _run(model, data, tmp_path / "one", "--csv", str(tmp_path / "one.csv")) == 0
    from isotui.experiments import layerwise, shards

    fresh = tmp_path / "fresh"
    for i in range(2):
        assert _run(model, data, fresh, "--shard", f"{i}/3") == 0
    assert "2 of 3 shards: 0, 1" in capsys.readouterr().err
    real = shards.merge_cached
    monkeypatch.setattr(shards, "merge_cached", lambda *a, **k: None)  # the last one elsewhere
    assert _run(model, data, fresh, "--shard", "2/3") == 0
    monkeypatch.setattr(shards, "merge_cached", real)
    (partial,) = shards.partial_runs(fresh)
    assert partial.have == (0, 1, 2) and partial.count == 3 and partial.n_samples == N

    def no_compute(*_a, **_k):
        raise AssertionError("recomputed instead of merging")

    monkeypatch.setattr(layerwise, "compute", no_compute)
    assert _run(model, data, fresh, "--csv", str(tmp_path / "plain.csv")) == 0
    _assert_rows_equal(_rows(tmp_path / "one.csv"), _rows(tmp_path / "plain.csv"))
    assert "merged from 3 shards" in capsys.readouterr().out


def test_a_stored_state_reads_back_exactly(tiny_models, texts):
    """A shard's partial state through the cache entry: every tensor bit for bit (the reservoir
    too), every count and fact the same."""
    import torch

    from isotui.experiments.layer_pass import extract_options, load_prepared, prepare
    from isotui.experiments.shards import state_from_payload, state_payload
    from isotui.extract.runner import extract_state
    from isotui.spec import make_spec
    from isotui.store.cache import ResultCache

    _, data = texts
    spec = make_spec(str(tiny_models["bert"]), data, max_length=MAX_LENGTH, reservoir=20)
    prepared = prepare(spec)
    loaded, device = load_prepared(prepared)
    state = extract_state(
        loaded, prepared.samples, device=device, opts=extract_options(spec), model_name=spec.model
    )
    cache = ResultCache(texts[1].split(":", 1)[1] + ".cache", folder="shards", schema=1)
    cache.put_payload("k-0-of-1", *state_payload(state))
    back = state_from_payload(*cache.get_payload("k-0-of-1"))
    assert {k: v for k, v in back.items() if k != "components"} == {
        k: v for k, v in state.items() if k != "components"
    }
    for c, layers in state["components"].items():
        for a, b in zip(layers, back["components"][c], strict=True):
            assert a.keys() == b.keys()
            for name, x in a.items():
                if isinstance(x, torch.Tensor):
                    assert x.dtype == b[name].dtype and torch.equal(x, b[name]), name
                else:
                    assert x == b[name], name


def test_cache_ls_shows_partial_runs(tiny_models, texts, tmp_path, capsys):
    _, data = texts
    cache = tmp_path / "c"
    for i in (0, 2):
        assert _run(tiny_models["bert"], data, cache, "--shard", f"{i}/4") == 0
    capsys.readouterr()
    assert main(["cache", "ls", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "partial runs" in out and "2 of 4" in out and "0, 2" in out
    # removed by the run key's prefix, all shards at once
    from isotui.experiments.shards import partial_runs

    (run,) = partial_runs(cache)
    assert run.n_samples == len(range(0, N, 4)) + len(range(2, N, 4))
    assert main(["cache", "rm", run.key[:8], "--cache-dir", str(cache)]) == 0
    assert partial_runs(cache) == []


@pytest.mark.parametrize(
    ("shard", "said"),
    [
        ("5/4", "shard 5/4 does not exist: shards count from 0"),
        ("4/4", "4 shards are 0/4 to 3/4"),
        ("x", "shard must be I/K"),
        ("0/0", "K must be at least 1"),
        ("1/-2", "shard must be I/K"),
    ],
)
def test_bad_shards_are_one_sentence(shard, said, capsys):
    assert main(["run", "--shard", shard, "-q"]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_shards_at_other_thread_counts_merge_to_float32_rounding(tiny_models, texts, tmp_path):
    """Machines differ in cores, so shards run at different ``--threads``: not a run option (not
    in the key), so they merge, and the thread count changes only float32 rounding in the forward,
    like another batching. Default float32 products and batches: every number within 1e-5
    relative of a one-process run (measured: 1.4e-6 at most, on the IsoScore weights' standard
    error, an ill-conditioned ratio; 1e-7 or less on most metrics)."""
    _, data = texts
    model = tiny_models["gpt2"]
    one_csv, merged_csv = tmp_path / "one.csv", tmp_path / "merged.csv"
    assert _run(model, data, tmp_path / "one", "--threads", "1", "--csv", str(one_csv), batch_size=None) == 0
    for shard, threads in (("0/2", "2"), ("1/2", "1")):  # two machines
        extra = ("--shard", shard, "--threads", threads, "--csv", str(merged_csv))
        assert _run(model, data, tmp_path / "shared", *extra, batch_size=None) == 0
    _, merged = _entry(tmp_path / "shared")
    assert "merged from 2 shards" in merged.meta["notes"]
    _assert_rows_equal(_rows(one_csv), _rows(merged_csv), rel=1e-5)


def test_shards_of_another_split_or_mode_are_refused(tiny_models, texts, tmp_path, capsys):
    """(The other half with other run options is another run's shard, never refused: see
    ``test_catalogue_refusals``.)"""
    _, data = texts
    cache = tmp_path / "c"
    model = tiny_models["bert"]
    assert _run(model, data, cache, "--shard", "0/2") == 0
    capsys.readouterr()
    # the same run split three ways
    assert _run(model, data, cache, "--shard", "1/3") == 2
    assert "split 2 ways (0/2), not 3" in capsys.readouterr().err
    # neither was lost or run: shard 0/2 is still there, alone
    from isotui.experiments.shards import partial_runs

    assert [(r.have, r.count) for r in partial_runs(cache)] == [((0,), 2)]
    # no cache, --exact, more shards than samples
    assert _run(model, data, cache, "--shard", "1/2", "--no-cache") == 2
    assert "drop --no-cache" in capsys.readouterr().err
    assert _run(model, data, cache, "--shard", "1/2", "--exact") == 2
    assert "cannot run in shards" in capsys.readouterr().err
    for shard in (f"{N}/{N + 1}", f"1/{N + 1}"):  # a shard with no samples, or one with a sample
        assert _run(model, data, cache, "--shard", shard) == 2
        assert f"the data has {N} samples, fewer than {N + 1} shards" in capsys.readouterr().err
    # more shards than isotui runs: one sentence before the model loads
    assert _run(model, data, cache, "--shard", "0/99999999999999999999") == 2
    assert "K must be at most 10,000" in capsys.readouterr().err
    assert [(r.have, r.count) for r in partial_runs(cache)] == [((0,), 2)]  # nothing more cached


def test_python_api_and_a_plain_run_with_some_shards(tiny_models, texts, tmp_path, capsys):
    """``isotui.run(shard=...)``: an empty result until the merging shard; a plain run that finds
    only some shards says so and measures in one process (the shards stay for their run)."""
    import isotui

    _, data = texts
    model, cache = str(tiny_models["bert"]), tmp_path / "c"
    kw = {"data": data, "max_length": MAX_LENGTH, "reservoir": 40, "cache_dir": cache}
    first = isotui.run(model, shard="0/2", **kw)
    assert first.rows == []
    assert _run(tiny_models["bert"], data, cache) == 0
    assert (
        "the cache holds 1 of 2 shards of this run (0); measuring it in one process"
        in capsys.readouterr().err
    )
    second = isotui.run(model, shard="1/2", **kw)  # the whole run is cached now: answered from it
    assert len(second.rows) == 3
    from isotui.experiments.shards import partial_runs

    assert partial_runs(cache) == []  # shard 0/2 was no longer needed
