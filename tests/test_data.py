"""Data sources: order, field selection, limits, and one clear sentence for each bad input."""

from __future__ import annotations

import json
import re
import sys

import pytest

from isotui.data.sources import fingerprint, load_samples, parse_data
from isotui.errors import IsotuiError


def test_builtin_is_large_deterministic_and_english():
    a = load_samples(parse_data("builtin"))
    assert len(a) >= 2000
    assert fingerprint(a) == fingerprint(load_samples(parse_data("builtin")))
    assert load_samples(parse_data("builtin"), 5) == a[:5]
    assert all(s[0].isupper() and s[-1] in ".!?" for s in a[:200])


def test_text_file_one_sample_per_nonempty_line(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("first line\n\n   \nsecond line\nthird\n", encoding="utf-8")
    assert load_samples(parse_data(f"text:{f}")) == ["first line", "second line", "third"]
    assert load_samples(parse_data("text:a.txt", tmp_path), 2) == ["first line", "second line"]


def test_jsonl_default_and_named_field(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text(
        "\n".join(json.dumps(r) for r in [{"text": "x y", "body": "b1"}, {"text": "z", "body": "b2"}])
    )
    assert load_samples(parse_data(f"jsonl:{f}")) == ["x y", "z"]
    assert load_samples(parse_data(f"jsonl:{f}:body")) == ["b1", "b2"]
    with pytest.raises(IsotuiError, match=r"line 1 has no field 'nope' \(it has: body, text\)"):
        load_samples(parse_data(f"jsonl:{f}:nope"))
    f.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(IsotuiError, match="line 2 is not valid JSON"):
        load_samples(parse_data(f"jsonl:{f}"))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("ftp:x", "unknown scheme"),
        ("text:", "gives nothing after it"),
        ("hf:a:b:c:d:e", "is not hf:NAME"),
    ],
)
def test_bad_specs(value, message):
    with pytest.raises(IsotuiError, match=message):
        parse_data(value)


def test_not_utf8_and_empty(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(IsotuiError, match="is not UTF-8"):
        load_samples(parse_data(f"text:{f}"))
    f.write_text("\n\n")
    with pytest.raises(IsotuiError, match="has no non-empty samples"):
        load_samples(parse_data(f"text:{f}"))


def test_hf_spec_forms():
    assert parse_data("hf:wikitext:wikitext-103-raw-v1:validation").config == "wikitext-103-raw-v1"
    s = parse_data("hf:imdb:train:review")
    assert (s.name, s.config, s.split, s.field) == ("imdb", None, "train", "review")
    s = parse_data("hf:wikitext:wikitext-2-raw-v1:test:text")
    assert (s.config, s.split, s.field) == ("wikitext-2-raw-v1", "test", "text")


def test_hf_local_dataset_through_datasets(tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "mydata"
    folder.mkdir()
    rows = [{"text": f"sentence number {i}.", "label": i} for i in range(7)] + [{"text": "", "label": 9}]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    samples = load_samples(parse_data(f"hf:{folder}:train"), 5)
    assert samples == [f"sentence number {i}." for i in range(5)]
    assert len(load_samples(parse_data(f"hf:{folder}:train"))) == 7
    with pytest.raises(IsotuiError, match=r"has no column 'body' \(it has: text \(text\), label \(int64\)\)"):
        load_samples(parse_data(f"hf:{folder}:train:body"))
    with pytest.raises(IsotuiError, match="could not be loaded"):
        load_samples(parse_data("hf:no-such-dataset-anywhere:train"))


def test_hf_without_datasets_or_with_a_broken_one_says_which(tmp_path, monkeypatch):
    """Not installed: "pip install datasets". Installed but failing to import (pyarrow 26 under
    numpy 1.x says "pyarrow requires NumPy 2.0 or newer"): that failure, not "pip install"."""
    for name in [m for m in sys.modules if m == "datasets" or m.startswith("datasets.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(IsotuiError, match=r"needs the `datasets` package: pip install datasets$"):
        load_samples(parse_data("hf:imdb:train"), 3)
    monkeypatch.delitem(sys.modules, "datasets")
    broken = tmp_path / "datasets"
    broken.mkdir()
    (broken / "__init__.py").write_text(
        'raise ImportError("pyarrow requires NumPy 2.0 or newer, found 1.26.0")\n', encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    said = (
        "data source hf:imdb:train needs the `datasets` package, which is installed but does not import: "
        "ImportError: pyarrow requires NumPy 2.0 or newer, found 1.26.0"
    )
    with pytest.raises(IsotuiError, match=re.escape(said)):
        load_samples(parse_data("hf:imdb:train"), 3)


def test_hf_split_slices_keep_their_colon_and_builtin_takes_no_argument():
    s = parse_data("hf:wikitext:wikitext-2-raw-v1:train[:100]")
    assert (s.name, s.config, s.split, s.field) == ("wikitext", "wikitext-2-raw-v1", "train[:100]", "")
    s = parse_data("hf:imdb:test[10:20]:review")
    assert (s.config, s.split, s.field) == (None, "test[10:20]", "review")
    with pytest.raises(IsotuiError, match="builtin takes no argument"):
        parse_data("builtin:wikitext")


def test_synthetic_samples_are_a_full_sequence():
    """Sequence's own methods work on the lazy synthetic list (its size once hid ``count``)."""
    from isotui.data.sources import SyntheticSamples

    s = SyntheticSamples("images", 4)
    assert s.count("synthetic:images#2") == 1 and s.count("nothing") == 0
    assert s.index("synthetic:images#3") == 3
    assert s[1:3] == ["synthetic:images#1", "synthetic:images#2"] and s[-1] == "synthetic:images#3"
    assert list(s) == [f"synthetic:images#{i}" for i in range(4)]
