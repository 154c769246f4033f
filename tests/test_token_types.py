"""Which token types carry each layer's mean direction and top rogue dimension (issue 27 item 5),
checked against numpy over hidden states captured independently (``output_hidden_states``, one
sample at a time)."""

from __future__ import annotations

import csv

import numpy as np
import pytest

import isotui
from isotui.cli import main
from isotui.errors import IsotuiError

from .conftest import corpus

LINES = corpus(6)
TOP = 3


@pytest.fixture
def data(tmp_path) -> str:
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return f"text:{path}"


def expected(
    folder: str, lines: list[str] = LINES, top: int = TOP, max_length: int = 128
) -> dict[tuple[int, str], list[tuple[int, int, float]]]:
    """(layer, direction) -> the ``top`` types' (token id, count, share) over ``lines``, from
    numpy alone."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    per_layer: dict[int, list[np.ndarray]] = {}
    ids: list[np.ndarray] = []
    with torch.no_grad():
        for line in lines:
            enc = tok(
                line,
                return_tensors="pt",
                truncation=True,
                max_length=max_length,
                return_special_tokens_mask=True,
            )
            keep = enc.pop("special_tokens_mask")[0].numpy() == 0
            for i, h in enumerate(model(**enc, output_hidden_states=True).hidden_states):
                per_layer.setdefault(i, []).append(h[0].numpy().astype(np.float64)[keep])
            ids.append(enc["input_ids"][0].numpy()[keep])
    types = np.concatenate(ids)
    out = {}
    for layer, parts in per_layer.items():
        x = np.concatenate(parts)
        n = len(x)
        m = x.mean(0)
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        s = u.sum(0)
        k = int(np.argmax((s**2 - (u**2).sum(0)) / (n * (n - 1))))
        for direction, weights in (("mean", x @ (m / np.linalg.norm(m))), (f"rogue:{k}", u[:, k])):
            share: dict[int, float] = {}
            for t, w in zip(types.tolist(), weights.tolist(), strict=True):
                share[t] = share.get(t, 0.0) + w
            total = weights.sum()
            ranked = sorted(share, key=lambda t: (-share[t] / total, t))[:top]
            out[layer, direction] = [(t, int((types == t).sum()), share[t] / total) for t in ranked]
    return out


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_the_carriers_are_numpys(tiny_models, data, name):
    folder = str(tiny_models[name])
    result = isotui.experiment("token-types", model=folder, data=data, top=TOP, cache=False)
    want = expected(folder)
    got: dict[tuple[int, str], list[tuple[int, int, float]]] = {}
    for row in result.rows:
        got.setdefault((row["layer"], row["direction"]), []).append(
            (row["token_id"], row["count"], row["share"])
        )
    assert set(got) == set(want)
    for key, rows in want.items():
        assert [(t, c) for t, c, _ in got[key]] == [(t, c) for t, c, _ in rows], key
        np.testing.assert_allclose([s for *_, s in got[key]], [s for *_, s in rows], rtol=1e-5, atol=1e-6)


def test_the_csv_the_cache_and_what_is_refused(tiny_models, data, tmp_path):
    folder = str(tiny_models["gpt2"])
    out = tmp_path / "types.csv"
    argv = ["experiment", "token-types", "-m", folder, "--data", data, "--top", "2", "--csv", str(out), "-q"]
    assert main(argv) == 0
    with open(out, newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    again = isotui.experiment("token-types", model=folder, data=data, top=2)
    assert again.result.from_cache
    assert [r["token"] for r in table] == [str(r["token"]) for r in again.rows]
    assert len(table) == 3 * 2 * 2  # layers x directions x top
    with pytest.raises(IsotuiError, match="token-types reads text models"):
        isotui.experiment("token-types", model="random:timm:resnet18", data="synthetic:images", max_samples=2)
    with pytest.raises(IsotuiError, match="--top must be a positive integer"):
        isotui.experiment("token-types", model=folder, data=data, top=0)
