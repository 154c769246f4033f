"""``--stream``: a text corpus read, tokenised and length-sorted in windows gives the plain run's
numbers, key and shards, while holding at most one window of samples.

The window is made small (8 samples) so a 37-line corpus spans five windows and the streamed run
visits samples in another order than the plain run (sorted within windows, not over the corpus).
Batches of one sample and float64 batch products, as in ``test_shards.py``: what is compared is
the streaming, not float32 rounding. avg_cos is checked against plain numpy over all pairs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from isotui.cli import main
from isotui.data.sources import fingerprint, load_samples, parse_data
from isotui.errors import IsotuiError

from .conftest import corpus
from .reference import hidden_vectors
from .test_merge import assert_close
from .test_shards import _assert_rows_equal, _entry, _rows
from .test_shards import float64_products as float64_products  # a fixture, used by name

N = 37
WINDOW = 8
MAX_LENGTH = 24


@pytest.fixture
def texts(tmp_path):
    lines = corpus(N)
    path = tmp_path / "texts.txt"
    path.write_text("\n\n".join(lines) + "\n", encoding="utf-8")  # blank lines are skipped
    return lines, f"text:{path}"


@pytest.fixture
def small_window(monkeypatch):
    """A window of 8 samples, and every tokenisation's size recorded (samples held at once)."""
    from isotui.extract import streaming

    sizes: list[int] = []
    real = streaming.tokenize

    def counting(tokenizer, samples, max_length, *, with_types):
        sizes.append(len(samples))
        return real(tokenizer, samples, max_length, with_types=with_types)

    monkeypatch.setattr(streaming, "WINDOW", WINDOW)
    monkeypatch.setattr(streaming, "tokenize", counting)
    return sizes


def _run(model, data, cache, *extra) -> int:
    argv = ["run", "-m", str(model), "--data", data, "--max-length", str(MAX_LENGTH), "--batch-size", "1"]
    return main([*argv, "--reservoir", "40", "--cache-dir", str(cache), "-q", *extra])


def _never_whole(monkeypatch) -> None:
    """A streamed run must never read the corpus into a list."""
    import isotui.data.stream as stream

    def refuse(*_a, **_k):
        raise AssertionError("a streamed run read the whole corpus")

    monkeypatch.setattr(stream, "load_samples", refuse)


def test_streamed_run_gives_the_plain_numbers_key_and_numpy_all_pairs(
    tiny_models, texts, tmp_path, float64_products, small_window, monkeypatch
):
    lines, data = texts
    model = tiny_models["bert"]
    plain_csv, stream_csv = tmp_path / "plain.csv", tmp_path / "stream.csv"
    assert _run(model, data, tmp_path / "plain", "--csv", str(plain_csv)) == 0
    assert small_window == []  # the plain run tokenises through the plain feeder
    _never_whole(monkeypatch)
    assert _run(model, data, tmp_path / "stream", "--stream", "--csv", str(stream_csv)) == 0
    # two tokenising passes (type counts, then the run), window by window: never more than 8 held
    assert sum(small_window) == 2 * N and max(small_window) == WINDOW
    _assert_rows_equal(_rows(plain_csv), _rows(stream_csv))
    key_plain, plain = _entry(tmp_path / "plain")
    key_stream, streamed = _entry(tmp_path / "stream")
    assert key_plain == key_stream  # the content hash: the same samples, the same key
    for f in ("n_samples", "n_tokens", "max_length"):
        assert plain.meta[f] == streamed.meta[f], f
    for a, b in zip(plain.rows, streamed.rows, strict=True):
        assert a.n_sample == b.n_sample == 40 < a.n_vectors  # the reservoir is sampled, the same keys
    layers, _ = hidden_vectors(model, lines, max_length=MAX_LENGTH)
    for row, x in zip(_rows(stream_csv), layers, strict=True):
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        g = u @ u.T
        n = len(x)
        assert int(row["n_vectors"]) == n
        assert float(row["avg_cos"]) == pytest.approx((g.sum() - np.trace(g)) / (n * (n - 1)), rel=1e-9)


def test_streamed_shards_merge_to_the_plain_run(
    tiny_models, texts, tmp_path, float64_products, small_window, monkeypatch, capsys
):
    _, data = texts
    model = tiny_models["gpt2"]
    plain_csv, merged_csv = tmp_path / "plain.csv", tmp_path / "merged.csv"
    assert _run(model, data, tmp_path / "plain", "--csv", str(plain_csv)) == 0
    _never_whole(monkeypatch)
    shared = tmp_path / "shared"
    for i in range(3):
        small_window.clear()
        assert _run(model, data, shared, "--stream", "--shard", f"{i}/3", "--csv", str(merged_csv)) == 0
        assert max(small_window) == WINDOW
    assert "merged from 3 shards" in capsys.readouterr().out
    _assert_rows_equal(_rows(plain_csv), _rows(merged_csv))
    assert _entry(tmp_path / "plain")[0] == _entry(shared)[0]


def test_a_stream_is_the_plain_samples_and_fingerprint(tmp_path, monkeypatch):
    """Text, JSONL and a local hf: folder, with a line cut at the length limit and --max-samples."""
    from isotui.data.stream import StreamedSamples, open_samples

    long = "word " * 200
    lines = ["  first line ", "", "second\u2028third", long, "last"]
    (tmp_path / "t.txt").write_text("\n".join(lines) + "\r\n", encoding="utf-8")
    records = [{"text": s, "n": i} for i, s in enumerate(lines)]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    (tmp_path / "hfdata").mkdir()
    (tmp_path / "hfdata" / "train.jsonl").write_text(
        "\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8"
    )
    values = (f"text:{tmp_path}/t.txt", f"jsonl:{tmp_path}/r.jsonl", f"hf:{tmp_path}/hfdata:train")
    for value in (*values, f"hf:{tmp_path}/hfdata:train[1:]"):  # a slice: the memory-mapped split
        spec = parse_data(value)
        for max_samples in (None, 3):
            plain = load_samples(spec, max_samples, 2)
            streamed = open_samples(spec, max_samples, 2, stream=True)
            assert isinstance(streamed, StreamedSamples)
            assert list(streamed) == list(plain) and len(streamed) == len(plain), value
            assert streamed[1] == plain[1] and streamed[-1] == plain[-1]
            assert fingerprint(streamed, spec) == fingerprint(list(plain), spec)
            assert streamed.notes == plain.notes  # type: ignore[attr-defined]
    # a file above the threshold streams without being asked
    import isotui.data.stream as stream

    spec = parse_data(f"text:{tmp_path}/t.txt")
    assert not isinstance(open_samples(spec, None, None), StreamedSamples)
    monkeypatch.setattr(stream, "STREAM_AUTO_BYTES", 10)
    assert isinstance(open_samples(spec, None, None), StreamedSamples)


@pytest.mark.parametrize(
    ("data", "said"),
    [
        ("synthetic:images", "--stream reads text, JSONL and hf: text sources, not synthetic:images"),
        ("hf:{tmp}/hfdata:train:n", "column 'n' is int64, not text"),  # said before any stream is read
    ],
)
def test_a_source_that_cannot_stream_is_one_sentence_and_exit_2(tmp_path, capsys, data, said):
    (tmp_path / "hfdata").mkdir()
    (tmp_path / "hfdata" / "train.jsonl").write_text('{"text": "a b", "n": 1}\n', encoding="utf-8")
    code = main(["run", "-m", "minilm", "--data", data.format(tmp=tmp_path), "--stream", "-q"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert said in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_stream_refuses_a_non_text_spec_directly():
    from isotui.data.stream import StreamedSamples

    with pytest.raises(IsotuiError, match="drop --stream"):
        StreamedSamples(parse_data("synthetic:audio"), None, None)


def test_exact_second_pass_reads_the_stream_again(
    tiny_models, texts, tmp_path, float64_products, small_window
):
    """``--exact`` runs a second pass over the batches: a stream is read (and tokenised) again."""
    _, data = texts
    model = tiny_models["gpt2"]
    plain_csv, stream_csv = tmp_path / "plain.csv", tmp_path / "stream.csv"
    assert _run(model, data, tmp_path / "plain", "--exact", "--csv", str(plain_csv)) == 0
    assert _run(model, data, tmp_path / "stream", "--exact", "--stream", "--csv", str(stream_csv)) == 0
    assert sum(small_window) == 3 * N and max(small_window) == WINDOW  # counts, run, second pass
    _assert_rows_equal(_rows(plain_csv), _rows(stream_csv))


@pytest.mark.parametrize("special", ["include", "exclude"])
def test_encoder_decoder_type_weights_are_the_whole_corpus(texts, float64_products, small_window, special):
    """BART's decoder sees the text shifted right: its type-uniform weights, counted window by
    window, are the plain run's (type-weighted metrics of both components agree)."""
    from isotui.experiments.layerwise import measure
    from isotui.spec import make_spec

    from .test_exactness import TINY_BART

    _, data = texts
    plain, streamed = (
        measure(
            make_spec(TINY_BART, data, max_length=20, batch_size=1, special_tokens=special, stream=s), None
        )
        for s in (False, True)
    )
    assert max(small_window) == WINDOW
    assert {r.component for r in plain.rows} == {"encoder", "decoder"}
    for a, b in zip(plain.rows, streamed.rows, strict=True):
        assert (a.component, a.n_vectors, a.self_sim_types) == (b.component, b.n_vectors, b.self_sim_types)
        assert not np.isnan(b.avg_cos_types)
        for name in ("avg_cos", "avg_cos_types", "drift_norm_types", "self_sim", "intra_sim"):
            assert_close(getattr(a, name), getattr(b, name), f"{a.component} {a.layer} {name}")


def test_hf_without_streaming_reads_the_memory_mapped_split(tmp_path, monkeypatch):
    """Offline with only the datasets cache, ``streaming=True`` fails: the split is then read from
    its memory-mapped Arrow files, chunk by chunk, to the same samples."""
    import datasets

    from isotui.data.stream import StreamedSamples

    (tmp_path / "hfdata").mkdir()
    lines = corpus(3000)
    rows = "\n".join(json.dumps({"text": s, "id": i}) for i, s in enumerate(lines))
    (tmp_path / "hfdata" / "train.jsonl").write_text(rows + "\n", encoding="utf-8")
    real = datasets.load_dataset

    def no_streaming(*args, streaming=False, **kwargs):
        if streaming:
            raise ConnectionError("offline")
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", no_streaming)
    spec = parse_data(f"hf:{tmp_path}/hfdata:train")
    streamed = StreamedSamples(spec, None, None)
    assert list(streamed) == lines and len(streamed) == 3000  # more than one chunk of 1024
    assert fingerprint(streamed, spec) == fingerprint(lines, spec)


def test_a_streamed_plan_bounds_no_layer_by_its_first_window(tiny_models, texts, small_window, tmp_path):
    """Issue 36: the plan bounded each layer's vectors by the batch plan's samples, which for a
    stream is its first window only (8 of 37 samples): the layers were planned as if their
    reservoirs held a fifth of what the run fills. A stream's vectors are not known before the
    pass; the plan says so (None), as its docstring promised."""
    from .test_offload_peak import _plan_of

    _, data = texts
    out = tmp_path / "run.json"
    assert (
        _run(tiny_models["gpt2"], data, tmp_path / "c", "--stream", "--reservoir", "4096", "--json", str(out))
        == 0
    )
    plan = _plan_of(json.loads(out.read_text()))
    assert plan is not None and all(p["vectors"] is None for p in plan["layers"])
    assert all(p["reservoir"] == 4096 for p in plan["layers"])  # planned at the size asked
