"""Turning samples into a model's inputs, batch by batch, and saying which output positions count.

One feeder per modality. Each knows every sample's size (for length-sorted batching) and builds
a batch's inputs; after the forward pass, ``mask`` says for a component's layer of T positions
which are real (not padding) and which are special (CLS/SEP/BOS/EOS, image prefix tokens such
as CLS, distillation and register tokens), so the runner can keep or drop them.

How components are fed (documented in README):
- encoder-decoder text (T5, ByT5): the decoder gets the same text, shifted right by one with the
  model's start token (teacher forcing), so both stacks see every sample;
- Whisper: the encoder gets the audio (its 30 s window; frames past the audio are padding and
  dropped); the decoder gets the start token alone, its vectors conditioned on the audio;
- a layer whose length differs from the input's (CANINE's downsampled layers) keeps the first
  ceil(L * T / T_in) positions of a sample of L real positions, position 0 special if it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from isotui.data.hf import HFMedia
from isotui.data.media import SYNTHETIC_AUDIO_RATE, audio_frames, load_audio, load_image, synthetic_audio
from isotui.errors import IsotuiError
from isotui.extract.tokens import Tokens, tokenize
from isotui.models.loading import UNKNOWN_CHECK_SAMPLES, LoadedModel, check_unknown_share

if TYPE_CHECKING:
    import torch

PADDING_SENSITIVE = ("canine",)  # text models whose real positions change when a batch is padded
IMAGE_NOMINAL_UNITS = 256  # an image's weight in the token budget (a ViT-B/16 has 197 tokens)
AUDIO_FRAME_SAMPLES = 320  # one wav2vec 2.0 / Whisper encoder frame at 16 kHz (20 ms)


@dataclass
class Fed:
    """One batch: the model's keyword inputs (on the CPU) and what the masks need."""

    inputs: dict[str, Any]
    valid: Any = None  # (B, T_in) bool: real positions of the main input (text, audio frames)
    special: Any = None  # (B, T_in) bool
    extra: dict[str, Any] = field(default_factory=dict)


def resize_mask(valid: torch.Tensor, special: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``valid``/``special`` (B, T_in) for a layer of ``length`` positions (see module doc)."""
    import torch

    t_in = valid.shape[1]
    if length == t_in:
        return valid, special
    real = valid.sum(1)
    keep_n = torch.ceil(real.double() * length / t_in).long().clamp(max=length)
    new_valid = torch.arange(length)[None, :] < keep_n[:, None]
    new_special = torch.zeros_like(new_valid)
    new_special[:, 0] = special[:, 0]
    return new_valid, new_special


class TextFeeder:
    def __init__(
        self,
        loaded: LoadedModel,
        samples: Sequence[str],
        max_length: int,
        runner_accepts: Callable[[str], bool],
    ) -> None:
        self.loaded = loaded
        self.tokens: Tokens = tokenize(
            loaded.tokenizer, samples, max_length, with_types=takes_token_types(loaded, runner_accepts)
        )
        self.lengths = self.tokens.lengths
        first = int(self.tokens.offsets[min(UNKNOWN_CHECK_SAMPLES, len(self.lengths))])
        check_unknown_share(loaded, self.tokens.ids[:first], self.tokens.special[:first])
        self.pad_id = _pad_id(loaded.tokenizer)
        # CANINE's downsampled layers see padding (its molecules are built over padded characters):
        # batch only samples of the same length, so that no sample is padded.
        self.same_length_key = self.lengths if loaded.model_type in PADDING_SENSITIVE else None
        self.enc_dec = bool(getattr(getattr(loaded.model, "config", None), "is_encoder_decoder", False))

    def feed(self, idx: list[int]) -> Fed:
        import torch

        b = self.tokens.batch(idx, self.pad_id)
        mask = b["attention_mask"]
        inputs = {"input_ids": b["input_ids"], "attention_mask": mask}
        if b["token_type_ids"] is not None:
            inputs["token_type_ids"] = b["token_type_ids"]
        fed = Fed(inputs, mask.bool(), b["special"])
        if self.enc_dec:
            config = self.loaded.model.config
            start = getattr(config, "decoder_start_token_id", None)
            start = start if isinstance(start, int) else (config.pad_token_id or 0)
            ids = b["input_ids"]
            dec = torch.cat([torch.full((len(ids), 1), start, dtype=ids.dtype), ids[:, :-1]], dim=1)
            # A sample of L tokens has L decoder positions (the start token, then its first L - 1
            # tokens) however much it is padded: the decoder mask is the encoder's own, never
            # shifted, or a padded sample would gain a position fed its last token.
            dec_mask = mask
            inputs["decoder_input_ids"] = dec
            inputs["decoder_attention_mask"] = dec_mask
            first = torch.ones((len(ids), 1), dtype=torch.bool)
            dec_special = torch.cat([first, b["special"][:, :-1]], dim=1)
            fed.extra["decoder"] = (dec_mask.bool(), dec_special)
        return fed

    def mask(self, fed: Fed, component: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if component == "decoder" and "decoder" in fed.extra:
            dec_valid, dec_special = fed.extra["decoder"]
            return resize_mask(dec_valid, dec_special, length)
        return resize_mask(fed.valid, fed.special, length)


# Architectures that read segment ids without declaring a token-type vocabulary in their config.
SEGMENT_ID_TYPES = ("xlnet",)


def takes_token_types(loaded: LoadedModel, accepts: Callable[[str], bool]) -> bool:
    """Whether the model is fed ``token_type_ids``: only when its forward takes them *and* its
    config declares a token-type vocabulary (BERT's ``type_vocab_size``), or it reads segment ids
    with its own tokenizer (XLNet). GPT-2 accepts ``token_type_ids`` but embeds them with its token
    embedding: fed a foreign tokenizer's zeros, it would add one shared vector to every position."""
    if not accepts("token_type_ids"):
        return False
    config = getattr(loaded.model, "config", None)
    vocab = getattr(config, "type_vocab_size", None)
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
        return True
    return loaded.own_tokenizer and loaded.model_type in SEGMENT_ID_TYPES


class ImageFeeder:
    def __init__(self, loaded: LoadedModel, samples: Sequence[str]) -> None:
        self.loaded = loaded
        self.samples = samples
        self.lengths = np.full(len(samples), IMAGE_NOMINAL_UNITS, dtype=np.int64)
        self.patch = _patch_size(loaded.model)

    def pixel_values(self, idx: list[int]) -> torch.Tensor:
        import torch

        samples = self.samples
        if isinstance(samples, HFMedia):
            images = samples.images(idx)
        else:
            images = [load_image(samples[i]) for i in idx]
        proc = self.loaded.processor
        if self.loaded.family.startswith("timm") or self.loaded.family == "module":  # per image
            return torch.stack([proc(img) for img in images])
        out = proc(images=images, return_tensors="pt")
        return out["pixel_values"]

    def feed(self, idx: list[int]) -> Fed:
        pixels = self.pixel_values(idx)
        fed = Fed({"pixel_values": pixels})
        fed.extra["grid"] = pixels.shape[-2:]
        return fed

    def mask(self, fed: Fed, component: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position is real; the positions before the patch grid are prefix tokens."""
        import torch

        b = fed.inputs["pixel_values"].shape[0]
        valid = torch.ones((b, length), dtype=torch.bool)
        special = torch.zeros((b, length), dtype=torch.bool)
        if self.patch:
            h, w = fed.extra["grid"]
            patches = (h // self.patch) * (w // self.patch)
            prefix = length - patches
            if 0 < prefix <= 8:  # CLS, distillation, registers: a handful, never a stage's grid
                special[:, :prefix] = True
        return valid, special


class AudioFeeder:
    def __init__(self, loaded: LoadedModel, samples: Sequence[str]) -> None:
        self.loaded = loaded
        self.samples = samples
        proc = loaded.processor
        self.rate = int(getattr(proc, "sampling_rate", SYNTHETIC_AUDIO_RATE))
        self.whisper = loaded.model.main_input_name == "input_features"
        self.n_samples = (
            samples.wave_lengths(self.rate)
            if isinstance(samples, HFMedia)
            else np.array([_audio_length(s, self.rate) for s in samples], dtype=np.int64)
        )
        self.lengths = np.maximum(self.n_samples // AUDIO_FRAME_SAMPLES, 1)
        # A waveform model fed without an attention mask (wav2vec 2.0 base and its kind) would
        # attend to zero padding: batch only clips of the same length, so no clip is padded.
        self.uses_mask = not self.whisper and bool(getattr(proc, "return_attention_mask", False))
        self.same_length_key = None if self.whisper or self.uses_mask else self.n_samples
        self.seconds = float(self.n_samples.sum()) / self.rate

    def feed(self, idx: list[int]) -> Fed:
        import torch

        samples = self.samples
        if isinstance(samples, HFMedia):
            waves = samples.waves(idx, self.rate)
        else:
            waves = [load_audio(samples[i], self.rate) for i in idx]
        proc = self.loaded.processor
        kwargs: dict[str, Any] = {"sampling_rate": self.rate, "return_tensors": "pt"}
        if not self.whisper:
            kwargs.update(padding=True, return_attention_mask=True)
        out = proc(waves, **kwargs)
        key = "input_features" if self.whisper else "input_values"
        inputs: dict[str, Any] = {key: out[key]}
        model = self.loaded.model
        if self.uses_mask and "attention_mask" in out:
            inputs["attention_mask"] = out["attention_mask"]  # models trained with it (not wav2vec2-base)
        fed = Fed(inputs)
        fed.extra["n"] = torch.tensor([len(w) for w in waves])
        fed.extra["padded"] = (
            int(getattr(proc, "n_samples", 0)) if self.whisper else max(len(w) for w in waves)
        )
        if self.whisper:
            start = model.config.decoder_start_token_id
            inputs["decoder_input_ids"] = torch.full((len(idx), 1), int(start), dtype=torch.long)
        return fed

    def mask(self, fed: Fed, component: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Frames that cover real audio (decoder: its one start position)."""
        import torch

        b = len(fed.extra["n"])
        if component == "decoder":
            return torch.ones((b, length), dtype=torch.bool), torch.zeros((b, length), dtype=torch.bool)
        n = fed.extra["n"]
        model = self.loaded.model
        if not self.whisper and hasattr(model, "_get_feat_extract_output_lengths"):
            frames = model._get_feat_extract_output_lengths(n).long()
        else:
            frames = torch.ceil(n.double() * length / fed.extra["padded"]).long()
        valid = torch.arange(length)[None, :] < frames.clamp(min=1, max=length)[:, None]
        return valid, torch.zeros_like(valid)


def make_feeder(
    loaded: LoadedModel,
    samples: Sequence[str],
    modality: str,
    max_length: int,
    accepts: Callable[[str], bool],
):
    if modality != loaded.modality:
        what = {"text": "text", "image": "images", "audio": "audio"}
        hint = {
            "text": "builtin, text:PATH, jsonl:PATH or hf:...",
            "image": "images:DIR, hf:NAME:SPLIT:FIELD with an image column, or synthetic:images",
            "audio": "audio:DIR, hf:NAME:SPLIT:FIELD with an audio column, or synthetic:audio",
        }
        named = getattr(samples, "source", "")  # an hf: spec: which column was taken
        source = f" ({named})" if named else ""
        raise IsotuiError(
            f"the model takes {what[loaded.modality]} but the data{source} is {what[modality]}; "
            f"use --data {hint[loaded.modality]}"
        )
    if modality == "text":
        return TextFeeder(loaded, samples, max_length, accepts)
    if modality == "image":
        return ImageFeeder(loaded, samples)
    return AudioFeeder(loaded, samples)


def _pad_id(tok: Any) -> int:
    for candidate in (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id):
        if isinstance(candidate, int):
            return candidate
    return 0


def _patch_size(model: Any) -> int | None:
    value = getattr(getattr(model, "config", None), "patch_size", None)
    if value is None:  # timm: the patch embedding knows it
        value = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) and value > 0 else None


def _audio_length(sample: str, rate: int) -> int:
    """Samples at ``rate`` without decoding the file (soundfile reads the header)."""
    if sample.startswith("synthetic:audio#"):
        n, source = len(synthetic_audio(int(sample.rpartition("#")[2]))), SYNTHETIC_AUDIO_RATE
        return max(1, math.ceil(n * rate / source))
    return audio_frames(sample, f"audio file {sample}", rate)
