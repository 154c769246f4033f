"""Every experiment that computes over a model is cached like layer runs, with --no-cache (issue 12)."""

from __future__ import annotations

import json

import pytest

from isotui.cli import main

from .conftest import corpus
from .test_gradients import lm_models  # noqa: F401  (fixture)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(6)) + "\n", encoding="utf-8")
    return f"text:{path}"


def _no_model_loading(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("loaded a model for a cached result")

    monkeypatch.setattr("isotui.experiments.layer_pass.load_prepared", refuse)


@pytest.mark.parametrize("every_layer", [False, True])
def test_final_norm_second_run_comes_from_cache(
    tiny_models, data, tmp_path, capsys, monkeypatch, every_layer
):
    base = ["experiment", "final-norm", "-m", str(tiny_models["bert"]), "--data", data, "-q"]
    base += ["--every-layer"] if every_layer else []
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert main([*base, "--json", str(first)]) == 0
    assert "(cache)" not in capsys.readouterr().out
    with monkeypatch.context() as m:
        _no_model_loading(m)
        assert main([*base, "--json", str(second)]) == 0
    assert "(cache)" in capsys.readouterr().out
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    for ra, rb in zip(a["results"], b["results"], strict=True):  # every number as computed
        ra["meta"].pop("data"), rb["meta"].pop("data")
        assert ra == rb
    assert main([*base, "--no-cache"]) == 0
    assert "(cache)" not in capsys.readouterr().out


def test_final_norm_reports_its_tokens(tiny_models, data, capsys):
    """The bar said `0 tokens 0 tok/s` for the whole run: the tokens measured are counted."""
    from isotui.experiments.final_norm import measure_norms
    from isotui.spec import make_spec

    seen = []
    measure_norms(make_spec(str(tiny_models["gpt2"]), data), every_layer=False, on_progress=seen.append)
    done = [e for e in seen if e.samples_done == 6]
    assert done and done[-1].tokens_done > 0


def test_gradients_second_run_comes_from_cache(lm_models, data, tmp_path, capsys, monkeypatch):  # noqa: F811
    base = ["experiment", "gradients", "-m", str(lm_models["gpt2"]), "--data", data, "--top-k", "3", "-q"]
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    assert main([*base, "--csv", str(first)]) == 0
    assert "(cache)" not in capsys.readouterr().out
    with monkeypatch.context() as m:
        _no_model_loading(m)
        assert main([*base, "--csv", str(second)]) == 0
    assert "(cache)" in capsys.readouterr().out
    assert first.read_text() == second.read_text()
    assert main([*base, "--top-k", "4"]) == 0  # another parameter: another result
    assert "(cache)" not in capsys.readouterr().out
    assert main([*base, "--no-cache"]) == 0
    assert "(cache)" not in capsys.readouterr().out


def test_gradients_refuses_bundled_minilm_naming_what_works_offline(capsys):
    assert main(["experiment", "gradients", "-m", "minilm", "--max-samples", "2", "-q"]) == 2
    err = capsys.readouterr().err
    assert "without its masked-LM head" in err and "random:bert" in err and "train-tiny" in err
    assert "Traceback" not in err
