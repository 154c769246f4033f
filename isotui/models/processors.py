"""isotui's stand-in processors for checkpoints that ship none (an untrained image or audio
model): what turns its images or waveforms into inputs, said in the run's notes."""

from __future__ import annotations

from typing import Any

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def default_processor(model: Any) -> tuple[Any, str]:
    """isotui's stand-in when a checkpoint has no processor config (e.g. random init)."""
    main = model.main_input_name
    config = model.config
    if main == "pixel_values":
        size = getattr(config, "image_size", 224)
        size = size[0] if isinstance(size, (list, tuple)) else int(size)
        from transformers import ViTImageProcessor

        proc = ViTImageProcessor(
            do_resize=True,
            size={"height": size, "width": size},
            image_mean=list(IMAGENET_MEAN),
            image_std=list(IMAGENET_STD),
        )
        return proc, f"no image processor in the checkpoint: resize to {size}x{size}, ImageNet mean/std"
    if main == "input_features":
        from transformers import WhisperFeatureExtractor

        bins = int(getattr(config, "num_mel_bins", 80))
        return WhisperFeatureExtractor(feature_size=bins), f"no feature extractor: Whisper's, {bins} mel bins"
    from transformers import Wav2Vec2FeatureExtractor

    extractor = Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True, return_attention_mask=False
    )
    return extractor, "no feature extractor: wav2vec 2.0's (16 kHz, normalised waveform)"
