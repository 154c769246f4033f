"""Decoding media samples: image files, audio files, and deterministic synthetic items.

Images are decoded with Pillow to RGB; audio with soundfile (wav, flac, mp3, ogg), mixed to mono and
resampled to the model's rate with a polyphase filter (``scipy.signal.resample_poly``). Synthetic
items are generated from their index alone (numpy's PCG64 with a fixed seed per item), so the
same name always gives the same pixels or samples on every machine; bump ``SYNTHETIC_VERSION``
when the generators change, which changes the cache key.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import numpy.typing as npt

from isotui.errors import IsotuiError

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

SYNTHETIC_VERSION = 1
SYNTHETIC_IMAGE_SIZE = 224
SYNTHETIC_AUDIO_RATE = 16000


def _index(sample: str) -> int:
    return int(sample.rpartition("#")[2])


def load_image(sample: str) -> PILImage:
    """A PIL RGB image for a file path or a ``synthetic:images#i`` name."""
    from PIL import Image

    if sample.startswith("synthetic:images#"):
        return Image.fromarray(synthetic_image(_index(sample)))
    return read_image(sample, f"image file {sample}")


def read_image(source: str | BinaryIO, what: str) -> PILImage:
    """Decode an image file (a path, or a file object such as a dataset's encoded bytes) to RGB;
    ``what`` names it in the one-sentence error (``image file PATH``, ``image hf:...#ROW``)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(source) as img:
            return img.convert("RGB")
    except Image.DecompressionBombError:
        limit = Image.MAX_IMAGE_PIXELS  # None turns the check off, so it is set here
        raise IsotuiError(
            f"{what} claims more than {2 * (limit or 0):,} pixels, which is "
            "either damaged or a decompression bomb; remove it or shrink it"
        ) from None
    except (OSError, UnidentifiedImageError) as exc:
        raise IsotuiError(f"{what} cannot be read as an image ({exc}); remove or fix it") from None


def synthetic_image(index: int, size: int = SYNTHETIC_IMAGE_SIZE) -> np.ndarray:
    """A size x size x 3 uint8 image: a colour gradient, a sine grating, a few shapes, noise."""
    rng = np.random.default_rng([SYNTHETIC_VERSION, 1, index])
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) / size
    img = np.zeros((size, size, 3))
    for c in range(3):  # a gradient in a random direction per channel
        a, b = rng.normal(size=2)
        img[..., c] = 0.5 + 0.5 * np.tanh(a * (xx - 0.5) + b * (yy - 0.5))
    freq, angle = rng.uniform(2, 20), rng.uniform(0, math.pi)
    grating = np.sin(2 * math.pi * freq * (xx * math.cos(angle) + yy * math.sin(angle)))
    img += 0.25 * grating[..., None] * rng.uniform(0, 1, size=3)
    for _ in range(int(rng.integers(1, 5))):  # discs and boxes of a flat colour
        cx, cy, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
        colour = rng.uniform(0, 1, size=3)
        if rng.random() < 0.5:
            mask = (xx - cx) ** 2 + (yy - cy) ** 2 < r**2
        else:
            mask = (abs(xx - cx) < r) & (abs(yy - cy) < r / 2)
        img[mask] = colour
    img += rng.normal(0, rng.uniform(0.0, 0.15), size=img.shape)
    return (np.clip(img, 0, 1) * 255).astype(np.uint8)


def load_audio(sample: str, rate: int) -> np.ndarray:
    """Mono float32 samples at ``rate`` Hz for a file path or a ``synthetic:audio#i`` name."""
    if sample.startswith("synthetic:audio#"):
        return resample(synthetic_audio(_index(sample)), SYNTHETIC_AUDIO_RATE, rate)
    return read_audio(sample, f"audio file {sample}", rate)


def read_audio(source: str | BinaryIO, what: str, rate: int) -> np.ndarray:
    """Decode an audio file (a path or a file object) with soundfile, mix its channels to mono
    (their mean) and resample it to ``rate`` Hz; ``what`` names it in the error."""
    import soundfile

    try:
        data, source_rate = soundfile.read(source, dtype="float32", always_2d=True)
    except (RuntimeError, OSError) as exc:  # soundfile raises LibsndfileError (a RuntimeError)
        raise IsotuiError(f"{what} cannot be read ({exc}); remove or fix it") from None
    wave = data.mean(axis=1)
    if len(wave) == 0:
        raise IsotuiError(f"{what} is empty; remove it")
    return resample(wave, source_rate, rate)


def audio_frames(source: str | BinaryIO, what: str, rate: int) -> int:
    """The samples an audio file gives at ``rate`` Hz, from its header (nothing decoded)."""
    import soundfile

    try:
        info = soundfile.info(source)
    except (RuntimeError, OSError) as exc:
        raise IsotuiError(f"{what} cannot be read ({exc}); remove or fix it") from None
    return max(1, math.ceil(info.frames * rate / info.samplerate))


def resample(wave: np.ndarray, source_rate: int, rate: int) -> npt.NDArray[np.float32]:
    if source_rate == rate:
        return wave.astype(np.float32)
    from scipy.signal import resample_poly

    g = math.gcd(int(source_rate), int(rate))
    out: npt.NDArray[np.float32] = resample_poly(wave, rate // g, source_rate // g).astype(np.float32)
    return out


def synthetic_audio(index: int, rate: int = SYNTHETIC_AUDIO_RATE) -> np.ndarray:
    """1-4 s of a tone mixture, a chirp, or noise (white or pink), with a fade in and out."""
    rng = np.random.default_rng([SYNTHETIC_VERSION, 2, index])
    seconds = float(rng.uniform(1.0, 4.0))
    t = np.arange(int(seconds * rate)) / rate
    kind = index % 3
    if kind == 0:  # harmonic tones
        f0 = rng.uniform(80, 600)
        wave = sum(rng.uniform(0.2, 1.0) / h * np.sin(2 * math.pi * f0 * h * t) for h in range(1, 6))
    elif kind == 1:  # a chirp
        from scipy.signal import chirp

        wave = chirp(
            t, f0=rng.uniform(100, 1000), t1=seconds, f1=rng.uniform(1000, 6000), method="logarithmic"
        )
    else:  # white or pink noise
        white = rng.normal(size=len(t))
        if rng.random() < 0.5:
            spectrum = np.fft.rfft(white)
            spectrum[1:] /= np.sqrt(np.arange(1, len(spectrum)))
            white = np.fft.irfft(spectrum, n=len(t))
        wave = white
    wave = np.asarray(wave, dtype=np.float64)
    fade = np.minimum(1.0, np.minimum(t, seconds - t) / 0.05)
    wave = wave * fade
    peak = float(np.abs(wave).max()) or 1.0
    return (0.5 * wave / peak).astype(np.float32)
