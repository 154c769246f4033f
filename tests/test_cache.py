"""The result cache: hits, misses on every key change, damaged entries, concurrent writers."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from isotui.experiments import layer_pass, layerwise
from isotui.experiments.layer_pass import prepare
from isotui.experiments.layerwise import measure
from isotui.spec import make_spec
from isotui.store.cache import ResultCache

from .conftest import corpus


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(12)) + "\n", encoding="utf-8")
    return path


def test_hit_answers_without_computing(tmp_path, tiny_models, data, monkeypatch):
    cache = ResultCache(tmp_path / "c")
    spec = make_spec(str(tiny_models["bert"]), f"text:{data}")
    first = measure(spec, cache)
    assert not first.from_cache

    def boom(*_a, **_k):
        raise AssertionError("a cache hit must not compute")

    monkeypatch.setattr(layerwise, "compute", boom)
    second = measure(spec, cache)
    assert second.from_cache
    assert [r.avg_cos for r in second.rows] == [r.avg_cos for r in first.rows]
    assert second.drift["model"] == first.drift["model"]
    for name, arr in first.arrays.items():
        np.testing.assert_array_equal(second.arrays[name], arr)


def test_every_setting_that_changes_numbers_changes_the_key(tmp_path, tiny_models, data):
    model = str(tiny_models["bert"])
    base = prepare(make_spec(model, f"text:{data}")).key
    variants = [
        make_spec(model, f"text:{data}", max_length=8),
        make_spec(model, f"text:{data}", max_samples=5),
        make_spec(model, f"text:{data}", special_tokens="include"),
        make_spec(model, f"text:{data}", seed=3),
        make_spec(model, f"text:{data}", dtype="bfloat16"),
        make_spec(model, f"text:{data}", reservoir=100),
        make_spec(str(tiny_models["gpt2"]), f"text:{data}"),
        make_spec(model, "builtin"),
    ]
    keys = {prepare(v).key for v in variants}
    assert base not in keys and len(keys) == len(variants)
    # batch size and device do not change the numbers, so they share the entry
    assert prepare(make_spec(model, f"text:{data}", batch_size=3, device="cpu")).key == base
    # editing the data file is a new key
    data.write_text(data.read_text() + "One more sentence for the corpus.\n")
    assert prepare(make_spec(model, f"text:{data}")).key != base


def test_damaged_entry_is_reported_and_recomputed(tmp_path, tiny_models, data):
    cache = ResultCache(tmp_path / "c")
    spec = make_spec(str(tiny_models["bert"]), f"text:{data}")
    first = measure(spec, cache)
    path = cache.path_for(first.key)
    raw = bytearray(path.read_bytes())
    raw[-8:] = bytes(b ^ 0xFF for b in raw[-8:])  # flip every bit of the last array value
    path.write_bytes(bytes(raw))
    notices = []
    again = measure(spec, cache, on_notice=notices.append)
    assert not again.from_cache
    assert len(notices) == 1 and "damaged" in notices[0] and "recomputing" in notices[0]
    assert measure(spec, cache).from_cache  # rewritten, healthy
    with safe_open(str(path), framework="numpy") as f:  # a digit changed in the table itself
        header = json.loads(f.metadata()["isotui"])
    header["result"]["rows"][0]["avg_cos"] += 0.1
    save_file(load_file(str(path)), str(path), metadata={"isotui": json.dumps(header)})
    notices.clear()
    measure(spec, cache, on_notice=notices.append)
    assert "damaged" in notices[0]
    path.write_bytes(b"not a safetensors file")
    notices.clear()
    measure(spec, cache, on_notice=notices.append)
    assert "unreadable" in notices[0]


def test_old_schema_is_recomputed(tmp_path, tiny_models, data):
    cache = ResultCache(tmp_path / "c")
    spec = make_spec(str(tiny_models["bert"]), f"text:{data}")
    first = measure(spec, cache)
    path = cache.path_for(first.key)
    with safe_open(str(path), framework="numpy") as f:
        header = json.loads(f.metadata()["isotui"])
    header["schema"] = 0
    save_file(load_file(str(path)), str(path), metadata={"isotui": json.dumps(header)})
    notices = []
    again = measure(spec, cache, on_notice=notices.append)
    assert not again.from_cache and "schema 0" in notices[0]


def test_concurrent_writers_leave_one_complete_entry(tmp_path, tiny_models, data):
    cache = ResultCache(tmp_path / "c")
    result = measure(make_spec(str(tiny_models["bert"]), f"text:{data}"), None)
    errors = []

    def writer():
        try:
            for _ in range(10):
                layer_pass.store(result, cache)
                got = layer_pass.read(cache, result.key)
                assert got is not None and got.rows[0].avg_cos == result.rows[0].avg_cos
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [p.name for p in cache.runs.iterdir()] == [f"{result.key}.safetensors"]
    assert layer_pass.read(cache, result.key).rows[-1].isoscore == result.rows[-1].isoscore
