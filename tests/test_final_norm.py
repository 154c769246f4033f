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
    # the paired change's SE: the jackknife over the tokens' keys (every token in the reservoir)
    from isotui.core.accumulator import sample_keys

    positions = np.concatenate([np.arange(len(x)) for x in before])
    seed = make_spec(str(gpt2_gains), f"text:{data}").seed
    keys = sample_keys(seed, torch.as_tensor(labels), torch.as_tensor(positions)).numpy()
    f32 = [np.concatenate(side).astype(np.float32).astype(np.float64) for side in (before, after)]
    se = _jackknife_change(*f32, keys)
    assert result.avg_cos_change_se == pytest.approx(se, rel=1e-4)
    change = ref_a.avg_cos - ref_b.avg_cos  # 9 sentences: +5.1e-3, only 1.6 SE: not resolved
    assert f"{change:+.1e} {change / se:.1f}" == "+5.1e-03 1.6"  # docs/experiments/training.md
    assert result.verdict().startswith(
        f"ln_f leaves avg_cos unchanged at {ref_b.avg_cos:.4f} (within noise: "
    )


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


def _paired(before, after, reservoir=4096):
    """The norm's input and output accumulators over the same tokens (10 per sample), each row
    committed with the same sample id and key on both sides, as the experiment streams them."""
    import torch

    from isotui.core.accumulator import LayerAccumulator, sample_keys

    n, d = before.shape
    labels = torch.as_tensor(np.arange(n) // 10)
    keys = sample_keys(0, labels, torch.as_tensor(np.arange(n) % 10))
    accs = []
    for x in (before, after):
        acc = LayerAccumulator(d, torch.device("cpu"), full_cov=True, reservoir=reservoir)
        acc.commit(acc.partial(torch.as_tensor(x, dtype=torch.float32), labels, keys))
        accs.append(acc)
    return accs, keys.numpy()


def _jackknife_change(before, after, keys, groups=8):
    """The delete-a-group jackknife SE of avg_cos(after) - avg_cos(before), written apart: rows
    in key order cut into 8 groups, every pairwise cosine of the rest on each side."""

    def avg_cos(x):
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        c = u @ u.T
        return (c.sum() - np.trace(c)) / (len(x) * (len(x) - 1))

    order = np.argsort(keys)
    b, a = before[order], after[order]
    theta = []
    for part in np.array_split(np.arange(len(b)), groups):
        rest = np.setdiff1d(np.arange(len(b)), part)
        theta.append(avg_cos(a[rest]) - avg_cos(b[rest]))
    theta = np.array(theta)
    return np.sqrt((groups - 1) / groups * ((theta - theta.mean()) ** 2).sum())


def _verdict(before_acc, after_acc, d):
    from isotui.experiments.final_norm import _result, paired_change_se

    se = paired_change_se(before_acc, after_acc)
    facts = {"model": "m", "data": "d", "n_samples": 10, "seconds": 0.0}
    site = {"name": "ln_f", "kind": "final", "gain": np.ones(d), "bias": np.zeros(d)}
    return _result(facts, site, before_acc.finalize(), after_acc.finalize(), se)


def test_verdict_compares_the_paired_change_with_its_own_noise():
    """Issue 37: a norm that damps the drift a little changes avg_cos by 1.6e-3 over 100 vectors
    of d = 64, less than the null sd of one mean there (1.8e-3: the old rule read "unchanged"),
    but the two means move together: 26 SE of the change itself. Independent noise added to
    each vector (no change in expectation) reads "within noise"."""
    from isotui.core.null import null_mean_sd

    rng = np.random.default_rng(1)
    n, d = 100, 64
    z = rng.normal(size=(n, d))
    mu = np.zeros(d)
    mu[0] = 0.3 * np.sqrt(d)
    before, after = z + mu, z + 0.99 * mu
    (acc_in, acc_out), keys = _paired(before, after)
    result = _verdict(acc_in, acc_out, d)
    b, a = result.before.avg_cos, result.after.avg_cos
    assert 1.2e-3 < b - a < null_mean_sd(n, d) == pytest.approx(1.78e-3, rel=1e-2)
    want = _jackknife_change(*(x.astype(np.float32).astype(np.float64) for x in (before, after)), keys)
    assert result.avg_cos_change_se == pytest.approx(want, rel=1e-6)  # the reservoir holds all 100
    assert (b - a) / result.avg_cos_change_se > 20
    from isotui.experiments.final_norm import json_payload

    assert json_payload([result])["results"][0]["avg_cos_change_se"] == result.avg_cos_change_se
    verdict = result.verdict()
    assert f"lowers avg_cos from {b:.4f} to {a:.4f} (isotropy up; " in verdict and "unchanged" not in verdict
    within = 0
    for seed in range(40):  # no change in expectation: within noise (the jackknife leans wide)
        r = np.random.default_rng(seed)
        x = r.normal(size=(n, d))
        (acc_in, acc_out), _ = _paired(x, x + 0.5 * r.normal(size=(n, d)))
        within += "unchanged" in _verdict(acc_in, acc_out, d).verdict()
    assert within >= 36
    assert "(within noise: " in _verdict(*_paired(x, x + 0.5 * r.normal(size=(n, d)))[0], d).verdict()


def test_paired_change_se_from_a_reservoir_of_some_vectors():
    """A reservoir of 50 of the 100 vectors: the jackknife of its 50 pairs, scaled by sqrt(50/100)
    to the change over all 100; NaN where the reservoirs cannot hold 8 groups."""
    from isotui.experiments.final_norm import paired_change_se

    rng = np.random.default_rng(2)
    before = rng.normal(size=(100, 16)) + 1.0
    after = before * np.linspace(0.5, 1.5, 16)
    (acc_in, acc_out), keys = _paired(before, after, reservoir=50)
    held = np.argsort(keys)[:50]  # the reservoir keeps the 50 smallest keys
    f32 = [x[held].astype(np.float32).astype(np.float64) for x in (before, after)]
    want = _jackknife_change(*f32, keys[held]) * np.sqrt(50 / 100)
    assert paired_change_se(acc_in, acc_out) == pytest.approx(want, rel=1e-6)
    (acc_in, acc_out), _ = _paired(before, after, reservoir=10)
    assert np.isnan(paired_change_se(acc_in, acc_out))


def test_small_values_keep_their_sign_and_an_untrained_norm_says_no_p(tmp_path):
    """Issue 37: "gain -0.00" (a rounding that hides the sign) and "p=nan" on an untrained norm."""
    from rich.console import Console

    from isotui.experiments.final_norm import gain_correlation, signed
    from isotui.views import final_norm_table

    assert [signed(v, 2) for v in (-0.003, 0.0, -0.0, 0.004, -0.25, 1.0)] == [
        "-0.003",
        "0.00",
        "0.00",
        "0.004",
        "-0.25",
        "1.00",
    ]
    assert gain_correlation(0.4213, 0.003) == "Spearman(|x̄_k|, gain) = 0.42 (p=0.003)"
    llama = "random:llama:hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64"
    data = tmp_path / "t.txt"
    data.write_text("\n".join(corpus(8)) + "\n", encoding="utf-8")
    result = measure_final_norm(make_spec(llama, f"text:{data}", max_length=40, batch_size=4))
    console = Console(width=400, record=True)
    console.print(final_norm_table(result))
    text = console.export_text()
    assert "nan" not in text and "every gain is the same" in text
    assert "-0.00 " not in text and "-0.000 " not in text


def test_a_result_cached_before_the_paired_se_says_its_noise_is_unknown():
    """A final-norm result cached before issue 37 has no SE of the change: it loads as NaN, and its
    sentence calls nothing "within noise" (the rule it was cached under was the wrong one)."""
    from isotui.experiments.final_norm import results_from_payload, results_payload

    rng = np.random.default_rng(3)
    x = rng.normal(size=(100, 16))
    (acc_in, acc_out), _ = _paired(x, x + 0.5 * rng.normal(size=(100, 16)))
    result = _verdict(acc_in, acc_out, 16)
    payload, arrays = results_payload([result])
    del payload["results"][0]["avg_cos_change_se"]
    (old,) = results_from_payload(payload, arrays)
    assert np.isnan(old.avg_cos_change_se) and old.before.avg_cos == result.before.avg_cos
    assert "within noise" in result.verdict() and "within noise" not in old.verdict()
    assert "its noise not estimated" in old.verdict()
