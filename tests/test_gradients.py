"""The gradient experiment against torch.autograd run one sample at a time, and numpy all pairs."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from isotui.cli import main
from isotui.core.gradients import random_basis
from isotui.experiments.gradients import measure_gradients, mlm_mask
from isotui.spec import make_spec

from .conftest import corpus

TOP_K = 4
MAX_LEN = 24


@pytest.fixture(scope="module")
def lm_models(tiny_models, tmp_path_factory):
    """The fixture's tiny GPT-2 and BERT, saved again WITH their language-model heads."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("lm")
    torch.manual_seed(1)
    gpt2 = root / "gpt2"
    config = GPT2Config(vocab_size=600, n_embd=32, n_layer=2, n_head=4, n_positions=128)
    GPT2LMHeadModel(config).save_pretrained(gpt2)
    AutoTokenizer.from_pretrained(str(tiny_models["gpt2"])).save_pretrained(gpt2)
    bert = root / "bert"
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    BertForMaskedLM(config).save_pretrained(bert)
    AutoTokenizer.from_pretrained(str(tiny_models["bert"])).save_pretrained(bert)
    return {"gpt2": gpt2, "bert": bert}


def reference(folder, texts, objective, seed=0):
    """Per layer: every kept token's activation and gradient (float64), one sample at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    cls = AutoModelForMaskedLM if objective == "masked" else AutoModelForCausalLM
    model = cls.from_pretrained(str(folder)).eval()
    xs, gs = None, None
    for s, text in enumerate(texts):
        enc = tok(
            text, truncation=True, max_length=MAX_LEN, return_special_tokens_mask=True, return_tensors="pt"
        )
        ids, special = enc["input_ids"], enc["special_tokens_mask"].bool()
        keep = ~special[0]
        if objective == "masked":
            masked = mlm_mask(seed, torch.tensor([s]), torch.arange(ids.shape[1]), ~special)
            labels = torch.where(masked, ids, -100)[0]
            ids = torch.where(masked, tok.mask_token_id, ids)
            targets = labels
        else:
            targets = torch.cat([ids[0, 1:], torch.tensor([-100])])
            keep[-1] = False
        kwargs = {"token_type_ids": enc["token_type_ids"]} if "token_type_ids" in enc else {}
        out = model(input_ids=ids, output_hidden_states=True, **kwargs)
        logp = torch.log_softmax(out.logits[0], -1)
        loss = sum(-logp[t, targets[t]] for t in range(ids.shape[1]) if targets[t] >= 0)
        grads = torch.autograd.grad(loss, out.hidden_states)
        if xs is None:
            xs, gs = [[] for _ in grads], [[] for _ in grads]
        for layer, (h, g) in enumerate(zip(out.hidden_states, grads, strict=True)):
            xs[layer].append(h[0, keep].detach().double().numpy())
            gs[layer].append(g[0, keep].double().numpy())
    return [np.concatenate(x) for x in xs], [np.concatenate(g) for g in gs]


def all_pairs_cos(g):
    g = g[np.linalg.norm(g, axis=1) > 0]
    u = g / np.linalg.norm(g, axis=1, keepdims=True)
    c = u @ u.T
    n = len(u)
    return (c.sum() - np.trace(c)) / (n * (n - 1))


def share(g, basis):
    return float((np.linalg.norm(g @ basis, axis=1) ** 2).sum() / (np.linalg.norm(g, axis=1) ** 2).sum())


def check_against_reference(result, xs, gs, seed=0):
    assert len(result.rows) == len(xs) == 3
    for row, x, g in zip(result.rows, xs, gs, strict=True):
        d = x.shape[1]
        assert row.n_vectors == len(g)
        assert row.n_zero == int((np.linalg.norm(g, axis=1) == 0).sum())
        assert row.grad_avg_cos == pytest.approx(all_pairs_cos(g), abs=1e-5)
        assert row.act_avg_cos == pytest.approx(all_pairs_cos(x), abs=1e-5)
        assert row.grad_drift_norm == pytest.approx(np.linalg.norm(g.mean(0)), rel=1e-4)
        assert row.grad_mean_norm == pytest.approx(np.linalg.norm(g, axis=1).mean(), rel=1e-4)
        vals, vecs = np.linalg.eigh(np.cov(x, rowvar=False))  # ascending; eigenvectors are columns
        top = vecs[:, -TOP_K:]
        assert row.top_share == pytest.approx(share(g, top), abs=1e-5)
        assert row.act_top_var == pytest.approx(vals[-TOP_K:].sum() / vals.sum(), abs=1e-6)
        assert row.random_share == pytest.approx(share(g, random_basis(d, TOP_K, seed)), abs=1e-6)
        assert row.expected_share == pytest.approx(TOP_K / d)
        gvals = np.linalg.eigvalsh(g.T @ g)
        assert row.grad_top_share == pytest.approx(gvals[-TOP_K:].sum() / gvals.sum(), abs=1e-5)
        assert row.top_share <= row.grad_top_share + 1e-9 and row.random_share <= row.grad_top_share + 1e-9


@pytest.mark.parametrize("name, objective", [("gpt2", "causal"), ("bert", "masked")])
def test_matches_autograd_one_sample_at_a_time_and_ignores_batching(lm_models, tmp_path, name, objective):
    texts = corpus(7)
    data = tmp_path / "t.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    xs, gs = reference(lm_models[name], texts, objective)
    results = [
        measure_gradients(
            make_spec(str(lm_models[name]), f"text:{data}", max_length=MAX_LEN, batch_size=b), top_k=TOP_K
        )
        for b in (1, 4)
    ]
    for result in results:
        assert result.objective == objective
        check_against_reference(result, xs, gs)
    if objective == "masked":  # last layer: only the masked positions get a gradient
        assert 0 < results[0].rows[-1].n_vectors - results[0].rows[-1].n_zero < results[0].rows[-1].n_vectors
        assert results[0].rows[0].n_zero == 0


def test_random_basis_is_a_seeded_orthonormal_uniform_subspace():
    q = random_basis(32, 4, 7)
    np.testing.assert_allclose(q.T @ q, np.eye(4), atol=1e-12)
    np.testing.assert_array_equal(q, random_basis(32, 4, 7))
    assert not np.allclose(q, random_basis(32, 4, 8))
    # a fixed vector's energy share in uniform random 4-dim subspaces averages k/d = 1/8
    v = np.random.default_rng(0).standard_normal(32)
    shares = [np.linalg.norm(random_basis(32, 4, s).T @ v) ** 2 / (v @ v) for s in range(400)]
    assert np.mean(shares) == pytest.approx(4 / 32, abs=0.015)


def test_mlm_mask_is_per_sample_and_never_empty():
    import torch

    cand = torch.ones((3, 40), dtype=torch.bool)
    cand[:, 0] = cand[:, -1] = False
    cand[2, 5:] = False  # a short sample: still one masked token
    m = mlm_mask(0, torch.tensor([0, 1, 2]), torch.arange(40), cand)
    assert not (m & ~cand).any() and bool(m.any(1).all())
    alone = mlm_mask(0, torch.tensor([1]), torch.arange(40), cand[1:2])
    assert torch.equal(alone[0], m[1])  # the same sample masks the same positions in any batch


def test_cli_table_and_csv(lm_models, tmp_path, capsys):
    out = tmp_path / "g.csv"
    args = ["experiment", "gradients", "-m", str(lm_models["gpt2"]), "--max-samples", "5", "--top-k", "3"]
    assert main([*args, "--max-length", "16", "--csv", str(out), "-q"]) == 0
    text = capsys.readouterr().out
    assert "GPT2LMHeadModel (causal LM)" in text and "top-3 share" in text and "(cache)" not in text
    rows = list(csv.DictReader(out.open()))
    assert [r["layer"] for r in rows] == ["0", "1", "2"]
    assert {"grad_avg_cos", "grad_drift_norm", "grad_mean_norm", "top_share", "random_share"} <= set(rows[0])


def test_base_gpt2_checkpoint_gets_its_tied_head(tiny_models, capsys):
    args = ["experiment", "gradients", "-m", str(tiny_models["gpt2"]), "--max-samples", "3", "-q"]
    assert main([*args, "--max-length", "12"]) == 0


@pytest.mark.parametrize(
    "which, extra, says",
    [
        ("gpt2-lm", ["--top-k", "32"], "--top-k 32 is not below the hidden size 32"),
        ("random:vit", [], "not text"),
        ("bert-base", [], "has no trained language-model head"),
        ("gpt2-lm", ["--top-k", "0"], "top-k must be a positive integer"),
    ],
)
def test_bad_inputs_one_sentence(lm_models, tiny_models, capsys, which, extra, says):
    model = {"gpt2-lm": str(lm_models["gpt2"]), "bert-base": str(tiny_models["bert"])}.get(which, which)
    args = ["experiment", "gradients", "-m", model, "--max-samples", "2", "--max-length", "12", "-q"]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2  # one sentence (rich may wrap it once)
