"""Numbers an independent audit recomputed (issue 16): each against a plain computation here."""

from __future__ import annotations

import numpy as np
import pytest

from isotui.experiments.layerwise import measure
from isotui.models.naming import bundled_minilm_dir, parse_model
from isotui.spec import make_spec

from .conftest import corpus
from .reference import reference_layer

TINY_GPT2 = "random:gpt2:n_layer=2,n_embd=64,n_head=4"


def _data(tmp_path, texts):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return f"text:{path}"


def _untrained(name):
    """The untrained model's weights (seed 0), to be fed here by hand."""
    from isotui.models.loading import load_model

    return load_model(parse_model(name), device="cpu", dtype="float32", seed=0, trust_remote_code=False)


# -- 1. a model without a token-type vocabulary is fed no token types ------------------------------


def test_untrained_gpt2_is_fed_input_ids_only(tmp_path):
    """GPT-2 accepts token_type_ids but embeds them with its token embedding: the MiniLM
    tokenizer's zeros would add one shared vector to every position (avg_cos 0.39 vs 0.02)."""
    import torch
    from transformers import AutoTokenizer

    texts = corpus(12)
    result = measure(make_spec(TINY_GPT2, _data(tmp_path, texts), max_length=32, batch_size=5), None)
    model = _untrained(TINY_GPT2).model
    tok = AutoTokenizer.from_pretrained(str(bundled_minilm_dir()))
    per_layer, labels = None, []
    for s, text in enumerate(texts):
        enc = tok(text, truncation=True, max_length=32, return_special_tokens_mask=True, return_tensors="pt")
        keep = enc["special_tokens_mask"][0] == 0
        with torch.no_grad():  # input_ids alone: what GPT-2 is meant to receive
            hs = model(input_ids=enc["input_ids"], output_hidden_states=True).hidden_states
        per_layer = per_layer or [[] for _ in hs]
        for layer, h in enumerate(hs):
            per_layer[layer].append(h[0][keep].double().numpy())
        labels.extend([s] * int(keep.sum()))
    labels = np.asarray(labels)
    for row, chunks in zip(result.rows, per_layer, strict=True):
        ref = reference_layer(np.concatenate(chunks), labels)
        assert row.avg_cos == pytest.approx(ref.avg_cos, rel=1e-6, abs=1e-9), row.layer
        assert row.drift_norm == pytest.approx(ref.drift_norm, rel=1e-6), row.layer
        assert row.avg_cos < 0.2, "a shared vector at every position would read about 0.4"


def test_bert_still_gets_its_token_types(tiny_models):
    """A config that declares a token-type vocabulary (BERT) is fed them; GPT-2's is not."""
    from isotui.extract.inputs import takes_token_types
    from isotui.models.loading import load_model

    bert = load_model(
        parse_model(str(tiny_models["bert"])), device="cpu", dtype="float32", seed=0, trust_remote_code=False
    )
    assert takes_token_types(bert, lambda name: True)
    gpt2 = _untrained(TINY_GPT2)
    assert not gpt2.own_tokenizer
    assert not takes_token_types(gpt2, lambda name: True)


def test_a_loaded_decoder_keeps_no_key_value_cache(tiny_models):
    """Issue 24: a decoder's forward made each block's keys and values for generation (as many
    values as the hidden states, counted in no memory plan; 3.1 MB a batch of 128 tokens for a
    12-block d = 256 GPT-2); isotui never generates, so a loaded model makes none, and its
    hidden states are the very ones it gives with the cache."""
    import torch

    from isotui.models.loading import load_model

    gpt2 = load_model(
        parse_model(str(tiny_models["gpt2"])), device="cpu", dtype="float32", seed=0, trust_remote_code=False
    )
    ids = torch.randint(0, 600, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = gpt2.model(input_ids=ids, output_hidden_states=True, return_dict=True)
        cached = gpt2.model(input_ids=ids, output_hidden_states=True, return_dict=True, use_cache=True)
    assert out.past_key_values is None
    assert cached.past_key_values is not None
    assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, cached.hidden_states, strict=True))


# -- 2. encoder-decoder numbers do not depend on the batch ----------------------------------------

TINY_T5 = "random:t5:d_model=32,d_ff=64,num_layers=2,num_heads=4,d_kv=8"
TINY_BART = (
    "random:bart:d_model=32,encoder_ffn_dim=64,decoder_ffn_dim=64,encoder_layers=2,decoder_layers=2,"
    "encoder_attention_heads=4,decoder_attention_heads=4,max_position_embeddings=128"
)


@pytest.mark.parametrize("model", [TINY_T5, TINY_BART])
@pytest.mark.parametrize("special", ["include", "exclude"])
def test_encoder_decoder_layers_are_batch_invariant(tmp_path, model, special):
    """A padded sample gets no extra decoder position: batch sizes 1, 7 and auto agree, and the
    decoder holds one vector per kept token, as one sample at a time."""
    texts = corpus(15)
    data = _data(tmp_path, texts)
    runs = [
        measure(make_spec(model, data, max_length=40, batch_size=b, special_tokens=special), None)
        for b in (1, 7, None)
    ]
    for other in runs[1:]:
        for a, b in zip(runs[0].rows, other.rows, strict=True):
            assert (a.component, a.n_vectors) == (b.component, b.n_vectors)
            for name in ("avg_cos", "drift_norm", "avg_cos_centered", "isoscore", "iw_centered"):
                assert getattr(b, name) == pytest.approx(getattr(a, name), rel=1e-6, abs=1e-9), name
            assert a.top_rogue_dim == b.top_rogue_dim
    enc = [r for r in runs[0].rows if r.component == "encoder"]
    dec = [r for r in runs[0].rows if r.component == "decoder"]
    if special == "include":  # the decoder has as many positions as the encoder, sample by sample
        assert dec[0].n_vectors == enc[0].n_vectors


@pytest.mark.parametrize("special", ["include", "exclude"])
def test_encoder_decoder_attention_is_batch_invariant(tmp_path, special):
    from isotui.experiments.attention import measure_attention

    data = _data(tmp_path, corpus(12))
    runs = [
        measure_attention(make_spec(TINY_T5, data, max_length=40, batch_size=b, special_tokens=special), None)
        for b in (1, 7, None)
    ]
    for other in runs[1:]:
        for a, b in zip(runs[0].rows, other.rows, strict=True):
            assert (a.component, a.layer, a.head, a.n_queries) == (b.component, b.layer, b.head, b.n_queries)
            assert b.q_avg_cos == pytest.approx(a.q_avg_cos, rel=1e-6, abs=1e-9)


# -- 3. standardised avg_cos keeps dimensions with a tiny spread ----------------------------------


def test_standardised_avg_cos_keeps_tiny_dimensions():
    """Dimensions of scale 1e-33 (a LayerNorm gain near 0) have a spread: z-scored, they count as
    much as any other. Only an exactly constant dimension is left out."""
    import torch

    from isotui.core.accumulator import LayerAccumulator, sample_keys

    rng = np.random.default_rng(0)
    n, d = 300, 12
    x = rng.normal(size=(n, d)) + 2.0
    x[:, 3] = 5e-33 * rng.normal(size=n)  # tiny spread around 0
    x[:, 7] = 1e-31 * rng.normal(size=n) + 4e-31
    x[:, 9] = 0.25  # exactly constant
    x = x.astype(np.float32)
    acc = LayerAccumulator(d, torch.device("cpu"), full_cov=True, reservoir=1000)
    for start in range(0, n, 64):
        chunk = torch.from_numpy(x[start : start + 64])
        ids = torch.arange(len(chunk))
        acc.commit(acc.partial(chunk, ids, sample_keys(0, ids + start, torch.zeros_like(ids))))
    stats = acc.finalize()
    x64 = x.astype(np.float64)
    std = x64.std(axis=0, ddof=1)
    live = std > 0
    assert list(np.flatnonzero(~live)) == [9]
    z = (x64[:, live] - x64[:, live].mean(0)) / std[live]
    u = z / np.linalg.norm(z, axis=1, keepdims=True)
    c = u @ u.T
    want = (c.sum() - np.trace(c)) / (n * (n - 1))
    assert stats.avg_cos_std == pytest.approx(want, rel=1e-9)
    assert stats.constant_dims == (9,)
