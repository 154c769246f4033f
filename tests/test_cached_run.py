"""The one cached-run path (:func:`isotui.experiments.cached.cached_run`): lookup over every key,
decode, relabel, compute and store, with a damaged or foreign entry said once and recomputed."""

from __future__ import annotations

import numpy as np


def test_cached_run_computes_once_then_answers_from_the_cache(tmp_path):
    from isotui.experiments.cached import cached_run
    from isotui.store.cache import ResultCache

    cache = ResultCache(tmp_path, folder="demo", schema=1)
    computed: list[int] = []
    notices: list[str] = []

    def run(keys):
        return cached_run(
            cache,
            keys,
            decode=lambda payload, arrays: {"n": payload["n"], "a": arrays["a"].tolist(), "cached": False},
            relabel=lambda r: r.update(cached=True),
            compute=lambda: computed.append(1) or {"n": 3, "a": [1.0, 2.0], "cached": False},
            encode=lambda r: ({"n": r["n"]}, {"a": np.asarray(r["a"])}),
            notice=notices.append,
        )

    first = run(["a" * 32, "b" * 32])
    assert first == {"n": 3, "a": [1.0, 2.0], "cached": False} and computed == [1]
    assert (tmp_path / "demo" / f"{'a' * 32}.safetensors").is_file()  # stored under the first key
    assert run(["c" * 32, "a" * 32]) == {"n": 3, "a": [1.0, 2.0], "cached": True}  # an older key still read
    assert computed == [1] and notices == []


def test_an_entry_that_does_not_decode_is_said_and_recomputed(tmp_path):
    """final-norm and gradients raised on an entry of a structure they cannot read; now every
    experiment says it in one sentence and recomputes, as attention and the layer run did."""
    from isotui.experiments.cached import cached_run
    from isotui.experiments.gradients import gradients_from_payload
    from isotui.store.cache import ResultCache

    cache = ResultCache(tmp_path, folder="gradients", schema=1)
    key = "d" * 32
    cache.put_payload(key, {"model": "m", "rows": [{"no": "such field"}]}, {})
    notices: list[str] = []
    result = cached_run(
        cache,
        [key],
        decode=gradients_from_payload,
        relabel=lambda _r: None,
        compute=lambda: "recomputed",
        encode=lambda _r: ({"model": "m"}, {}),
        notice=notices.append,
    )
    assert result == "recomputed"
    assert notices == [f"cache entry {key}.safetensors is unreadable (TypeError); recomputing"]


def test_a_final_norm_request_is_looked_up_after_its_compute(tmp_path, tiny_models):
    """The app's two steps through the same path: nothing cached, computed (and stored), then
    answered by the lookup with the same numbers."""
    from isotui.experiments.base import Context
    from isotui.experiments.final_norm import FinalNormRequest
    from isotui.spec import make_spec

    from .conftest import corpus

    data = tmp_path / "samples.txt"
    data.write_text("\n".join(corpus(6)) + "\n", encoding="utf-8")
    request = FinalNormRequest(make_spec(str(tiny_models["bert"]), f"text:{data}"))
    root = tmp_path / "c"
    assert request.lookup(root, print) is None
    (computed,) = request.compute(Context(root, notice=print))
    (hit,) = request.lookup(root, print)
    assert hit.from_cache and not computed.from_cache
    assert [d.share_after for d in hit.dims] == [d.share_after for d in computed.dims]
    assert (root / "final-norm" / f"{request.keys(root)[0]}.safetensors").is_file()
