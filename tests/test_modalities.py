"""Every model family of Godey et al. 2024 through the real loading path, on synthetic and file
inputs, checked against a plain computation: each sample run alone through the model (no
batching, no padding), the kept vectors picked by hand here, metrics over all pairs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from isotui.experiments.layerwise import measure
from isotui.spec import make_spec

from .conftest import corpus
from .reference import reference_layer

RTOL = 1e-5
PAIR_METRICS = ("avg_cos", "avg_cos_xctx", "drift_norm", "mean_norm", "avg_cos_centered")
SPECTRUM_METRICS = ("isoscore", "eff_rank", "top_pc_share")
IMAGE = 32  # tiny models see 32x32 images


@pytest.fixture(scope="module")
def media_models(tmp_path_factory):
    """Tiny random-init models of each family, saved with their processors and loaded by path."""
    import torch
    import transformers as T

    root = tmp_path_factory.mktemp("media_models")
    torch.manual_seed(0)
    vit_kw = dict(image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    image_proc = T.ViTImageProcessor(size={"height": IMAGE, "width": IMAGE})
    specs = {
        "vit": (T.ViTModel(T.ViTConfig(intermediate_size=64, **vit_kw)), image_proc),
        "deit": (T.DeiTModel(T.DeiTConfig(intermediate_size=64, **vit_kw)), image_proc),
        "beit": (T.BeitModel(T.BeitConfig(intermediate_size=64, **vit_kw)), image_proc),
        "resnet": (
            T.ResNetModel(
                T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
            ),
            image_proc,
        ),
        "convnext": (
            T.ConvNextModel(T.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)),
            image_proc,
        ),
        "efficientnet": (
            T.EfficientNetModel(
                T.EfficientNetConfig(
                    image_size=IMAGE, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320
                )
            ),
            image_proc,
        ),
        "cvt": (
            T.CvtModel(T.CvtConfig(embed_dim=[8, 16, 32], num_heads=[1, 2, 2], depth=[1, 2, 3])),
            image_proc,
        ),
        "segformer": (
            T.SegformerModel(
                T.SegformerConfig(
                    num_encoder_blocks=2,
                    depths=[1, 1],
                    sr_ratios=[2, 1],
                    hidden_sizes=[8, 16],
                    num_attention_heads=[1, 2],
                    patch_sizes=[7, 3],
                    strides=[4, 2],
                    mlp_ratios=[2, 2],
                )
            ),
            image_proc,
        ),
    }
    wav_kw = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 4),
        num_feat_extract_layers=2,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )
    specs["wav2vec2"] = (
        T.Wav2Vec2Model(T.Wav2Vec2Config(**wav_kw)),
        T.Wav2Vec2FeatureExtractor(return_attention_mask=False, do_normalize=True),
    )
    specs["hubert"] = (
        T.HubertModel(T.HubertConfig(**wav_kw, feat_extract_norm="layer")),
        T.Wav2Vec2FeatureExtractor(return_attention_mask=True, do_normalize=True),
    )
    whisper = T.WhisperConfig(
        vocab_size=100,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=32,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    specs["whisper"] = (T.WhisperModel(whisper), T.WhisperFeatureExtractor(feature_size=80))
    byt5 = T.T5Config(
        vocab_size=384,
        d_model=32,
        d_ff=64,
        d_kv=16,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    specs["byt5"] = (T.T5Model(byt5), T.ByT5Tokenizer())
    canine = T.CanineConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    specs["canine"] = (T.CanineModel(canine), T.CanineTokenizer())
    out = {}
    for name, (model, proc) in specs.items():
        folder = root / name
        model.save_pretrained(folder)
        proc.save_pretrained(folder)
        out[name] = folder
    return out


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory):
    """Clips as files: wav at 22.05 kHz and flac at 8 kHz (resampled to 16 kHz on load)."""
    import soundfile

    from isotui.data.media import synthetic_audio

    root = tmp_path_factory.mktemp("audio")
    for i, (rate, ext) in enumerate([(22050, "wav"), (8000, "flac"), (22050, "wav"), (16000, "flac")]):
        wave = synthetic_audio(i, rate=rate)
        (root / "sub").mkdir(exist_ok=True)
        soundfile.write(str(root / ("sub" if i % 2 else "") / f"clip{i}.{ext}"), wave, rate)
    return root


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    from PIL import Image

    from isotui.data.media import synthetic_image

    root = tmp_path_factory.mktemp("images")
    for i in range(5):
        img = Image.fromarray(synthetic_image(100 + i, size=48 + 8 * i))  # sizes differ: resized
        img.save(root / f"img{i}.{'png' if i % 2 else 'jpg'}")
    (root / "notes.txt").write_text("not an image")
    return root


# -- the plain computation --------------------------------------------------------------------


def _check(rows, layers, labels, *, spectrum=True):
    """``rows`` against all-pairs metrics of ``layers`` (n x d each) with sample ``labels``."""
    assert len(rows) == len(layers)
    for row, x in zip(rows, layers, strict=True):
        x = np.asarray(x, dtype=np.float64)
        assert row.n_vectors == len(x), f"{row.component} layer {row.layer}"
        assert row.dim == x.shape[1]
        ref = _reference(x, labels, spectrum=spectrum)
        for name, want in ref.items():
            got = getattr(row, name)
            assert got == pytest.approx(want, rel=RTOL, abs=1e-7, nan_ok=True), (
                f"{row.component} {row.layer} {name}"
            )


def _reference(x, labels, *, spectrum):
    spread = float(((x - x.mean(0)) ** 2).sum(1).mean())
    if spread <= 1e-10 * float((x**2).sum(1).mean()):  # all vectors equal (to float32 precision):
        out = _pairs_only(x, labels)  # no spectrum and no centred direction, only the pair metrics
        out.pop("avg_cos_centered")
        return out
    if spectrum and x.shape[1] <= 4096:
        ref = reference_layer(x, labels)
        return {name: getattr(ref, name) for name in (*PAIR_METRICS, *SPECTRUM_METRICS)}
    out = _pairs_only(x, labels)
    if spectrum:  # d > n: the spectrum from singular values, never a d x d matrix
        n = len(x)
        s = np.linalg.svd(x - x.mean(0), compute_uv=False) ** 2 / (n - 1)
        p = s[s > 1e-12 * s.sum()] / s.sum()
        out["eff_rank"] = math.exp(-(p * np.log(p)).sum())
        out["top_pc_share"] = s[0] / s.sum()
    return out


def _pairs_only(x, labels):
    """Pair metrics over every kept vector; zero vectors have no direction and are left out of
    the cosines (as design.md says), not of the norms."""
    norms = np.linalg.norm(x, axis=1)
    u, lab = x[norms > 0] / norms[norms > 0, None], labels[norms > 0]
    n = len(u)
    g = u @ u.T
    distinct, cross = ~np.eye(n, dtype=bool), lab[:, None] != lab[None, :]
    v = x - x.mean(0)
    with np.errstate(invalid="ignore"):  # identical vectors: no centred direction (NaN, as isotui)
        uc = v / np.linalg.norm(v, axis=1, keepdims=True)
    out = {
        "avg_cos": g[distinct].mean() if n >= 2 else math.nan,
        "drift_norm": np.linalg.norm(x.mean(0)),
        "mean_norm": np.linalg.norm(x, axis=1).mean(),
        "avg_cos_centered": (uc @ uc.T)[~np.eye(len(x), dtype=bool)].mean(),
    }
    if cross.any():
        out["avg_cos_xctx"] = g[cross].mean()
    return out


def _image_inputs(folder, samples):
    from transformers import AutoImageProcessor

    from isotui.data.media import load_image

    proc = AutoImageProcessor.from_pretrained(folder)
    return [proc(images=[load_image(s)], return_tensors="pt")["pixel_values"] for s in samples]


def _hf_hidden(folder, inputs_list, **extra):
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder).eval()
    outs = []
    with torch.no_grad():
        for inputs in inputs_list:
            outs.append(model(**inputs, **extra, output_hidden_states=True, return_dict=True))
    return model, outs


def _text_data(tmp_path, n):
    """The first ``n`` built-in sentences, and a text: source holding them."""
    texts = corpus(n)
    path = tmp_path / "t.txt"
    path.write_text("\n".join(texts))
    return texts, f"text:{path}"


def _samples(data, n):
    from isotui.data.sources import load_samples, parse_data

    return load_samples(parse_data(data), n)


# -- images -----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,prefix", [("vit", 1), ("deit", 2), ("beit", 1)])
def test_vision_transformers_drop_prefix_tokens(media_models, arch, prefix, image_dir):
    folder = str(media_models[arch])
    for data in ("synthetic:images", f"images:{image_dir}"):
        spec = make_spec(folder, data, max_samples=5, batch_size=2)
        result = measure(spec, None)
        samples = _samples(data, 5)
        _, outs = _hf_hidden(folder, [{"pixel_values": p} for p in _image_inputs(folder, samples)])
        n_layers = len(outs[0].hidden_states)
        layers = [
            np.concatenate([o.hidden_states[k][0, prefix:].numpy() for o in outs]) for k in range(n_layers)
        ]
        labels = np.repeat(np.arange(len(samples)), outs[0].hidden_states[0].shape[1] - prefix)
        _check(result.rows, layers, labels)
        assert result.meta["modality"] == "image" and result.meta["map_units"] is None
    incl = measure(make_spec(folder, "synthetic:images", max_samples=3, special_tokens="include"), None)
    assert incl.rows[0].n_vectors == 3 * (16 + prefix)  # 4x4 patches + prefix tokens


@pytest.mark.parametrize(
    "arch", ["resnet", "convnext", pytest.param("efficientnet", marks=pytest.mark.slow), "cvt"]
)
def test_cnn_maps_flattened_per_image_and_per_position(media_models, arch):
    folder = str(media_models[arch])
    samples = _samples("synthetic:images", 6)
    _, outs = _hf_hidden(folder, [{"pixel_values": p} for p in _image_inputs(folder, samples)])
    maps = [[o.hidden_states[k][0].numpy() for o in outs] for k in range(len(outs[0].hidden_states))]
    flat = measure(make_spec(folder, "synthetic:images", max_samples=6, batch_size=4), None)
    assert flat.meta["map_units"] == "image"
    _check(flat.rows, [np.stack([m.reshape(-1) for m in layer]) for layer in maps], np.arange(6))
    pos = measure(make_spec(folder, "synthetic:images", max_samples=6, map_units="position"), None)
    assert pos.meta["map_units"] == "position"
    for k, layer in enumerate(maps):  # each spatial position's channel vector is a unit
        x = np.concatenate([m.reshape(m.shape[0], -1).T for m in layer])
        _check([pos.rows[k]], [x], np.repeat(np.arange(6), layer[0].shape[1] * layer[0].shape[2]))
    assert flat.key != pos.key  # different units, different cache entries


def test_segformer_stages_are_token_grids(media_models):
    folder = str(media_models["segformer"])
    result = measure(make_spec(folder, "synthetic:images", max_samples=4), None)
    assert result.meta["map_units"] == "position"
    samples = _samples("synthetic:images", 4)
    _, outs = _hf_hidden(folder, [{"pixel_values": p} for p in _image_inputs(folder, samples)])
    layers, labels = [], None
    for k in range(len(outs[0].hidden_states)):
        per = [o.hidden_states[k][0].reshape(o.hidden_states[k].shape[1], -1).T.numpy() for o in outs]
        layers.append(np.concatenate(per))
        if k == 0:
            labels = np.repeat(np.arange(4), len(per[0]))
    _check(result.rows[:1], layers[:1], labels)
    assert [r.dim for r in result.rows] == [8, 16]


def test_timm_model_without_pretrained_weights(tmp_path):
    import timm
    import torch

    from isotui.data.media import load_image

    result = measure(make_spec("random:timm:resnet18", "synthetic:images", max_samples=4, batch_size=3), None)
    assert len(result.rows) == 5 and result.meta["map_units"] == "image"
    assert "untrained: random initialisation with seed 0" in result.meta["notes"]
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False).eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    with torch.no_grad():
        feats = [
            model.forward_intermediates(transform(load_image(s))[None], intermediates_only=True)
            for s in _samples("synthetic:images", 4)
        ]
    layers = [np.stack([f[k][0].reshape(-1).numpy() for f in feats]) for k in range(5)]
    _check(result.rows, layers, np.arange(4))


def test_timm_vit_keeps_its_embeddings_and_prefix_tokens():
    """timm ViTs: layer 0 is the embedding output (as in transformers), the CLS token is special."""
    import timm
    import torch

    from isotui.data.media import load_image

    name = "random:timm:vit_tiny_patch16_224:depth=2"
    result = measure(make_spec(name, "synthetic:images", max_samples=3), None)
    incl = measure(make_spec(name, "synthetic:images", max_samples=3, special_tokens="include"), None)
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2).eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    per_image = []
    with torch.no_grad():
        for s in _samples("synthetic:images", 3):
            x = transform(load_image(s))[None]
            embedded = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
            blocks = model.forward_intermediates(
                x, intermediates_only=True, output_fmt="NLC", return_prefix_tokens=True
            )
            per_image.append([embedded] + [torch.cat([prefix, tokens], 1) for tokens, prefix in blocks])
    layers = [np.concatenate([img[k][0, 1:].numpy() for img in per_image]) for k in range(3)]
    _check(result.rows, layers, np.repeat(np.arange(3), 196))
    layers = [np.concatenate([img[k][0].numpy() for img in per_image]) for k in range(3)]
    _check(incl.rows, layers, np.repeat(np.arange(3), 197))


def test_timm_stage_hooks_when_there_is_no_forward_intermediates(monkeypatch):
    """An architecture without forward_intermediates is read through features_only stages."""
    import timm
    import torch
    from timm.models.resnet import ResNet

    from isotui.data.media import load_image

    monkeypatch.delattr(ResNet, "forward_intermediates")  # as if the architecture had none
    result = measure(make_spec("random:timm:resnet18", "synthetic:images", max_samples=3), None)
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, features_only=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    with torch.no_grad():
        feats = [model(transform(load_image(s))[None]) for s in _samples("synthetic:images", 3)]
    layers = [np.stack([f[k][0].reshape(-1).numpy() for f in feats]) for k in range(len(feats[0]))]
    _check(result.rows, layers, np.arange(3))


def test_image_data_errors_are_one_sentence(tmp_path, media_models, image_dir):
    from isotui.errors import IsotuiError

    with pytest.raises(IsotuiError, match=r"data folder .* does not exist"):
        measure(make_spec(str(media_models["vit"]), f"images:{tmp_path / 'nope'}"), None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(IsotuiError, match="has no jpg/jpeg/png files"):
        measure(make_spec(str(media_models["vit"]), f"images:{tmp_path / 'empty'}"), None)
    with pytest.raises(
        IsotuiError, match="the model takes images but the data is text; use --data images:DIR"
    ):
        measure(make_spec(str(media_models["vit"]), "builtin", max_samples=2), None)
    with pytest.raises(IsotuiError, match="the model takes text but the data is images"):
        measure(make_spec("minilm", "synthetic:images", max_samples=2), None)
    with pytest.raises(IsotuiError, match="timm has no architecture 'nosuchnet'"):
        measure(make_spec("random:timm:nosuchnet", "synthetic:images", max_samples=2), None)


# -- audio ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["wav2vec2", "hubert"])
def test_waveform_models_keep_real_frames_only(media_models, arch, audio_dir):
    import torch
    from transformers import AutoFeatureExtractor

    from isotui.data.media import load_audio

    folder = str(media_models[arch])
    for data in ("synthetic:audio", f"audio:{audio_dir}"):
        result = measure(make_spec(folder, data, max_samples=4, batch_size=4, reservoir=20000), None)
        samples = _samples(data, 4)
        fe = AutoFeatureExtractor.from_pretrained(folder)
        inputs = [fe(load_audio(s, 16000), sampling_rate=16000, return_tensors="pt") for s in samples]
        model, outs = _hf_hidden(folder, [{"input_values": i["input_values"]} for i in inputs])
        frames = [
            int(model._get_feat_extract_output_lengths(torch.tensor(i["input_values"].shape[1])))
            for i in inputs
        ]
        assert [o.hidden_states[0].shape[1] for o in outs] == frames
        layers = [np.concatenate([o.hidden_states[k][0].numpy() for o in outs]) for k in range(3)]
        _check(result.rows, layers, np.repeat(np.arange(4), frames))
        assert result.meta["modality"] == "audio"


def test_whisper_encoder_and_decoder(media_models):
    import torch
    from transformers import WhisperFeatureExtractor

    from isotui.data.media import load_audio

    folder = str(media_models["whisper"])
    result = measure(make_spec(folder, "synthetic:audio", max_samples=3, batch_size=2), None)
    assert {r.component for r in result.rows} == {"encoder", "decoder"}
    assert set(result.drift) == {"encoder", "decoder", "encoder+decoder"}
    samples = _samples("synthetic:audio", 3)
    fe = WhisperFeatureExtractor.from_pretrained(folder)
    waves = [load_audio(s, 16000) for s in samples]
    inputs = [
        {
            "input_features": fe(w, sampling_rate=16000, return_tensors="pt")["input_features"],
            "decoder_input_ids": torch.tensor([[1]]),
        }
        for w in waves
    ]
    _, outs = _hf_hidden(folder, inputs)
    frames = [math.ceil(len(w) / 320) for w in waves]  # 1500 encoder frames per 30 s
    enc = [
        np.concatenate([o.encoder_hidden_states[k][0, :f].numpy() for o, f in zip(outs, frames, strict=True)])
        for k in range(3)
    ]
    _check([r for r in result.rows if r.component == "encoder"], enc, np.repeat(np.arange(3), frames))
    dec = [np.concatenate([o.decoder_hidden_states[k][0].numpy() for o in outs]) for k in range(3)]
    # the last rows already passed through Whisper's own final LayerNorms (checked on the model)
    assert all(torch.equal(o.encoder_hidden_states[-1], o.encoder_last_hidden_state) for o in outs)
    assert [r.final_norm for r in result.rows] == [False, False, True, False, False, True]
    # one start position per clip: layer 0 holds the same vector 3 times, so no spectrum to compare
    _check([r for r in result.rows if r.component == "decoder"], dec, np.arange(3), spectrum=False)


# -- character-level and encoder-decoder text --------------------------------------------------


def test_byt5_encoder_and_shifted_decoder(media_models, tmp_path):
    import torch
    from transformers import AutoTokenizer

    folder = str(media_models["byt5"])
    texts, data = _text_data(tmp_path, 5)
    result = measure(make_spec(folder, data, max_length=40, batch_size=2), None)
    tok = AutoTokenizer.from_pretrained(folder)
    inputs, keeps_enc, keeps_dec = [], [], []
    for text in texts:
        enc = tok(text, truncation=True, max_length=40, return_special_tokens_mask=True, return_tensors="pt")
        ids, special = enc["input_ids"], enc["special_tokens_mask"][0].bool()
        dec = torch.cat([torch.zeros((1, 1), dtype=ids.dtype), ids[:, :-1]], dim=1)
        inputs.append({"input_ids": ids, "decoder_input_ids": dec})
        keeps_enc.append(~special)
        keeps_dec.append(~torch.cat([torch.tensor([True]), special[:-1]]))
    _, outs = _hf_hidden(folder, inputs)
    for component, keeps, attr in (
        ("encoder", keeps_enc, "encoder_hidden_states"),
        ("decoder", keeps_dec, "decoder_hidden_states"),
    ):
        layers = [
            np.concatenate([getattr(o, attr)[k][0][m].numpy() for o, m in zip(outs, keeps, strict=True)])
            for k in range(3)
        ]
        labels = np.repeat(np.arange(5), [int(m.sum()) for m in keeps])
        _check([r for r in result.rows if r.component == component], layers, labels)
    assert [r.component for r in result.rows] == ["encoder"] * 3 + ["decoder"] * 3


def test_canine_character_layers(media_models, tmp_path):
    from transformers import AutoTokenizer

    folder = str(media_models["canine"])
    texts, data = _text_data(tmp_path, 4)
    result = measure(make_spec(folder, data, max_length=64, batch_size=3), None)
    tok = AutoTokenizer.from_pretrained(folder)
    encs = [
        tok(t, truncation=True, max_length=64, return_special_tokens_mask=True, return_tensors="pt")
        for t in texts
    ]
    _, outs = _hf_hidden(folder, [{"input_ids": e["input_ids"]} for e in encs])
    keeps = [~e["special_tokens_mask"][0].bool() for e in encs]
    n_layers = len(outs[0].hidden_states)
    char_level = [
        k for k in range(n_layers) if outs[0].hidden_states[k].shape[1] == encs[0]["input_ids"].shape[1]
    ]
    assert len(char_level) >= 3 and len(result.rows) == n_layers
    labels = np.repeat(np.arange(4), [int(m.sum()) for m in keeps])
    for k in char_level:  # character positions: checked exactly
        x = np.concatenate([o.hidden_states[k][0][m].numpy() for o, m in zip(outs, keeps, strict=True)])
        _check([result.rows[k]], [x], labels)
    for k in set(range(n_layers)) - set(char_level):  # downsampled: every molecule but the CLS one
        x = np.concatenate([o.hidden_states[k][0][1:].numpy() for o in outs])
        _check(
            [result.rows[k]], [x], np.repeat(np.arange(4), [o.hidden_states[k].shape[1] - 1 for o in outs])
        )


# -- presets ----------------------------------------------------------------------------------

PAPER_MODELS = {  # Godey et al. 2024, the model ids of their figures; Machina & Mercer's Pythia sizes
    "machina2024_pythia_sizes": [
        f"EleutherAI/pythia-{size}-deduped"
        for size in ("70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b", "12b")
    ],
    "godey2024_fig1_text": ["bert-base-uncased", "roberta-base", "gpt2", "t5-base"],
    "godey2024_fig2_characters": ["google/canine-s", "google/canine-c", "google/byt5-small"],
    "godey2024_fig3_speech": ["facebook/wav2vec2-base", "facebook/hubert-base-ls960", "openai/whisper-base"],
    "godey2024_fig3_vision": [
        "google/vit-base-patch16-224",
        "microsoft/beit-base-patch16-224",
        "facebook/deit-base-patch16-224",
        "nvidia/mit-b0",
    ],
    "godey2024_fig4_cnn": [
        "microsoft/resnet-50",
        "facebook/convnext-base-224",
        "google/efficientnet-b0",
        "microsoft/cvt-13",
    ],
}


def test_paper_presets_parse_and_name_the_papers_models():
    from isotui.models.naming import parse_model
    from isotui.presets import presets

    found = {p.path.stem: p for p in presets()}
    for name, models in PAPER_MODELS.items():
        preset = found[name]
        assert list(preset.models) == models and not preset.description.startswith("(broken")
        assert all(parse_model(m).kind == "hub" for m in models)
        make_spec(models[0], preset.data)  # the data source parses


@pytest.mark.slow
def test_a_preset_without_its_data_says_what_to_get(tmp_path):
    import subprocess
    import sys

    env = {**__import__("os").environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")  # an empty cache: the dataset is missing
    for preset, what in (
        ("godey2024_fig3_vision", "hf:ILSVRC/imagenet-1k:validation:image"),
        ("godey2024_fig3_speech", "hf:mozilla-foundation/common_voice_11_0:en:validation:audio"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "isotui", "run", preset, "-m", "random:vit"],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert proc.returncode == 2 and what in proc.stderr, proc.stderr
        assert "could not be loaded" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_same_files_elsewhere_hit_the_cache_under_their_new_name(tmp_path, media_models, image_dir):
    import shutil

    from isotui.store.cache import ResultCache

    cache = ResultCache(tmp_path / "cache")
    folder = str(media_models["vit"])
    first = measure(make_spec(folder, f"images:{image_dir}", max_samples=3, map_units="position"), cache)
    assert first.meta["max_length"] is None  # no token length for images
    assert "--map-units position has no effect" in " ".join(first.meta["notes"])  # a ViT has no maps
    copy = tmp_path / "copy"
    shutil.copytree(image_dir, copy)
    again = measure(make_spec(folder, f"images:{copy}", max_samples=3, map_units="position"), cache)
    assert again.from_cache and again.meta["data"] == f"images:{copy}"
    (copy / "img0.jpg").write_bytes((image_dir / "img2.jpg").read_bytes())  # an edited file
    changed = measure(make_spec(folder, f"images:{copy}", max_samples=3, map_units="position"), cache)
    assert not changed.from_cache


@pytest.mark.slow
def test_random_overrides_go_through_the_config_constructor():
    from isotui.models.naming import parse_model

    ref = parse_model("random:resnet:embedding_size=8,hidden_sizes=[8,16],depths=[1,1]")
    assert dict(ref.overrides) == {"embedding_size": "8", "hidden_sizes": "[8,16]", "depths": "[1,1]"}
    result = measure(
        make_spec(
            "random:" + ref.source + ":embedding_size=8,hidden_sizes=[8,16],depths=[1,1]",
            "synthetic:images",
            max_samples=2,
        ),
        None,
    )
    assert [r.dim for r in result.rows] == [8 * 56 * 56, 8 * 56 * 56, 16 * 28 * 28]
    t5 = measure(
        make_spec("random:t5:d_model=32,d_ff=64,num_layers=2,num_heads=2,d_kv=16", "builtin", max_samples=3),
        None,
    )
    assert [r.component for r in t5.rows] == ["encoder"] * 3 + ["decoder"] * 3  # num_decoder_layers follows


def test_t5_encoder_decoder_correlation_counts_the_shared_embedding_once(tmp_path):
    """With special tokens left out, T5's decoder layer 0 is the shared embedding of the same
    tokens as the encoder's layer 0: the concatenated correlation takes that point once."""
    import torch
    from scipy import stats
    from transformers import T5Config, T5Model

    t5 = "random:t5:d_model=32,d_ff=64,num_layers=2,num_heads=2,d_kv=16"
    data = tmp_path / "t.txt"
    data.write_text(
        "a small test sentence\nanother one, a little longer than that\nthird\n", encoding="utf-8"
    )
    result = measure(make_spec(t5, f"text:{data}", special_tokens="exclude"), None)
    enc0, dec0 = (
        next(r for r in result.rows if r.component == c and r.layer == 0) for c in ("encoder", "decoder")
    )
    # independently: one shared embedding table, so the same token ids give the same vectors
    ids = torch.tensor([[5, 9, 17]])
    model = T5Model(T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=64)).eval()
    out = model(input_ids=ids, decoder_input_ids=ids, output_hidden_states=True)
    assert torch.equal(out.encoder_hidden_states[0], out.decoder_hidden_states[0])
    assert (enc0.n_vectors, enc0.avg_cos, enc0.drift_norm) == (dec0.n_vectors, dec0.avg_cos, dec0.drift_norm)
    both = result.drift["encoder+decoder"]
    points = [r for r in result.rows if r is not dec0]
    assert both.n_layers == len(result.rows) - 1 == len(points)
    want = stats.spearmanr([r.drift_norm for r in points], [r.avg_cos for r in points]).statistic
    assert both.spearman_rho == pytest.approx(want, abs=1e-12)
    assert any("decoder layer 0 left out" in n for n in result.meta["notes"])
    # with special tokens included the decoder starts with its own start token: every point stays
    included = measure(make_spec(t5, f"text:{data}", special_tokens="include"), None)
    assert included.drift["encoder+decoder"].n_layers == len(included.rows)
