"""Attention statistics against queries and keys recomputed by hand from each module's weights,
one sample at a time with no padding, and an explicit softmax in numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from isotui.cli import main
from isotui.core.attention import row_stats, score_edges
from isotui.experiments.attention import attention_cache, measure_attention, summarize
from isotui.spec import make_spec
from tests.conftest import _bpe_tokenizer, corpus

TEXTS = corpus(7)


@pytest.fixture(scope="module")
def llama_gqa(tmp_path_factory):
    """A tiny Llama with grouped-query attention (4 query heads, 2 key/value heads)."""
    import torch
    from transformers import LlamaConfig, LlamaModel

    folder = tmp_path_factory.mktemp("llama")
    _bpe_tokenizer(folder)
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=600,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    LlamaModel(config).save_pretrained(folder)
    return folder


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rotate(x, cos, sin):
    """Rotary embedding on the leading cos.shape[-1] dims of each head (x: T, H, hd)."""
    rot = cos.shape[-1]
    head, rest = x[..., :rot], x[..., rot:]
    head = head * cos[:, None, :] + _rotate_half(head) * sin[:, None, :]
    return np.concatenate([head, rest], axis=-1)


def _project(arch, module, x, pos_emb):
    """Queries and keys (T, H, hd), before and after rotary, from the module's own weights."""
    w = lambda m: m.weight.detach().double().numpy()  # noqa: E731
    b = lambda m: m.bias.detach().double().numpy() if m.bias is not None else 0.0  # noqa: E731
    t = x.shape[0]
    if arch == "bert":
        q, k = x @ w(module.query).T + b(module.query), x @ w(module.key).T + b(module.key)
        hd = module.attention_head_size
        return q.reshape(t, -1, hd), k.reshape(t, -1, hd), None
    if arch == "gpt2":
        qkv = x @ w(module.c_attn) + b(module.c_attn)  # Conv1D: weight is (d, 3d)
        d = x.shape[1]
        hd = module.head_dim
        return qkv[:, :d].reshape(t, -1, hd), qkv[:, d : 2 * d].reshape(t, -1, hd), None
    if arch == "gpt_neox":
        hd = module.head_size
        qkv = (x @ w(module.query_key_value).T + b(module.query_key_value)).reshape(t, -1, 3 * hd)
        q, k = qkv[..., :hd], qkv[..., hd : 2 * hd]
    else:  # llama
        hd = module.head_dim
        q = (x @ w(module.q_proj).T).reshape(t, -1, hd)
        k = (x @ w(module.k_proj).T).reshape(t, -1, hd)
    cos, sin = (e[0].double().numpy() for e in pos_emb)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), (q, k)


def _attention_modules(model, arch):
    if arch == "bert":
        return [layer.attention.self for layer in model.encoder.layer]
    if arch == "gpt2":
        return [block.attn for block in model.h]
    if arch == "gpt_neox":
        return [layer.attention for layer in model.layers]
    return [layer.self_attn for layer in model.layers]


def reference(folder, arch, *, max_length=24):
    """Per layer and head: kept queries/keys (pre and post rotary), scores over allowed pairs of
    kept rows, and each kept row's softmax; one sample at a time, float64, numpy."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    modules = _attention_modules(model, arch)
    causal = arch != "bert"
    seen: dict[int, tuple] = {}

    def recorder(i):
        return lambda _m, args, kwargs: seen.__setitem__(i, (args, kwargs))

    hooks = [m.register_forward_pre_hook(recorder(i), with_kwargs=True) for i, m in enumerate(modules)]
    ref = [dict(q=[], k=[], pq=[], pk=[], scores=[], rows=[]) for _ in modules]
    for text in TEXTS:
        enc = tok(
            text, truncation=True, max_length=max_length, return_special_tokens_mask=True, return_tensors="pt"
        )
        keep = enc["special_tokens_mask"][0].numpy() == 0
        with torch.no_grad():
            model(input_ids=enc["input_ids"])
        for i, module in enumerate(modules):
            args, kwargs = seen[i]
            x = (args[0] if args else kwargs["hidden_states"])[0].double().numpy()
            q, k, pre = _project(arch, module, x, kwargs.get("position_embeddings"))
            t, heads, hd = q.shape
            groups = heads // k.shape[1]
            allowed = np.tril(np.ones((t, t), bool)) if causal else np.ones((t, t), bool)
            r = ref[i]
            r["q"].append(q[keep])
            r["k"].append(k[keep])
            if pre is not None:
                r["pq"].append(pre[0][keep])
                r["pk"].append(pre[1][keep])
            sc = np.einsum("thd,shd->hts", q, np.repeat(k, groups, axis=1)) / math.sqrt(hd)
            logits = np.where(allowed, sc, -np.inf)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            rows = np.flatnonzero(keep)
            r["scores"].append([sc[h][rows][allowed[rows]] for h in range(heads)])
            r["rows"].append([[p[h, t_][allowed[t_]] for t_ in rows] for h in range(heads)])
    for h in hooks:
        h.remove()
    return ref


def _avg_cos(x):
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    g = u @ u.T
    n = len(u)
    return (g.sum() - np.trace(g)) / (n * (n - 1))


@pytest.fixture(scope="module")
def folders(tiny_models, llama_gqa):
    return {**tiny_models, "llama": llama_gqa}


@pytest.mark.parametrize("arch", ["bert", "gpt2", "gpt_neox", "llama"])
def test_heads_match_hand_computation(folders, arch):
    folder = folders[arch]
    spec = make_spec(str(folder), f"text:{_texts_file(folder)}", max_length=24, batch_size=3)
    result = measure_attention(spec, None, sample_size=0)
    ref = reference(folder, arch)
    edges = score_edges()
    assert [m["layer"] for m in result.modules()] == list(range(1, len(ref) + 1))
    for i, r in enumerate(ref):
        rows = result.module_rows(i)
        q, k = np.concatenate(r["q"]), np.concatenate(r["k"])
        groups = q.shape[1] // k.shape[1]
        assert len(rows) == q.shape[1]
        for row in rows:
            h, g = row.head, row.head // groups
            assert row.kv_head == g
            qh, kh = q[:, h], k[:, g]
            qbar, kbar = qh.mean(0), kh.mean(0)
            assert row.n_queries == len(qh) and row.n_keys == len(kh)
            np.testing.assert_allclose(result.arrays[f"q_bar.{i}"][h], qbar, rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(result.arrays[f"k_bar.{i}"][g], kbar, rtol=1e-4, atol=1e-6)
            assert row.cos_qk_bar == pytest.approx(
                qbar @ kbar / np.linalg.norm(qbar) / np.linalg.norm(kbar), abs=1e-4
            )
            assert row.dot_qk_bar == pytest.approx(qbar @ kbar, rel=1e-4, abs=1e-7)
            assert row.q_mean_norm == pytest.approx(np.linalg.norm(qh, axis=1).mean(), rel=1e-5)
            assert row.q_avg_cos == pytest.approx(_avg_cos(qh), abs=1e-5)
            assert row.k_avg_cos == pytest.approx(_avg_cos(kh), abs=1e-5)
            scores = np.concatenate([s[h] for s in r["scores"]])
            assert row.n_scores == len(scores)
            assert row.score_mean == pytest.approx(scores.mean(), rel=1e-4, abs=1e-6)
            assert row.score_std == pytest.approx(scores.std(), rel=1e-3, abs=1e-6)
            assert row.score_max == pytest.approx(scores.max(), rel=1e-4, abs=1e-6)
            counts, _ = np.histogram(scores, bins=edges)
            hist = result.arrays[f"hist.{i}"][h]
            assert hist[0] == (scores < edges[0]).sum() and hist[-1] == (scores >= edges[-1]).sum()
            assert np.abs(hist[1:-1] - counts).sum() <= 2  # a score within float error of an edge
            probs = [p for rs in r["rows"] for p in rs[h]]
            assert row.softmax_max == pytest.approx(np.mean([p.max() for p in probs]), rel=1e-4)
            assert row.softmax_median == pytest.approx(np.mean([np.median(p) for p in probs]), rel=1e-4)
            assert row.softmax_min == pytest.approx(np.mean([p.min() for p in probs]), rel=1e-4)
            ent = np.mean([-(p * np.log(p)).sum() for p in probs])
            assert row.entropy == pytest.approx(ent, rel=1e-4)
            if arch in ("gpt_neox", "llama"):  # rotary: before-rotation statistics too
                pq, pk = np.concatenate(r["pq"])[:, h].mean(0), np.concatenate(r["pk"])[:, g].mean(0)
                assert row.rope
                assert row.cos_qk_bar_pre_rope == pytest.approx(
                    pq @ pk / np.linalg.norm(pq) / np.linalg.norm(pk), abs=1e-4
                )
                assert row.q_bar_norm_pre_rope == pytest.approx(np.linalg.norm(pq), rel=1e-4)
            else:
                assert not row.rope and math.isnan(row.cos_qk_bar_pre_rope)
        # the heads-averaged view's pre-rope cosine: the mean of the heads' hand-computed ones
        summary = summarize(result)[i]
        if arch in ("gpt_neox", "llama"):
            pq_all, pk_all = np.concatenate(r["pq"]), np.concatenate(r["pk"])
            cosines = []
            for h in range(q.shape[1]):
                pq, pk = pq_all[:, h].mean(0), pk_all[:, h // groups].mean(0)
                cosines.append(pq @ pk / np.linalg.norm(pq) / np.linalg.norm(pk))
            assert summary.cos_qk_bar_pre_rope == pytest.approx(np.mean(cosines), abs=1e-4)
        else:
            assert math.isnan(summary.cos_qk_bar_pre_rope)


def _texts_file(folder):
    path = folder / "texts.txt"
    if not path.exists():
        path.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    return path


def test_probe_leaves_the_model_output_unchanged(tiny_models):
    """The eager computation the probe does returns what the model's own attention returns."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from isotui.extract.attention_probe import PROBE, register_probe

    folder = tiny_models["gpt_neox"]
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.pad_token = tok.eos_token
    enc = tok(TEXTS[:3], padding=True, return_tensors="pt")
    model = AutoModel.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        ref = model(**enc).last_hidden_state
        register_probe()
        model.set_attn_implementation(PROBE)
        got = model(**enc).last_hidden_state
    keep = enc["attention_mask"].bool()
    torch.testing.assert_close(got[keep], ref[keep], rtol=1e-4, atol=1e-5)


def test_row_stats_match_numpy():
    import torch

    torch.manual_seed(0)
    scores = torch.randn(2, 3, 5, 6) * 3
    allowed = torch.ones(2, 1, 5, 6, dtype=torch.bool)
    allowed[0, :, :, 4:] = False
    allowed[1, :, :, 2] = False
    probs = torch.softmax(scores.masked_fill(~allowed, -1e9), -1)
    mx, md, mn, ent = (x.numpy() for x in row_stats(probs, allowed))
    full = allowed.expand_as(probs).numpy()
    for idx in np.ndindex(2, 3, 5):
        v = probs.numpy()[idx][full[idx]]
        assert mx[idx] == pytest.approx(v.max()) and mn[idx] == pytest.approx(v.min())
        assert md[idx] == pytest.approx(np.median(v))
        assert ent[idx] == pytest.approx(-(v * np.log(v)).sum())


def test_encoder_decoder_and_vit_sites(tmp_path):
    """T5: encoder, decoder and cross-attention modules, each head's Q_bar from its q weights;
    ViT: CLS is a special token, so queries are the patches only."""
    spec = make_spec(
        "random:t5:d_model=32,d_ff=64,num_layers=2,num_heads=2,d_kv=16", "builtin", max_samples=4
    )
    result = measure_attention(spec, None)
    sites = [(m["component"], m["layer"], m["attention"]) for m in result.modules()]
    assert sites == [
        ("encoder", 1, "self"),
        ("encoder", 2, "self"),
        ("decoder", 1, "self"),
        ("decoder", 1, "cross"),
        ("decoder", 2, "self"),
        ("decoder", 2, "cross"),
    ]
    cross = result.module_rows(3)[0]
    enc = result.module_rows(0)[0]
    assert cross.n_keys == enc.n_queries  # cross-attention keys are the encoder's tokens
    vit = make_spec(
        "random:vit:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,image_size=32,patch_size=8",
        "synthetic:images",
        max_samples=3,
    )
    res = measure_attention(vit, None)
    assert res.rows[0].n_queries == 3 * 16  # 16 patches per image, CLS excluded
    with_cls = measure_attention(
        make_spec(vit.model, "synthetic:images", max_samples=3, special_tokens="include"), None
    )
    assert with_cls.rows[0].n_queries == 3 * 17


def test_cached_subsample_and_cli(tiny_models, tmp_path):
    folder = tiny_models["bert"]
    spec = make_spec(str(folder), "builtin", max_samples=12, max_length=16)
    cache = attention_cache(tmp_path / "c")
    first = measure_attention(spec, cache, sample_size=20)
    again = measure_attention(spec, cache, sample_size=20)
    assert again.from_cache and not first.from_cache
    assert [r.cos_qk_bar for r in again.rows] == [r.cos_qk_bar for r in first.rows]
    assert again.arrays["q_sample.0"].shape == (4, 20, 8)
    np.testing.assert_array_equal(again.arrays["q_sample.0"], first.arrays["q_sample.0"])
    other_batching = measure_attention(
        make_spec(str(folder), "builtin", max_samples=12, max_length=16, batch_size=1), None, sample_size=20
    )
    np.testing.assert_allclose(other_batching.arrays["q_sample.0"], first.arrays["q_sample.0"], atol=1e-5)
    assert len(summarize(first)) == 2
    out = tmp_path / "att.csv"
    assert (
        main(["experiment", "attention", "-m", str(folder), "--max-samples", "5", "--csv", str(out), "-q"])
        == 0
    )
    import csv

    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 2 * 4 and rows[0]["head"] == "0" and float(rows[0]["entropy"]) > 0


def test_bad_models_say_one_sentence(capsys):
    args = ["experiment", "attention", "-m", "random:timm:resnet18", "--data", "synthetic:images"]
    assert main([*args, "--max-samples", "2", "-q"]) == 2
    err = capsys.readouterr().err
    assert "transformers model" in err and "Traceback" not in err


def test_an_attention_module_shared_across_layers_is_refused_not_read_once():
    """ALBERT runs one attention module for every layer: the probe reads a module once per pass,
    so its second call in one forward is refused in one sentence (it used to fold only the
    first call, or before that all of them into one layer, silently)."""
    import isotui
    from isotui.errors import IsotuiError

    model = "random:albert:num_hidden_layers=3,hidden_size=32,num_attention_heads=2,"
    model += "intermediate_size=64,embedding_size=16"
    with pytest.raises(IsotuiError, match="attends more than once in one forward pass"):
        isotui.experiment("attention", model=model, max_samples=6, cache=False, progress=False)
