"""End to end: the engine's numbers against a plain all-pairs computation on the same models."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from isotui.experiments.layerwise import measure
from isotui.models.naming import bundled_minilm_dir
from isotui.spec import make_spec

from .conftest import corpus
from .reference import hidden_vectors, reference_layer

RTOL = 1e-6
METRICS = (
    "avg_cos",
    "avg_cos_xctx",
    "drift_norm",
    "mean_norm",
    "avg_cos_centered",
    "isoscore",
    "eff_rank",
    "top_pc_share",
)


def _write_corpus(tmp_path, texts):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return f"text:{path}"


def _check_against_reference(result, folder, texts, max_length, special="exclude", rtol=RTOL):
    layers, labels = hidden_vectors(folder, texts, max_length=max_length, special=special)
    assert len(result.rows) == len(layers)
    for row, x in zip(result.rows, layers, strict=True):
        ref = reference_layer(x, labels)
        assert row.n_vectors == ref.n
        for name in METRICS:
            got, want = getattr(row, name), getattr(ref, name)
            assert got == pytest.approx(want, rel=rtol, abs=1e-9), f"layer {row.layer} {name}"
        top = int(np.argmax(ref.dim_contrib))
        assert row.top_rogue_dim == top
        assert row.top_rogue_share == pytest.approx(ref.dim_contrib[top] / ref.avg_cos, rel=1e-5)
        assert row.null_p95 == pytest.approx(
            2 * stats.beta.ppf(0.95, (x.shape[1] - 1) / 2, (x.shape[1] - 1) / 2) - 1
        )
    drift = [r.drift_norm for r in result.rows]
    cos = [r.avg_cos for r in result.rows]
    want_s, want_p = stats.spearmanr(drift, cos), stats.pearsonr(drift, cos)
    from .test_core import exact_spearman_p

    assert len(drift) <= 9  # scipy enumerates every pairing
    want_s_p = exact_spearman_p(drift, cos)
    got = result.drift["model"]
    assert got.spearman_rho == pytest.approx(want_s.statistic)
    assert got.spearman_p == pytest.approx(want_s_p)
    assert got.spearman_p_t == pytest.approx(want_s.pvalue)
    assert got.pearson_r == pytest.approx(want_p.statistic)
    assert got.pearson_p == pytest.approx(want_p.pvalue)


@pytest.mark.parametrize("arch", ["bert", "gpt2", "gpt_neox"])
def test_tiny_models_match_all_pairs(tmp_path, tiny_models, arch):
    texts = corpus(24)
    spec = make_spec(str(tiny_models[arch]), _write_corpus(tmp_path, texts), max_length=48, batch_size=5)
    result = measure(spec, None)
    _check_against_reference(result, tiny_models[arch], texts, 48)
    # GPT-2 and GPT-NeoX return their last hidden state after the final norm; BERT has none.
    assert [r.final_norm for r in result.rows][-1] is (arch != "bert")
    assert not any(r.final_norm for r in result.rows[:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_a_cuda_run_matches_the_cpu_all_pairs_reference(tmp_path, tiny_models, arch):
    """The model on the GPU, the metrics against the float64 all-pairs reference computed on the
    CPU (float32 kernels on the GPU sum in another order: a looser tolerance)."""
    texts = corpus(24)
    spec = make_spec(
        str(tiny_models[arch]), _write_corpus(tmp_path, texts), max_length=48, batch_size=5, device="cuda"
    )
    result = measure(spec, None)
    assert result.meta["device"].startswith("cuda")
    _check_against_reference(result, tiny_models[arch], texts, 48, rtol=1e-4)


def test_minilm_matches_all_pairs(tmp_path):
    texts = corpus(40)
    spec = make_spec("minilm", _write_corpus(tmp_path, texts), max_length=32)
    result = measure(spec, None)
    _check_against_reference(result, bundled_minilm_dir(), texts, 32)
    assert result.meta["model_class"] == "BertModel"


def test_special_tokens_included_adds_cls_and_sep(tmp_path, tiny_models):
    texts = corpus(10)
    data = _write_corpus(tmp_path, texts)
    excl = measure(make_spec(str(tiny_models["bert"]), data, max_length=40), None)
    incl = measure(make_spec(str(tiny_models["bert"]), data, max_length=40, special_tokens="include"), None)
    assert incl.rows[0].n_vectors == excl.rows[0].n_vectors + 2 * len(texts)
    _check_against_reference(incl, tiny_models["bert"], texts, 40, special="include")


TINY_ROBERTA = "random:roberta:hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4"


@pytest.mark.parametrize("arch", ["bert", "gpt2", TINY_ROBERTA])
def test_padding_and_batch_size_invariance(tmp_path, tiny_models, arch):
    data = _write_corpus(tmp_path, corpus(30))
    name = str(tiny_models[arch]) if arch in tiny_models else arch  # RoBERTa: positions from ids
    runs = [measure(make_spec(name, data, batch_size=b), None) for b in (1, 7, 64)]
    for other in runs[1:]:
        for a, b in zip(runs[0].rows, other.rows, strict=True):
            assert a.n_vectors == b.n_vectors
            for name in METRICS:
                assert getattr(b, name) == pytest.approx(getattr(a, name), rel=RTOL), name


def test_reservoir_sample_is_used_beyond_its_size(tmp_path, tiny_models):
    texts = corpus(30)
    spec = make_spec(str(tiny_models["bert"]), _write_corpus(tmp_path, texts), reservoir=50, batch_size=4)
    result = measure(spec, None)
    row = result.rows[1]
    assert row.n_sample == 50 < row.n_vectors
    assert row.spectrum_from == "all"  # the covariance is still streamed exactly
    layers, labels = hidden_vectors(tiny_models["bert"], texts)
    exact = reference_layer(layers[1], labels).avg_cos_centered
    assert row.avg_cos_centered == pytest.approx(exact, abs=0.1)  # an estimate, in range


def test_random_model_type_is_seeded(tmp_path):
    data = _write_corpus(tmp_path, corpus(8))
    name = "random:gpt2:n_layer=2,n_embd=32,n_head=4,n_positions=64"
    a = measure(make_spec(name, data, seed=1), None)
    b = measure(make_spec(name, data, seed=1), None)
    c = measure(make_spec(name, data, seed=2), None)
    assert len(a.rows) == 3
    assert [r.avg_cos for r in a.rows] == [r.avg_cos for r in b.rows]
    assert [r.avg_cos for r in a.rows] != [r.avg_cos for r in c.rows]
    assert any("untrained" in note for note in a.meta["notes"])


def test_random_from_config_dir(tmp_path, tiny_models):
    data = _write_corpus(tmp_path, corpus(8))
    result = measure(make_spec(f"random:{tiny_models['gpt_neox']}", data), None)
    assert result.meta["model_class"] == "GPTNeoXModel"
    assert len(result.rows) == 3


def test_llama_style_decoder_runs_and_flags_its_final_norm(tmp_path):
    data = _write_corpus(tmp_path, corpus(8))
    name = (
        "random:llama:hidden_size=32,intermediate_size=64,num_hidden_layers=2,"
        "num_attention_heads=4,num_key_value_heads=2,max_position_embeddings=128"
    )
    result = measure(make_spec(name, data), None)
    assert result.meta["model_class"] == "LlamaModel"
    assert [r.final_norm for r in result.rows] == [False, False, True]
    assert result.meta["final_norm_module"] == "norm"


def test_max_length_beyond_the_model_is_refused(tmp_path, tiny_models):
    from isotui.errors import IsotuiError

    data = _write_corpus(tmp_path, corpus(4))
    with pytest.raises(IsotuiError, match=r"max-length 400 is longer than .* accepts \(128 positions\)"):
        measure(make_spec(str(tiny_models["bert"]), data, max_length=400), None)


def test_nothing_kept_is_a_clear_error(tmp_path, tiny_models):
    from isotui.errors import IsotuiError

    empty = tmp_path / "invisible.txt"
    empty.write_text("\u200b\n\u200b\u200b\n", encoding="utf-8")  # BERT keeps only [CLS] [SEP]
    with pytest.raises(IsotuiError, match="no token of the 2 samples was kept"):
        measure(make_spec(str(tiny_models["bert"]), f"text:{empty}"), None)


def test_final_norm_found_below_the_top_level(tmp_path):
    """OPT keeps its final norm at decoder.final_layer_norm."""
    name = (
        "random:opt:hidden_size=32,ffn_dim=64,num_hidden_layers=2,num_attention_heads=4,"
        "word_embed_proj_dim=32,max_position_embeddings=128"
    )
    result = measure(make_spec(name, _write_corpus(tmp_path, corpus(6))), None)
    assert [r.final_norm for r in result.rows] == [False, False, True]
    assert result.meta["final_norm_module"] == "decoder.final_layer_norm"


def test_bad_random_overrides_and_tiny_max_length(tmp_path, tiny_models):
    from isotui.errors import IsotuiError

    data = _write_corpus(tmp_path, corpus(3))
    with pytest.raises(IsotuiError, match="GPT2Config has no setting 'n_layers'"):
        measure(make_spec("random:gpt2:n_layers=2", data), None)
    with pytest.raises(IsotuiError, match="adds 2 special tokens; use --max-length 3 or more"):
        measure(make_spec(str(tiny_models["bert"]), data, max_length=2), None)
