"""The final-norm analysis against the norm recomputed by hand on a tiny GPT-2, all pairs in numpy."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

from isotui.cli import main
from isotui.experiments.final_norm import measure_final_norm
from isotui.spec import make_spec

from .conftest import _bpe_tokenizer, corpus
from .reference import reference_layer


@pytest.fixture(scope="module")
def gpt2_gains(tmp_path_factory):
    """A tiny GPT-2 whose ln_f has non-trivial gains and biases (untrained ones are 1 and 0)."""
    import torch
    from transformers import GPT2Config, GPT2Model

    folder = tmp_path_factory.mktemp("gpt2ln")
    _bpe_tokenizer(folder)
    torch.manual_seed(2)
    model = GPT2Model(GPT2Config(vocab_size=600, n_embd=32, n_layer=2, n_head=4, n_positions=128))
    with torch.no_grad():
        model.ln_f.weight.copy_(torch.rand(32) * 2)
        model.ln_f.bias.copy_(torch.randn(32) * 0.1)
    model.save_pretrained(folder)
    return folder


def test_before_after_and_dimensions_match_hand_computation(gpt2_gains, tmp_path):
    import torch
    from transformers import AutoModel, AutoTokenizer

    texts = corpus(9)
    data = tmp_path / "t.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    result = measure_final_norm(make_spec(str(gpt2_gains), f"text:{data}", max_length=40, batch_size=4))
    assert result.module == "ln_f" and result.kind == "final"

    tok = AutoTokenizer.from_pretrained(str(gpt2_gains))
    model = AutoModel.from_pretrained(str(gpt2_gains)).eval()
    g, b = (p.detach().double().numpy() for p in (model.ln_f.weight, model.ln_f.bias))
    before, after, labels = [], [], []
    for s, text in enumerate(texts):
        ids = tok(text, truncation=True, max_length=40, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        # before ln_f: the last block's output, recomputed from the previous hidden state
        with torch.no_grad():
            x = model.h[-1](hs[-2])
            x = (x[0] if isinstance(x, tuple) else x)[0].double().numpy()
        y = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + model.ln_f.eps) * g + b
        np.testing.assert_allclose(y, hs[-1][0].double().numpy(), atol=1e-4)  # hand LN = the model's
        before.append(x)
        after.append(y)
        labels += [s] * len(x)
    labels = np.array(labels)
    ref_b = reference_layer(np.concatenate(before), labels)
    ref_a = reference_layer(np.concatenate(after), labels)
    assert result.before.avg_cos == pytest.approx(ref_b.avg_cos, abs=1e-6)
    assert result.after.avg_cos == pytest.approx(ref_a.avg_cos, abs=1e-6)
    assert result.after.isoscore == pytest.approx(ref_a.isoscore, abs=1e-5)
    mean_b = np.concatenate(before).mean(0)
    np.testing.assert_allclose([d.mean_before for d in result.dims], mean_b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([d.gain for d in result.dims], g, rtol=1e-6)
    np.testing.assert_allclose([d.bias for d in result.dims], b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        [d.share_after for d in result.dims], ref_a.dim_contrib / ref_a.avg_cos, rtol=1e-4, atol=1e-7
    )
    assert result.rho_mean_gain == pytest.approx(spearmanr(np.abs(mean_b), g).statistic, abs=1e-6)
    way = "lowers" if ref_a.avg_cos < ref_b.avg_cos else "raises"
    assert result.verdict().startswith(f"ln_f {way} avg_cos")


def test_cli_bert_uses_its_last_output_norm(tiny_models, tmp_path, capsys):
    out = tmp_path / "dims.csv"
    args = ["experiment", "final-norm", "-m", str(tiny_models["bert"]), "--max-samples", "6"]
    assert main([*args, "--csv", str(out), "-q"]) == 0
    text = capsys.readouterr().out
    assert "encoder.layer.1.output.LayerNorm" in text and "last block's output norm" in text
    assert len(out.read_text().splitlines()) == 1 + 32


def test_every_block_output_norm_of_a_post_ln_model(tiny_models, gpt2_gains, tmp_path, capsys):
    """BERT: each block's output LayerNorm gives hidden-state row L (checked over all pairs);
    a pre-LN GPT-2 has no block output norm: one sentence."""
    from isotui.experiments.final_norm import measure_norms

    from .reference import hidden_vectors

    texts = corpus(7)
    data = tmp_path / "t.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    folder = tiny_models["bert"]
    found = measure_norms(make_spec(str(folder), f"text:{data}", max_length=48), every_layer=True)
    assert [r.module for r in found] == [
        "encoder.layer.0.output.LayerNorm",
        "encoder.layer.1.output.LayerNorm",
    ]
    layers, labels = hidden_vectors(folder, texts, max_length=48)
    for i, r in enumerate(found, 1):
        ref = reference_layer(layers[i], labels)
        assert r.after.avg_cos == pytest.approx(ref.avg_cos, abs=1e-6)
        assert r.after.isoscore == pytest.approx(ref.isoscore, abs=1e-5)
    args = ["experiment", "final-norm", "-m", str(gpt2_gains), "--every-layer", "--max-samples", "3", "-q"]
    assert main(args) == 2
    assert "pre-LN" in capsys.readouterr().err


def test_verdict_says_unchanged_when_the_norm_only_rescales(tmp_path):
    """An untrained Llama's RMSNorm has unit gains: it rescales each vector, so every cosine stays
    (to float32 rounding); the sentence must not read "raises avg_cos from 0.0481 to 0.0481"."""
    llama = "random:llama:hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64"
    data = tmp_path / "t.txt"
    data.write_text("\n".join(corpus(8)) + "\n", encoding="utf-8")
    result = measure_final_norm(make_spec(llama, f"text:{data}", max_length=40, batch_size=4))
    b, a = result.before.avg_cos, result.after.avg_cos
    assert abs(a - b) <= 1e-6 * abs(b)  # a rescaling keeps every cosine
    assert result.after.isoscore != pytest.approx(result.before.isoscore, abs=1e-3)  # IsoScore moves
    verdict = result.verdict()
    assert f"leaves avg_cos unchanged at {b:.4f}" in verdict
    assert "raises" not in verdict and "lowers" not in verdict
