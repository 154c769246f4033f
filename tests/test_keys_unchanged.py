"""Cache keys are the result cache's addresses: one hash (:func:`isotui.experiments.cached.
key_hash`) for every experiment, and every key exactly as isotui wrote it before, so existing
caches keep answering. Each expected key here is computed apart from isotui: sha256 over the
JSON of the fields written out in the test (and, for the pure keys, the literal a release before
the one hash wrote)."""

from __future__ import annotations

import hashlib
import json
from importlib import metadata

import pytest


def _sha(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


LAYER_KEY = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    ("folder", "schema", "params", "written_before"),
    [
        ("attention", 3, {"sample": 256}, "18fc2cbafe4b804cc0b173a7c4aef2f3"),
        ("attention", 3, {"sample": 0}, "eaef69fbdd5b96863dbdd65d3df62c31"),
        ("final-norm", 1, {"every_layer": True}, "09d121dbbd7d31d72f1f353f16f9e346"),
        ("gradients", 1, {"top_k": 10}, "821e68d924b86216f01df1f89a9b3620"),
    ],
)
def test_an_experiments_key_is_the_one_written_before(folder, schema, params, written_before):
    from isotui.experiments.cached import experiment_key

    fields = {"run": LAYER_KEY, "experiment": folder, "schema": schema, **params}
    assert _sha(fields) == written_before
    assert experiment_key(LAYER_KEY, folder, schema, params) == written_before
    if folder == "attention":
        from isotui.experiments.attention import SCHEMA, cache_key

        assert schema == SCHEMA and cache_key(LAYER_KEY, params["sample"]) == written_before


def layer_fields(prepared, seed: int, **extra) -> dict:
    """A default layer run's key fields, written out apart from isotui (``extra``: the optional
    ones a run adds, such as ``modules``)."""
    from isotui.results import SCHEMA_VERSION

    return {
        "schema": SCHEMA_VERSION,
        "model": prepared.model_fingerprint,
        "data": prepared.data_fingerprint,
        "max_length": prepared.max_length,
        "special_tokens": "exclude",
        "dtype": prepared.dtype,
        "seed": seed,
        "reservoir": 4096,
        **extra,
    }


def test_the_layer_runs_key_hashes_its_resolved_fields():
    from isotui.experiments.layer_pass import prepare
    from isotui.spec import make_spec

    prepared = prepare(make_spec("minilm", "builtin", max_samples=2, seed=3))
    fields = layer_fields(prepared, 3)
    assert prepared.max_length is not None  # MiniLM declares its length: the legacy key hashed None
    assert prepared.keys == (_sha(fields), _sha({**fields, "max_length": None}))


def test_a_drift_block_seeds_key_hashes_its_settings():
    from isotui.experiments.drift_block.config import DriftBlockConfig

    config = DriftBlockConfig(
        hidden=8, heads=2, intermediate=16, vocab=50, batch=2, seq_len=4, norms=(0.0, 1.0)
    )
    fields = {
        "experiment": "drift-block",
        "schema": 4,
        "torch": metadata.version("torch"),
        "transformers": metadata.version("transformers"),
        "dtype": "float32",
        "seed": 7,
        "hidden": 8,
        "heads": 2,
        "intermediate": 16,
        "init_std": 0.02,
        "vocab": 50,
        "batch": 2,
        "seq_len": 4,
        "norms": [0.0, 1.0],
    }
    assert config.key(7) == _sha(fields)
    pre = DriftBlockConfig(
        hidden=8, heads=2, intermediate=16, vocab=50, batch=2, seq_len=4, norms=(0.0,), block="pre-ln"
    )
    assert pre.key(0) == _sha({**fields, "seed": 0, "norms": [0.0], "block": "pre-ln"})


def test_every_cache_key_is_hashed_in_one_place():
    """``hexdigest()[:32]`` is written once, in the cached-run path."""
    from pathlib import Path

    import isotui

    root = Path(isotui.__file__).parent
    found = [
        p.relative_to(root).as_posix() for p in root.rglob("*.py") if "hexdigest()[:32]" in p.read_text()
    ]
    assert found == ["experiments/cached.py"]
