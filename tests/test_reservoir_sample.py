"""The reservoir sample returned as arrays (issue 27 item 5): ``Result.sample(layer)`` and
``--save-sample PATH`` (``save_sample=``), checked against hidden states captured independently
(``output_hidden_states``, one sample at a time) for the tokens the file names."""

from __future__ import annotations

import json

import numpy as np
import pytest

import isotui
from isotui.cli import main
from isotui.errors import IsotuiError

from .conftest import corpus

LINES = corpus(6)
RESERVOIR = 16  # fewer than the corpus's tokens: the reservoir chooses


@pytest.fixture
def data(tmp_path) -> str:
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return f"text:{path}"


def read(path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    return (
        load_file(str(path)),
        json.loads(meta["isotui"]),
        {int(k): v for k, v in json.loads(meta["token_text"]).items()},
    )


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_the_saved_sample_is_the_models_hidden_states_for_its_tokens(tiny_models, data, tmp_path, name):
    import torch
    from transformers import AutoModel, AutoTokenizer

    folder = str(tiny_models[name])
    out = tmp_path / "sample.safetensors"
    result = isotui.run(folder, data=data, reservoir=RESERVOIR, save_sample=str(out), cache=False)
    arrays, meta, text = read(out)
    assert meta["model"] == folder and meta["run_key"] == result.key and meta["components"] == {"model": 3}
    model = AutoModel.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    hidden, ids = [], []
    with torch.no_grad():
        for line in LINES:  # one sample at a time: no padding, no batching in common with the run
            enc = tok(line, return_tensors="pt", truncation=True, max_length=128)
            hidden.append([h[0].numpy() for h in model(**enc, output_hidden_states=True).hidden_states])
            ids.append(enc["input_ids"][0].numpy())
    n_tokens = sum(len(i) for i in ids)
    for layer in range(3):
        vectors = arrays[f"model.{layer}.vectors"]
        where = list(
            zip(arrays[f"model.{layer}.sample_index"], arrays[f"model.{layer}.position"], strict=True)
        )
        assert len(vectors) == RESERVOIR < n_tokens and len(set(where)) == RESERVOIR
        assert where == sorted(where)  # by sample, then position
        for row, (s, p) in enumerate(where):
            np.testing.assert_allclose(vectors[row], hidden[s][layer][p], rtol=1e-5, atol=1e-5)
            token = int(ids[s][p])
            assert arrays[f"model.{layer}.token_ids"][row] == token
            assert token not in tok.all_special_ids  # special tokens are left out, as in the metrics
            assert text[token] == tok.convert_ids_to_tokens(token)
        # the API's arrays are the file's
        mine = result.sample(layer)
        np.testing.assert_array_equal(mine.vectors, vectors)
        np.testing.assert_array_equal(mine.token_ids, arrays[f"model.{layer}.token_ids"])
        assert mine.tokens == [text[int(t)] for t in mine.token_ids]
    # the same units in every layer (the reservoir's keys depend on the sample and position only)
    assert all(np.array_equal(arrays["model.0.position"], arrays[f"model.{i}.position"]) for i in range(1, 3))


def test_the_flag_writes_the_same_file_even_from_the_cache(tiny_models, data, tmp_path):
    folder = str(tiny_models["gpt2"])
    api_file, cli_file = tmp_path / "api.safetensors", tmp_path / "cli.safetensors"
    isotui.run(folder, data=data, reservoir=RESERVOIR)  # cached, without a sample
    argv = ["run", "-m", folder, "--data", data, "--reservoir", str(RESERVOIR), "-q"]
    assert main([*argv, "--save-sample", str(cli_file)]) == 0
    isotui.run(folder, data=data, reservoir=RESERVOIR, save_sample=str(api_file))
    theirs, mine = read(cli_file)[0], read(api_file)[0]
    assert sorted(theirs) == sorted(mine)
    for key in theirs:
        np.testing.assert_array_equal(theirs[key], mine[key])


def test_what_a_sample_needs_is_said(tiny_models, data, tmp_path, capsys):
    bert, gpt2 = str(tiny_models["bert"]), str(tiny_models["gpt2"])
    out = str(tmp_path / "s.safetensors")
    assert main(["run", "-m", bert, "-m", gpt2, "--data", data, "--save-sample", out, "-q"]) == 2
    assert "--save-sample writes one run's sample: it needs one model per run" in capsys.readouterr().err
    with pytest.raises(IsotuiError, match="holds no reservoir sample: run it with save_sample=PATH"):
        isotui.run(gpt2, data=data, reservoir=RESERVOIR).sample(0)
    assert main(["run", "-m", gpt2, "--data", data, "--save-sample", str(tmp_path), "-q"]) == 2
    assert "--save-sample): it is a directory, not a file" in capsys.readouterr().err
    with pytest.raises(IsotuiError, match="layer must be 0 to 2"):
        isotui.run(gpt2, data=data, reservoir=RESERVOIR, save_sample=out).sample(3)


def test_a_model_objects_sample_is_the_named_models(tiny_models, data, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    folder = str(tiny_models["gpt2"])
    named, held = tmp_path / "named.safetensors", tmp_path / "held.safetensors"
    isotui.run(folder, data=data, reservoir=RESERVOIR, save_sample=str(named), cache=False)
    model, tok = AutoModel.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    isotui.run(model, tokenizer=tok, data=data, reservoir=RESERVOIR, save_sample=str(held), cache=False)
    theirs, mine = read(named), read(held)
    assert sorted(theirs[0]) == sorted(mine[0]) and theirs[2] == mine[2]
    for key, value in theirs[0].items():
        np.testing.assert_allclose(mine[0][key], value, rtol=0, atol=1e-9)


def test_a_streamed_corpus_gives_the_same_sample(tiny_models, data, tmp_path, monkeypatch):
    """Windows of 2 samples (the corpus's 6 in 3 windows): each kept vector is found in its own
    window, with its corpus index, as in the run that holds the whole corpus."""
    from isotui.extract import streaming

    monkeypatch.setattr(streaming, "WINDOW", 2)
    folder = str(tiny_models["gpt2"])
    whole, streamed = tmp_path / "whole.safetensors", tmp_path / "streamed.safetensors"
    isotui.run(folder, data=data, reservoir=RESERVOIR, save_sample=str(whole), cache=False)
    isotui.run(folder, data=data, reservoir=RESERVOIR, save_sample=str(streamed), stream=True, cache=False)
    theirs, mine = read(whole), read(streamed)
    assert sorted(theirs[0]) == sorted(mine[0]) and theirs[2] == mine[2]
    assert set(theirs[0]["model.0.sample_index"].tolist()) - {0, 1}  # samples past the first window
    for key, value in theirs[0].items():
        if key.endswith(".vectors"):
            np.testing.assert_allclose(mine[0][key], value, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(mine[0][key], value)
