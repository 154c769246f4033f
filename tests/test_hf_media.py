"""``hf:`` image and audio datasets: built here with ``datasets`` (``Image()``/``Audio()`` features),
saved with ``save_to_disk`` and put in a real local datasets cache, measured through isotui and
checked against a plain computation (the images and clips through the processor and the model one
at a time, numpy cosines over all pairs); mono and resampling checked on known signals."""

from __future__ import annotations

import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from isotui.errors import IsotuiError
from isotui.experiments.layerwise import measure
from isotui.spec import make_spec

IMAGE = 32
RATE_IN = 44100


# -- data and models built here ---------------------------------------------------------------


def _images():
    """Five RGB images of different sizes and one greyscale: resized and converted on the way in."""
    from PIL import Image

    rng = np.random.default_rng(7)
    out = [
        Image.fromarray(rng.integers(0, 256, (20 + 9 * i, 28 + 5 * i, 3), dtype=np.uint8)) for i in range(5)
    ]
    out.append(Image.fromarray(rng.integers(0, 256, (40, 24), dtype=np.uint8), mode="L"))
    return out


def _stereo_clips():
    """Three stereo 44.1 kHz clips of different lengths: a different tone in each channel plus noise."""
    rng = np.random.default_rng(3)
    clips = []
    for i, seconds in enumerate((0.5, 0.8, 0.65)):
        t = np.arange(int(seconds * RATE_IN)) / RATE_IN
        left = 0.4 * np.sin(2 * math.pi * (220 + 110 * i) * t) + 0.05 * rng.normal(size=len(t))
        right = 0.3 * np.sin(2 * math.pi * (1000 + 300 * i) * t)
        clips.append(np.stack([left, right], axis=1).astype(np.float32))
    return clips


def _wav_bytes(clip, rate=RATE_IN):
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, clip, rate, format="WAV", subtype="FLOAT")  # float samples: read back exactly
    return buf.getvalue()


def _image_dataset():
    import datasets

    images = _images()
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.Value("int64"), "caption": datasets.Value("string")}
    )
    data = {"image": images, "label": list(range(len(images))), "caption": [f"picture {i}" for i in range(6)]}
    return datasets.Dataset.from_dict(data, features=features)


def _audio_dataset():
    """Built from stored bytes and cast to ``Audio()`` (what a parquet dataset on the hub holds;
    encoding arrays would need torchcodec)."""
    import datasets

    stored = [{"bytes": _wav_bytes(c), "path": f"clip{i}.wav"} for i, c in enumerate(_stereo_clips())]
    ds = datasets.Dataset.from_dict({"audio": stored, "sentence": ["one", "two", "three"]})
    return ds.cast_column("audio", datasets.Audio())


def _into_cache(ds, cache, repo_id, config, split, tmp):
    """Put ``ds`` where ``load_dataset(repo_id, config)`` finds it offline: the layout a download
    from the hub leaves in HF_DATASETS_CACHE (``namespace___name/config/version/hash``)."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    namespace, name = repo_id.split("/")
    parquet = tmp / f"{name}-{split}.parquet"
    ds.to_parquet(str(parquet))
    builder = Parquet(
        cache_dir=str(tmp / "scratch"),
        dataset_name=name,
        config_name=config,
        data_files={split: [str(parquet)]},
    )
    builder.download_and_prepare(
        output_dir=str(cache / f"{namespace}___{name}" / config / "0.0.0" / "0123abcd")
    )


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory):
    """Saved folders and a local datasets cache holding the same rows."""
    import datasets

    root = tmp_path_factory.mktemp("hf_data")
    images, audio = _image_dataset(), _audio_dataset()
    datasets.DatasetDict({"validation": images}).save_to_disk(str(root / "images_dict"))
    images.save_to_disk(str(root / "images_one"))  # a bare Dataset: its one split is "train"
    datasets.DatasetDict({"validation": audio}).save_to_disk(str(root / "audio_dict"))
    cache = root / "datasets-cache"
    _into_cache(images, cache, "isotui-test/tiny_images", "default", "validation", root)
    _into_cache(audio, cache, "isotui-test/tiny_voice", "en", "validation", root)
    return root


@pytest.fixture(autouse=True)
def _offline_cache(monkeypatch, hf_data):
    """Every test reads the cache built above, offline (as the CLI's subprocesses do)."""
    import datasets

    cache = str(hf_data / "datasets-cache")
    monkeypatch.setenv("HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import torch
    import transformers as T

    root = tmp_path_factory.mktemp("hf_media_models")
    torch.manual_seed(0)
    vit = T.ViTModel(
        T.ViTConfig(
            image_size=IMAGE,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
        )
    )
    vit.save_pretrained(root / "vit")
    T.ViTImageProcessor(size={"height": IMAGE, "width": IMAGE}).save_pretrained(root / "vit")
    wav = T.Wav2Vec2Model(
        T.Wav2Vec2Config(
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
    )
    wav.save_pretrained(root / "wav2vec2")
    T.Wav2Vec2FeatureExtractor(return_attention_mask=False, do_normalize=True).save_pretrained(
        root / "wav2vec2"
    )
    return {"vit": str(root / "vit"), "wav2vec2": str(root / "wav2vec2")}


def _avg_cos(x):
    """Mean cosine over all pairs of distinct vectors (numpy, every pair)."""
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    g = u @ u.T
    return float(g[~np.eye(len(x), dtype=bool)].mean())


def _hidden(folder, inputs):
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder).eval()
    with torch.no_grad():
        return [model(**i, output_hidden_states=True).hidden_states for i in inputs]


# -- images -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        "hf:{root}/images_dict:validation:image",
        "hf:isotui-test/tiny_images:validation",
        "hf:{root}/images_one:train",
    ],
)
def test_image_column_matches_the_processor_and_model_by_hand(models, hf_data, data):
    from transformers import ViTImageProcessor

    result = measure(make_spec(models["vit"], data.format(root=hf_data), batch_size=4), None)
    proc = ViTImageProcessor.from_pretrained(models["vit"])
    inputs = [proc(images=img.convert("RGB"), return_tensors="pt") for img in _images()]
    hidden = _hidden(models["vit"], [{"pixel_values": i["pixel_values"]} for i in inputs])
    assert result.meta["modality"] == "image" and len(result.rows) == 3
    for k, row in enumerate(result.rows):
        x = np.concatenate([h[k][0, 1:].numpy() for h in hidden]).astype(np.float64)  # CLS dropped
        assert row.n_vectors == len(x) == 6 * 16
        assert row.avg_cos == pytest.approx(_avg_cos(x), rel=1e-5)
        assert row.mean_norm == pytest.approx(float(np.linalg.norm(x, axis=1).mean()), rel=1e-5)


def test_slices_are_their_own_data_and_the_same_rows_are_the_same_data(models, hf_data):
    from isotui.data.sources import fingerprint, load_samples, parse_data
    from isotui.store.cache import ResultCache

    def fp(data):
        spec = parse_data(data)
        return fingerprint(load_samples(spec), spec)

    local = f"hf:{hf_data}/images_dict:validation:image"
    cached = "hf:isotui-test/tiny_images:default:validation:image"
    assert fp(local) == fp(cached)  # a content hash: where the rows are kept does not matter
    slices = [f"{local}:2", f"{local}:3", f"hf:{hf_data}/images_dict:validation[1:3]:image", local]
    assert len({fp(s) for s in slices}) == len(slices)
    assert fp(f"{local}:2") == fp(f"hf:{hf_data}/images_dict:validation[:2]")  # :N is [:N]
    cache = ResultCache(hf_data / "result-cache")
    first = measure(make_spec(models["vit"], f"{local}:3"), cache)
    assert first.meta["n_samples"] == 3 and not first.from_cache
    assert measure(make_spec(models["vit"], "hf:isotui-test/tiny_images:validation[:3]"), cache).from_cache
    assert not measure(make_spec(models["vit"], f"{local}:2"), cache).from_cache


# -- audio ------------------------------------------------------------------------------------


def test_stereo_44k_is_mixed_to_mono_and_resampled_to_the_model_rate(hf_data):
    from scipy.signal import resample_poly

    from isotui.data.sources import load_samples, parse_data

    samples = load_samples(parse_data(f"hf:{hf_data}/audio_dict:validation"))
    waves = samples.waves(range(3), 16000)
    for wave, clip in zip(waves, _stereo_clips(), strict=True):
        mono = clip.astype(np.float64).mean(axis=1)
        assert len(wave) == math.ceil(len(mono) * 16000 / RATE_IN)
        np.testing.assert_allclose(wave, resample_poly(mono, 160, 441), atol=1e-5)
    # a known signal, checked without the resampler: a 1 kHz tone at 44.1 kHz in both channels
    # (one at half amplitude) is a 0.75-amplitude 1 kHz tone at 16 kHz
    t = np.arange(RATE_IN) / RATE_IN
    tone = np.sin(2 * math.pi * 1000 * t)
    import datasets

    one = datasets.Dataset.from_dict(
        {
            "audio": [
                {"bytes": _wav_bytes(np.stack([tone, 0.5 * tone], 1).astype(np.float32)), "path": "t.wav"}
            ]
        }
    ).cast_column("audio", datasets.Audio())
    one.save_to_disk(str(hf_data / "tone"))
    (wave,) = load_samples(parse_data(f"hf:{hf_data}/tone:train")).waves([0], 16000)
    assert len(wave) == 16000
    spectrum = np.abs(np.fft.rfft(wave[2000:-2000] * np.hanning(12000)))
    assert np.fft.rfftfreq(12000, 1 / 16000)[spectrum.argmax()] == pytest.approx(1000, abs=2)
    assert np.abs(wave[2000:-2000]).max() == pytest.approx(0.75, rel=2e-3)
    assert samples.wave_lengths(16000).tolist() == [len(w) for w in waves]


@pytest.mark.parametrize(
    "data", ["hf:{root}/audio_dict:validation:audio", "hf:isotui-test/tiny_voice:en:validation"]
)
def test_audio_column_matches_the_feature_extractor_and_model_by_hand(models, hf_data, data):
    import torch
    from scipy.signal import resample_poly
    from transformers import AutoFeatureExtractor

    result = measure(make_spec(models["wav2vec2"], data.format(root=hf_data), reservoir=20000), None)
    fe = AutoFeatureExtractor.from_pretrained(models["wav2vec2"])
    waves = [resample_poly(c.astype(np.float64).mean(axis=1), 160, 441) for c in _stereo_clips()]
    inputs = [fe(w.astype(np.float32), sampling_rate=16000, return_tensors="pt") for w in waves]
    hidden = _hidden(models["wav2vec2"], [{"input_values": i["input_values"]} for i in inputs])
    assert result.meta["modality"] == "audio" and len(result.rows) == 3
    for k, row in enumerate(result.rows):
        x = np.concatenate([h[k][0].numpy() for h in hidden]).astype(np.float64)  # every frame is real
        assert row.n_vectors == len(x)
        assert row.avg_cos == pytest.approx(_avg_cos(x), rel=1e-4)
        assert row.mean_norm == pytest.approx(float(np.linalg.norm(x, axis=1).mean()), rel=1e-4)
    assert torch.is_tensor(inputs[0]["input_values"])


# -- the grammar and bad input ----------------------------------------------------------------


def test_row_counts_and_split_slices_parse():
    from isotui.data.sources import parse_data

    spec = parse_data("hf:ILSVRC/imagenet-1k:validation:image:1000")
    assert (spec.name, spec.config, spec.split, spec.field) == (
        "ILSVRC/imagenet-1k",
        None,
        "validation[:1000]",
        "image",
    )
    spec = parse_data("hf:ILSVRC/imagenet-1k:validation:50")
    assert (spec.split, spec.field) == ("validation[:50]", "")
    spec = parse_data("hf:mozilla-foundation/common_voice_11_0:en:validation:audio")
    assert (spec.config, spec.split, spec.field) == ("en", "validation", "audio")
    spec = parse_data("hf:Salesforce/wikitext:wikitext-103-raw-v1:validation[10%:20%]")
    assert (spec.config, spec.split, spec.field) == ("wikitext-103-raw-v1", "validation[10%:20%]", "")
    assert spec.describe() == "hf:Salesforce/wikitext:wikitext-103-raw-v1:validation[10%:20%]"
    for bad, says in [
        ("hf:x:validation:0", "not a positive integer"),
        ("hf:x:validation:image:-3", "not a positive integer"),
        ("hf:x:validation:1.5", "not a positive integer"),
        ("hf:x:validation[:10]:5", "slices the split twice"),
        ("hf:x:validation[:abc]", "is not SPLIT or SPLIT[START:END]"),
    ]:
        with pytest.raises(IsotuiError, match=rf"^data source '{re.escape(bad)}'.*{re.escape(says)}"):
            parse_data(bad)


def test_bad_hf_input_is_one_sentence_naming_the_spec(models, hf_data):
    from isotui.data.sources import check_source, parse_data
    from isotui.data.stream import StreamedSamples

    def fails(data, says, model=models["vit"]):
        with pytest.raises(IsotuiError, match=re.escape(says)) as info:
            check_source(parse_data(data))
            measure(make_spec(model, data, max_samples=2), None)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "hf:isotui-test/nowhere:validation" in fails(
        "hf:isotui-test/nowhere:validation", "could not be loaded"
    )
    fails("hf:isotui-test/tiny_images:test", "has no split 'test' (it has: validation)")
    fails(f"hf:{hf_data}/images_dict:test", "has no split 'test' (it has: validation)")
    fails(f"hf:{hf_data}/images_one:validation", "has no split 'validation' (it has: train)")
    fails(f"hf:{hf_data}/images_dict:validation:label", "column 'label' is int64, not text, image or audio")
    fails(f"hf:{hf_data}/images_dict:validation:nope", "has no column 'nope' (it has: image (image), label")
    fails(
        f"hf:{hf_data}/images_dict:validation:caption",
        f"the model takes images but the data (hf:{hf_data}/images_dict:validation:caption) is text",
    )
    fails(
        f"hf:{hf_data}/audio_dict:validation",
        f"the model takes images but the data (hf:{hf_data}/audio_dict:validation) is audio",
    )
    fails(f"hf:{hf_data}/images_dict:validation:image", "the model takes text but the data", model="minilm")
    import datasets

    with pytest.raises(IsotuiError, match=r"--stream reads text columns; column 'image' of .* is image"):
        list(StreamedSamples(parse_data(f"hf:{hf_data}/images_dict:validation"), None, None))
    broken = datasets.Dataset.from_dict({"image": [{"bytes": b"not an image", "path": "x.png"}]})
    broken.cast_column("image", datasets.Image()).save_to_disk(str(hf_data / "broken"))
    fails(f"hf:{hf_data}/broken:train", f"image hf:{hf_data}/broken:train#0 cannot be read as an image")


def test_the_one_text_column_is_taken_and_two_are_named(hf_data):
    import datasets

    from isotui.data.sources import load_samples, parse_data

    datasets.Dataset.from_dict({"sentence": ["a b", "", "c"], "n": [1, 2, 3]}).save_to_disk(
        str(hf_data / "t1")
    )
    assert list(load_samples(parse_data(f"hf:{hf_data}/t1:train"))) == ["a b", "c"]
    datasets.Dataset.from_dict({"a": ["x"], "b": ["y"]}).save_to_disk(str(hf_data / "t2"))
    with pytest.raises(
        IsotuiError, match=r"does not say which column to measure \(the columns: a \(text\), b \(text\)\)"
    ):
        load_samples(parse_data(f"hf:{hf_data}/t2:train"))


@pytest.mark.slow
def test_cli_offline_from_the_cache_and_exit_2_on_a_missing_split(models, hf_data, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(hf_data / "datasets-cache")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "isotui", "run", "-m", models["vit"], "--threads", "1", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=600,
        )

    ok = cli("--data", "hf:isotui-test/tiny_images:validation:image:4", "--json", "out.json", "-q")
    assert ok.returncode == 0, ok.stderr
    import json

    meta = json.loads((tmp_path / "out.json").read_text())
    assert "hf:isotui-test/tiny_images:validation[:4]:image" in json.dumps(meta)
    bad = cli("--data", "hf:isotui-test/tiny_images:train")
    assert bad.returncode == 2 and "has no split 'train' (it has: validation)" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_a_dataset_of_files_measures_as_the_folder_of_those_files(models, tmp_path):
    """The same files through hf: (saved: their bytes embedded) and as images:DIR / audio:DIR give
    the same numbers; rows that hold only a path (as a cache made from extracted archives does)
    are read from the file, and hash as the same content."""
    import datasets
    import soundfile
    from PIL import Image

    from isotui.data.hf import HFMedia
    from isotui.data.sources import load_samples, parse_data

    (tmp_path / "img").mkdir()
    (tmp_path / "wav").mkdir()
    paths = []
    for i, img in enumerate(_images()[:4]):
        paths.append(str(tmp_path / "img" / f"{i}.png"))
        img.save(paths[-1])
    ds = datasets.Dataset.from_dict({"image": paths}).cast_column("image", datasets.Image())
    ds.save_to_disk(str(tmp_path / "img_ds"))
    spec = parse_data(f"hf:{tmp_path / 'img_ds'}:train")
    by_path = HFMedia.of(spec, ds, "image", "image", None)  # in memory: the rows hold paths only
    assert by_path.encoded([0])[0]["bytes"] is None
    assert by_path.fingerprint() == load_samples(spec).fingerprint()
    for got, path in zip(by_path.images(range(4)), paths, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(Image.open(path).convert("RGB")))
    clips = []
    for i, clip in enumerate(_stereo_clips()):
        clips.append(str(tmp_path / "wav" / f"{i}.wav"))
        soundfile.write(clips[-1], clip, RATE_IN, subtype="FLOAT")
    ds = datasets.Dataset.from_dict({"audio": clips}).cast_column("audio", datasets.Audio())
    ds.save_to_disk(str(tmp_path / "wav_ds"))
    for model, folder, saved in (
        (models["vit"], f"images:{tmp_path / 'img'}", f"hf:{tmp_path / 'img_ds'}:train"),
        (models["wav2vec2"], f"audio:{tmp_path / 'wav'}", f"hf:{tmp_path / 'wav_ds'}:train"),
    ):
        a, b = measure(make_spec(model, folder), None), measure(make_spec(model, saved), None)
        assert [r.n_vectors for r in a.rows] == [r.n_vectors for r in b.rows]
        for ra, rb in zip(a.rows, b.rows, strict=True):
            assert rb.avg_cos == pytest.approx(ra.avg_cos, rel=1e-6)
            assert rb.mean_norm == pytest.approx(ra.mean_norm, rel=1e-6)
