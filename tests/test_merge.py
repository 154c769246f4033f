"""Mergeable state: a corpus measured in disjoint shards of samples, merged, equals one pass.

Each shard runs through the real engine over its own sample indices (global: they set reservoir
keys, masks and masked-LM positions), with the corpus-level choices (type weights, tracked types)
made from the whole corpus. Batches of one sample make every forward pass identical to the
one-pass run's, and float32 matmuls at "high" precision make the isotui's per-batch d x d
products float64, so what is compared is the merge itself: sums to 1e-12 relative, reservoirs
and subsamples exactly. (With float32 batch products the shards' different shifts round
differently, about 1e-8 relative on the metrics; :func:`test_float32_products_agree_to_float32`.)
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from isotui.spec import make_spec

from .conftest import corpus

N_SAMPLES = 18
REL = 1e-12


@pytest.fixture
def float64_products(monkeypatch):
    """Products in float64: two batchings of the same data then agree to 1e-12."""
    from isotui.core import products

    monkeypatch.setattr(products, "FLOAT64_PRODUCTS", True)


@pytest.fixture
def data(tmp_path) -> str:
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(corpus(N_SAMPLES)) + "\n", encoding="utf-8")
    return f"text:{path}"


def shards(n: int, k: int, seed: int = 1) -> list[tuple[int, ...]]:
    """``k`` disjoint shards covering 0..n-1, interleaved at random (not contiguous runs)."""
    order = np.random.default_rng(seed + k).permutation(n)
    return [tuple(int(i) for i in order[j::k]) for j in range(k)]


def assert_close(a, b, what: str, rel: float = REL) -> None:
    """Equal to ``rel`` relative to the larger magnitude of the two (NaN where both are NaN)."""
    import torch

    a = a.cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float64)
    b = b.cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, what
    assert np.array_equal(np.isnan(a), np.isnan(b)), what
    ok = ~np.isnan(a)
    scale = max(float(np.abs(a[ok]).max(initial=0)), float(np.abs(b[ok]).max(initial=0)), 1e-300)
    err = float(np.abs(a[ok] - b[ok]).max(initial=0)) / scale
    assert err <= rel, f"{what}: relative error {err:.3g}"


def centred(state: dict, sums: str, squares: str | None, gram: str | None) -> dict:
    """The shift-free parts of shifted sums: per-dimension and d x d centred second moments."""
    n = state["n_all"] if "n_all" in state else state["n"]
    s = state[sums].double()
    out = {}
    if squares:
        out[squares] = state[squares] - s * s / n
    if gram and gram in state:
        out[gram] = state[gram] - np.outer(s, s) / n
    return out


def assert_reservoirs_equal(a_keys, a_vecs, b_keys, b_vecs, what: str, dim: int = 0) -> None:
    """The same keyed sample, exactly (order aside)."""
    import torch

    oa, ob = torch.argsort(a_keys), torch.argsort(b_keys)
    assert torch.equal(a_keys[oa], b_keys[ob]), what
    assert torch.equal(a_vecs.index_select(dim, oa), b_vecs.index_select(dim, ob)), what


def assert_layer_states_equal(one: dict, merged: dict, what: str) -> None:
    import torch

    from isotui.core.accumulator import _LAYER_COUNTS, _LAYER_SUMS

    for k in _LAYER_COUNTS:
        assert one[k] == merged[k], f"{what} {k}"
    for k in _LAYER_SUMS:
        assert_close(one[k], merged[k], f"{what} {k}")
    for k in ("x_min", "x_max"):
        assert torch.equal(one[k], merged[k]), f"{what} {k}"
    c1, c2 = centred(one, "sum_xs", "sum_xs2", "gram"), centred(merged, "sum_xs", "sum_xs2", "gram")
    assert c1.keys() == c2.keys()
    for k in c1:
        assert_close(c1[k], c2[k], f"{what} centred {k}")
    keys, vecs = (one["res_keys"], merged["res_keys"]), (one["res"], merged["res"])
    assert_reservoirs_equal(keys[0], vecs[0], keys[1], vecs[1], f"{what} reservoir")


def assert_stats_equal(a, b, what: str) -> None:
    """Every field of two stats dataclasses: ints and strings exactly, floats to 1e-12."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, dict):  # plug-in metrics' columns (LayerStats.plugins, LayerRow.extra)
            assert list(x) == list(y), f"{what} {f.name}"
            for k in x:
                assert_close(x[k], y[k], f"{what} {f.name}.{k}")
        elif isinstance(x, (int, str, tuple)) and not isinstance(x, bool | float):
            assert x == y, f"{what} {f.name}"
        else:
            assert_close(x, y, f"{what} {f.name}")


# --- the merge arithmetic against numpy on all vectors -------------------------------------------


def test_layer_merge_of_synthetic_parts_matches_numpy_on_all_vectors(float64_products):
    """Three accumulators fed different parts (different first-batch shifts, far from each other),
    merged: the mean, per-dimension variance, covariance and avg_cos of all vectors, and the
    reservoir = the smallest keys of all vectors."""
    import torch

    from isotui.core.accumulator import LayerAccumulator, sample_keys

    rng = np.random.default_rng(0)
    parts = [rng.normal(loc, 1 + i, size=(40 + 7 * i, 6)) for i, loc in enumerate((0.0, 50.0, -20.0))]
    accs, all_keys = [], []
    for i, x in enumerate(parts):
        acc = LayerAccumulator(6, torch.device("cpu"), full_cov=True, reservoir=25)
        sample = torch.full((len(x),), i)
        for lo in range(0, len(x), 16):  # three batches each
            xb = torch.from_numpy(x[lo : lo + 16])
            keys = sample_keys(0, sample[lo : lo + 16], torch.arange(lo, lo + len(xb)))
            all_keys.append(keys)
            acc.commit(acc.partial(xb, torch.zeros(len(xb), dtype=torch.long), keys))
        accs.append(LayerAccumulator.from_state(acc.state()))
    merged = accs[0]
    for other in accs[1:]:
        merged.merge(other)
    x = np.concatenate(parts)
    n = len(x)
    assert merged.n_all == n
    ms = merged.sum_xs.numpy() / n
    cov = (merged.gram.numpy() - n * np.outer(ms, ms)) / (n - 1)
    np.testing.assert_allclose(cov, np.cov(x, rowvar=False), rtol=1e-12, atol=1e-12 * np.abs(cov).max())
    np.testing.assert_allclose(merged.dim_std(n), x.std(0, ddof=1), rtol=1e-12)
    np.testing.assert_allclose(merged.sum_x.numpy() / n, x.mean(0), rtol=1e-12)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    pairs = u @ u.T
    expected = (pairs.sum() - np.trace(pairs)) / (n * (n - 1))
    assert merged.finalize().avg_cos == pytest.approx(expected, rel=1e-12)
    np.testing.assert_array_equal(merged.x_min.numpy(), x.min(0))
    np.testing.assert_array_equal(merged.x_max.numpy(), x.max(0))
    keys = torch.cat(all_keys)
    smallest = torch.sort(keys).values[:25]
    assert torch.equal(torch.sort(merged.res_keys).values, smallest)
    chosen = torch.isin(keys, smallest)
    expect = torch.from_numpy(x).float()[chosen][torch.argsort(keys[chosen])]
    assert torch.equal(merged.res[torch.argsort(merged.res_keys)], expect)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_constant_dimensions_in_one_pass_and_merged_shards(dtype):
    """A dimension is constant exactly where numpy's range over all vectors is 0, in one pass and
    over merged shards: constant everywhere, constant in each shard at different values (not
    constant), all zero, a spread of float32 subnormals, one value a step off, and a float64
    value whose mean rounds (0.1 three times: its mean is not 0.1)."""
    import torch

    from isotui.core.accumulator import LayerAccumulator, sample_keys

    rng = np.random.default_rng(1)
    sizes = (40, 37, 3) if dtype == "float64" else (40, 37, 29)
    n, d = sum(sizes), 6
    x = torch.from_numpy(rng.normal(2.0, 1.0, size=(n, d))).to(getattr(torch, dtype))
    x[:, 0] = 0.1
    x[: sizes[0], 1], x[sizes[0] :, 1] = 1.5, -2.0
    x[:, 2] = 0.0
    if dtype == "float32":  # subnormals: 1 and 2 units of the smallest, squared ~1e-90 apart
        x[:, 3] = torch.tensor([1.4e-45, 2.8e-45], dtype=torch.float32).repeat(n)[:n]
    x[:, 4] = 0.75
    x[n // 2, 4] = 0.75 + torch.finfo(x.dtype).eps  # two steps of the dtype's own grid above 0.75
    want = tuple(int(k) for k in np.flatnonzero(np.ptp(x.to(torch.float64).numpy(), axis=0) == 0))
    assert want == (0, 2)  # the data is what it says

    def fed(rows: torch.Tensor, start: int) -> LayerAccumulator:
        acc = LayerAccumulator(d, torch.device("cpu"), full_cov=True, reservoir=8)
        for lo in range(0, len(rows), 16):
            ids = torch.arange(start + lo, start + min(lo + 16, len(rows)))
            keys = sample_keys(0, ids, torch.zeros_like(ids))
            acc.commit(acc.partial(rows[lo : lo + 16], ids - ids[0], keys))
        return acc

    assert fed(x, 0).finalize().constant_dims == want
    edges = np.cumsum((0, *sizes))
    shards = [LayerAccumulator.from_state(fed(x[a:b], int(a)).state()) for a, b in itertools.pairwise(edges)]
    merged = shards[0]
    for other in shards[1:]:
        merged.merge(other)
    assert merged.finalize().constant_dims == want


def test_constant_dimensions_when_a_state_from_before_is_merged():
    """A shard's state kept before ranges were dropped for float32 values (a finite range)
    merged with one kept after (none): dimension 0 is constant in the old shard only, dimension
    1 in both; the merge says what numpy's range over all vectors says, in either order."""
    import torch

    from isotui.core.accumulator import LayerAccumulator, sample_keys

    old = torch.tensor([[1.0, 5.0, 0.3], [1.0, 5.0, 0.7]], dtype=torch.float32)
    new = torch.tensor([[1.0, 5.0, 0.1], [2.0, 5.0, 0.9]], dtype=torch.float32)

    def state(x: torch.Tensor, start: int, *, ranged: bool) -> dict:
        acc = LayerAccumulator(3, torch.device("cpu"), full_cov=True, reservoir=4)
        ids = torch.arange(start, start + len(x))
        acc.commit(acc.partial(x, ids - start, sample_keys(0, ids, torch.zeros_like(ids))))
        if ranged:  # as the version before kept it
            acc.x_min, acc.x_max = x.amin(0).double(), x.amax(0).double()
        return acc.state()

    want = tuple(int(k) for k in np.flatnonzero(np.ptp(torch.cat([old, new]).numpy(), axis=0) == 0))
    assert want == (1,)
    pairs = [(state(old, 0, ranged=True), state(new, 2, ranged=False))]
    for first, second in [*pairs, pairs[0][::-1]]:
        merged = LayerAccumulator.from_state(first)
        merged.merge(LayerAccumulator.from_state(second))
        assert merged.finalize().constant_dims == want


def test_recentre_matches_sums_around_the_new_shift():
    import torch

    from isotui.core.accumulator import recentre

    x = torch.from_numpy(np.random.default_rng(3).normal(7.0, 2.0, size=(30, 5)))
    a, b = x[:3].mean(0), x[10:20].mean(0) + 1.0
    s, s2, g = recentre(a, b, len(x), (x - a).sum(0), ((x - a) ** 2).sum(0), (x - a).T @ (x - a))
    np.testing.assert_allclose(s.numpy(), (x - b).sum(0).numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s2.numpy(), ((x - b) ** 2).sum(0).numpy(), rtol=1e-12)
    np.testing.assert_allclose(g.numpy(), ((x - b).T @ (x - b)).numpy(), rtol=1e-12, atol=1e-10)


# --- shards through the real engine ---------------------------------------------------------------


def _layer_states(model: str, data: str, parts, **spec_kwargs):
    from isotui.experiments.layer_pass import extract_options, load_prepared, prepare
    from isotui.extract.runner import extract_state

    spec = make_spec(model, data, max_length=24, batch_size=1, reservoir=40, **spec_kwargs)
    prepared = prepare(spec)
    loaded, device = load_prepared(prepared)
    opts = extract_options(spec)
    kw = {"device": device, "model_name": model, "modality": spec.data.modality}
    one = extract_state(loaded, prepared.samples, opts=opts, **kw)
    return one, [
        extract_state(loaded, prepared.samples, opts=dataclasses.replace(opts, sample_ids=p), **kw)
        for p in parts
    ]


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_layer_shards_merge_to_one_pass(tiny_models, data, float64_products, name):
    from isotui.extract.runner import finish_extraction, merge_extraction_states

    parts2, parts3 = shards(N_SAMPLES, 2), shards(N_SAMPLES, 3)
    one, states = _layer_states(str(tiny_models[name]), data, parts2 + parts3)
    ex_one = finish_extraction(one)
    for shard_states in (states[:2], states[2:]):
        assert sum(s["n_samples"] for s in shard_states) == N_SAMPLES
        n_all = [s["components"]["model"][0]["n_all"] for s in shard_states]  # each its own samples
        assert sum(n_all) == one["components"]["model"][0]["n_all"] and min(n_all) > 0
        merged = merge_extraction_states(shard_states)
        assert merged["n_tokens"] == one["n_tokens"] and merged["n_samples"] == one["n_samples"]
        for c, layers in one["components"].items():
            for i, (a, b) in enumerate(zip(layers, merged["components"][c], strict=True)):
                assert a["n_all"] > a["reservoir_size"]  # the reservoir is a real sample
                assert a["types"] > 0 and a["weighted"]  # self-similarity and type weights are on
                assert_layer_states_equal(a, b, f"{c} layer {i}")
        ex_merged = finish_extraction(merged)
        for i, (a, b) in enumerate(zip(ex_one.layers, ex_merged.layers, strict=True)):
            assert_stats_equal(a, b, f"layer {i}")
        assert ex_one.notes == ex_merged.notes


def test_float32_products_agree_to_float32(tiny_models, data):
    """The default float32 batch products: each shard rounds around its own shift, so the merged
    spectrum agrees with one pass to float32 precision, not float64 (measured ~1e-8)."""
    from isotui.extract.runner import finish_extraction, merge_extraction_states

    one, states = _layer_states(str(tiny_models["gpt2"]), data, shards(N_SAMPLES, 3))
    a, b = finish_extraction(one), finish_extraction(merge_extraction_states(states))
    for x, y in zip(a.layers, b.layers, strict=True):
        assert x.avg_cos == pytest.approx(y.avg_cos, rel=1e-12)
        assert x.isoscore == pytest.approx(y.isoscore, rel=1e-6)
        assert x.eff_rank == pytest.approx(y.eff_rank, rel=1e-6)


def test_empty_shard_and_ids_outside_the_corpus_say_so(tiny_models, data):
    from isotui.errors import IsotuiError

    with pytest.raises(IsotuiError, match="empty"):
        _layer_states(str(tiny_models["bert"]), data, [()])
    with pytest.raises(IsotuiError, match=r"0\.\.17"):
        _layer_states(str(tiny_models["bert"]), data, [(0, 18)])


def test_final_norm_shards_merge_to_one_pass(tiny_models, data, float64_products):
    from isotui.experiments.final_norm import finish_norms, merge_norms_states, norms_state

    spec = make_spec(str(tiny_models["gpt2"]), data, max_length=24, batch_size=1, reservoir=40)
    one = norms_state(spec, every_layer=False)
    (ra,) = finish_norms(one)
    for k in (2, 3):
        merged = merge_norms_states(
            [norms_state(spec, every_layer=False, sample_ids=p) for p in shards(N_SAMPLES, k)]
        )
        assert merged["n_samples"] == one["n_samples"] == N_SAMPLES
        for pa, pb in zip(one["accumulators"], merged["accumulators"], strict=True):
            for side, a, b in zip(("before", "after"), pa, pb, strict=True):
                assert_layer_states_equal(a, b, f"{k} shards, {side}")
        (rb,) = finish_norms(merged)
        assert_stats_equal(ra.before, rb.before, "before")
        assert_stats_equal(ra.after, rb.after, "after")
        for da, db in zip(ra.dims, rb.dims, strict=True):
            assert_stats_equal(da, db, f"dim {da.dim}")


@pytest.fixture(scope="module")
def lm_folders(tiny_models, tmp_path_factory):
    """The tiny GPT-2 and BERT saved with language-model heads (causal and masked objectives)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    root = tmp_path_factory.mktemp("lm")
    torch.manual_seed(0)
    out = {}
    for name, cls in (("gpt2", AutoModelForCausalLM), ("bert", AutoModelForMaskedLM)):
        folder = root / name
        cls.from_config(AutoConfig.from_pretrained(tiny_models[name])).save_pretrained(folder)
        AutoTokenizer.from_pretrained(str(tiny_models[name])).save_pretrained(folder)
        out[name] = folder
    return out


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_gradient_shards_merge_to_one_pass(lm_folders, data, float64_products, name):
    from isotui.core.gradients import GradAccumulator
    from isotui.experiments.gradients import finish_gradients, gradients_state, merge_gradients_states

    spec = make_spec(str(lm_folders[name]), data, max_length=24, batch_size=1)
    one = gradients_state(spec, top_k=3)
    ra = finish_gradients(one)
    for k in (2, 3):
        merged = merge_gradients_states(
            [gradients_state(spec, top_k=3, sample_ids=p) for p in shards(N_SAMPLES, k)]
        )
        assert merged["loss_tokens"] == one["loss_tokens"]
        assert merged["loss_sum"] == pytest.approx(one["loss_sum"], rel=1e-12)
        for i, (a, b) in enumerate(zip(one["accumulators"], merged["accumulators"], strict=True)):
            for key in GradAccumulator._COUNTS:
                assert a[key] == b[key], f"layer {i} {key}"
            for key in GradAccumulator._SUMS:
                assert_close(a[key], b[key], f"layer {i} {key}")
            ca, cb = centred(a, "sum_xs", None, "x2"), centred(b, "sum_xs", None, "x2")
            assert_close(ca["x2"], cb["x2"], f"layer {i} centred x2")
        rb = finish_gradients(merged)
        assert ra.objective == rb.objective == ("causal" if name == "gpt2" else "masked")
        for a, b in zip(ra.rows, rb.rows, strict=True):
            assert_stats_equal(a, b, f"{k} shards, layer {a.layer}")


@pytest.mark.parametrize("name", ["bert", "gpt_neox"])
def test_attention_shards_merge_to_one_pass(tiny_models, data, float64_products, name):
    import torch

    from isotui.experiments.layer_pass import extract_options, load_prepared, prepare
    from isotui.extract.attention import extract_attention_state, finish_attention, merge_attention_states

    spec = make_spec(str(tiny_models[name]), data, max_length=24, batch_size=1)
    prepared = prepare(spec)
    loaded, device = load_prepared(prepared)
    opts = extract_options(spec)

    def state(ids=None) -> dict:
        return extract_attention_state(
            loaded,
            prepared.samples,
            device=device,
            opts=dataclasses.replace(opts, sample_ids=ids),
            on_progress=lambda _e: None,
            should_stop=lambda: False,
            model_name=spec.model,
            modality="text",
            sample_size=30,
        )

    one = state()
    ea = finish_attention(one)
    for k in (2, 3):
        merged = merge_attention_states([state(p) for p in shards(N_SAMPLES, k)])
        assert merged["n_tokens"] == one["n_tokens"]
        for ma, mb in zip(one["modules"], merged["modules"], strict=True):
            where = f"module {ma['site']['name']}"
            assert ma["site"] == mb["site"] and ma["rope"] == mb["rope"]
            for key, a in ma["acc"].items():
                b = mb["acc"][key]
                if key.endswith(("min", "max", "hist")) or not isinstance(a, torch.Tensor):
                    assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f"{where} {key}"
                else:
                    assert_close(a, b, f"{where} {key}")
            for part in ("pre_q", "pre_k"):
                assert (part in ma) == (part in mb)
                for key in ma.get(part, {}):
                    assert_close(ma[part][key], mb[part][key], f"{where} {part} {key}")
            for part in ("q_sample", "k_sample"):
                a, b = ma[part], mb[part]
                assert len(a["keys"]) == 30  # a real subsample of more positions
                what = f"{where} {part}"
                assert_reservoirs_equal(a["keys"], a["vectors"], b["keys"], b["vectors"], what, dim=1)
        eb = finish_attention(merged)
        for a, b in zip(ea.modules, eb.modules, strict=True):
            for ha, hb in zip(a.heads, b.heads, strict=True):
                assert_stats_equal(ha, hb, f"{k} shards, {a.site.name} head {ha.head}")
            np.testing.assert_array_equal(a.histograms, b.histograms)
            if a.pre_rope:
                assert_close(np.array(a.pre_rope), np.array(b.pre_rope), "pre-rope")
    if name == "gpt_neox":
        assert all("pre_q" in m for m in one["modules"])  # rotary: the pre-rotation sums merged too


def test_states_are_safetensors_storable(tiny_models, data, tmp_path):
    """Every value of an accumulator's state is a tensor or a plain scalar: the tensors round-trip
    through safetensors (no pickle) and the state rebuilt from them finalizes to the same numbers."""
    import torch
    from safetensors.torch import load_file, save_file

    from isotui.core.accumulator import LayerAccumulator

    one, _ = _layer_states(str(tiny_models["bert"]), data, [])
    state = one["components"]["model"][1]
    tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    scalars = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    assert all(isinstance(v, bool | int | float) for v in scalars.values())
    save_file(tensors, tmp_path / "layer.safetensors", metadata={k: str(v) for k, v in scalars.items()})
    back = load_file(tmp_path / "layer.safetensors") | scalars
    a = LayerAccumulator.from_state(state).finalize()
    b = LayerAccumulator.from_state(back).finalize()
    assert a.avg_cos == b.avg_cos and a.isoscore == b.isoscore
    assert math.isfinite(a.avg_cos_centered) and a.avg_cos_centered == b.avg_cos_centered


def test_audio_shards_merge_to_one_pass_with_their_own_seconds(float64_products):
    """Speech (no token types, frames as units): the merged audio seconds are the corpus's and the
    merged layers the one-pass layers."""
    from isotui.extract.runner import finish_extraction, merge_extraction_states

    model = (
        "random:wav2vec2:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,"
        "conv_dim=[16,16],conv_stride=[5,4],conv_kernel=[10,4],num_feat_extract_layers=2,"
        "num_conv_pos_embeddings=16,num_conv_pos_embedding_groups=2"
    )
    one, states = _layer_states(model, "synthetic:audio", shards(5, 2), max_samples=5)
    assert 0 < states[0]["audio_seconds"] < one["audio_seconds"]
    merged = merge_extraction_states(states)
    assert merged["audio_seconds"] == pytest.approx(one["audio_seconds"], rel=1e-12)
    assert not one["components"]["model"][0]["weighted"]  # frames: no type-uniform view
    a, b = finish_extraction(one), finish_extraction(merged)
    for i, (x, y) in enumerate(zip(a.layers, b.layers, strict=True)):
        assert_stats_equal(x, y, f"layer {i}")
