"""One cache key per computation: the max length a run uses, not the one asked for (issue 12)."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest

from isotui.backend import Backend, JobFinished
from isotui.cli import main
from isotui.experiments import layer_pass
from isotui.models.limits import declared_default_length
from isotui.models.naming import parse_model
from isotui.results import SCHEMA_VERSION
from isotui.spec import make_spec
from isotui.store.cache import ResultCache

from .conftest import corpus


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(6)) + "\n", encoding="utf-8")
    return path


RANDOM_GPT2 = "random:gpt2:n_layer=2,n_embd=32,n_head=4"
RANDOM_BERT = "random:bert:num_hidden_layers=2,hidden_size=32,num_attention_heads=4,intermediate_size=64"


@pytest.mark.parametrize("name", ["minilm", "bert", "gpt2", "gpt_neox", RANDOM_GPT2, RANDOM_BERT])
def test_declared_default_length_is_what_extraction_uses(name, tiny_models, data):
    """The length read from the files (no weights) equals the one the loaded model resolves."""
    model = str(tiny_models[name]) if name in tiny_models else name
    prepared = layer_pass.prepare(make_spec(model, f"text:{data}", max_samples=3))
    assert prepared.max_length == declared_default_length(parse_model(model))
    result = layer_pass.compute(prepared)
    assert result.meta["max_length"] == prepared.max_length


def test_explicit_length_equal_to_the_default_is_the_same_key(tiny_models, data):
    model = str(tiny_models["bert"])  # 128 positions
    default = layer_pass.prepare(make_spec(model, f"text:{data}"))
    explicit = layer_pass.prepare(make_spec(model, f"text:{data}", max_length=128))
    shorter = layer_pass.prepare(make_spec(model, f"text:{data}", max_length=64))
    assert default.key == explicit.key
    assert shorter.key != default.key
    too_long = layer_pass.prepare(make_spec(model, f"text:{data}", max_length=4096))
    assert too_long.key not in (default.key, shorter.key)  # refused when the model loads


def test_cli_default_run_then_explicit_limit_comes_from_cache(tiny_models, data, capsys):
    model = str(tiny_models["gpt2"])  # 128 positions, tokenizer limit 128
    assert main(["run", "-m", model, "--data", f"text:{data}", "-q"]) == 0
    assert "(cache)" not in capsys.readouterr().out
    assert main(["run", "-m", model, "--data", f"text:{data}", "-q", "--max-length", "128"]) == 0
    assert "(cache)" in capsys.readouterr().out


def test_app_explicit_length_hits_the_cli_entry(tiny_models, data, tmp_path, monkeypatch):
    """The app always passes a length: it must find what a default CLI run cached."""
    model = str(tiny_models["bert"])
    assert main(["run", "-m", model, "--data", f"text:{data}", "-q"]) == 0

    def no_compute(*_a, **_k):
        raise AssertionError("recomputed a cached run")

    done = threading.Event()
    events = []

    def post(event):
        events.append(event)
        if isinstance(event, JobFinished):
            done.set()

    from isotui.paths import cache_dir

    backend = Backend(ResultCache(cache_dir(None)), post, compute=no_compute)
    try:
        backend.submit(make_spec(model, f"text:{data}", max_length=128))
        assert done.wait(60), events
    finally:
        backend.close()
    finished = [e for e in events if isinstance(e, JobFinished)]
    assert finished and finished[0].result.from_cache


def test_entry_written_under_the_old_key_is_still_read(tiny_models, data, tmp_path):
    """Before this change a default run hashed max_length None: such entries stay readable,
    for a default run and for an explicit request of the same length."""
    model = str(tiny_models["bert"])
    prepared = layer_pass.prepare(make_spec(model, f"text:{data}"))
    old_fields = {  # the key as isotui <= schema 3 built it for a default run
        "schema": SCHEMA_VERSION,
        "model": prepared.model_fingerprint,
        "data": prepared.data_fingerprint,
        "max_length": None,
        "special_tokens": "exclude",
        "dtype": prepared.dtype,
        "seed": 0,
        "reservoir": 4096,
    }
    old_key = hashlib.sha256(json.dumps(old_fields, sort_keys=True).encode()).hexdigest()[:32]
    assert old_key != prepared.key
    result = layer_pass.compute(prepared)
    cache = ResultCache(tmp_path / "old")
    cache.put_payload(old_key, result.to_json(), result.arrays)
    for length in (None, 128):
        hit = layer_pass.lookup(
            layer_pass.prepare(make_spec(model, f"text:{data}", max_length=length)), cache
        )
        assert hit is not None and hit.from_cache
        assert hit.rows[0].avg_cos == result.rows[0].avg_cos
    assert (
        layer_pass.lookup(layer_pass.prepare(make_spec(model, f"text:{data}", max_length=64)), cache) is None
    )
