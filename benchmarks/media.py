"""Images/s and audio-seconds/s: isotui's full metric set against a bare forward loop.

One vision model and one speech model (untrained, seeded, so it runs offline: the cost of a
forward pass does not depend on the weights), fed synthetic inputs. Both sides decode and
preprocess the same samples into the same batches (isotui's feeder), then the bare side only
runs ``model(..., output_hidden_states=True)``; runs alternate so they share any drift.

    python benchmarks/media.py [--images 64] [--clips 24] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

VISION = "random:vit:hidden_size=384,num_hidden_layers=12,num_attention_heads=6,intermediate_size=1536"
SPEECH = "random:wav2vec2"


def _pairs(model_name: str, data: str, n: int, repeats: int, device: str):
    import torch

    from isotui.data.sources import load_samples, parse_data
    from isotui.extract.loop import BatchLoop
    from isotui.extract.runner import ExtractOptions, extract
    from isotui.models.loading import load_model
    from isotui.models.naming import parse_model

    spec = parse_data(data)
    samples = load_samples(spec, n)
    loaded = load_model(
        parse_model(model_name), device=device, dtype="float32", seed=0, trust_remote_code=False
    )
    opts = ExtractOptions()

    def bare() -> float:
        loop = BatchLoop(loaded, device, opts)
        loop.prepare(samples, spec.modality, 0)
        start = time.perf_counter()
        with torch.inference_mode():
            for idx in loop.batches():
                loaded.model(**loop.batch(idx).inputs, output_hidden_states=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def ours() -> float:
        start = time.perf_counter()
        extract(loaded, samples, device=device, opts=opts, modality=spec.modality)
        return time.perf_counter() - start

    bare()  # warm-up
    pairs = [(bare(), ours()) for _ in range(repeats)]
    return samples, pairs


def _report(what: str, amount: float, unit: str, pairs) -> None:
    ratios = sorted(o / b for b, o in pairs)
    b, o = min(p[0] for p in pairs), min(p[1] for p in pairs)
    print(f"{what}: bare {amount / b:.1f} {unit}/s, isotui {amount / o:.1f} {unit}/s")
    print(
        f"  ratio ours/bare time: median {ratios[len(ratios) // 2]:.3f} "
        f"(range {ratios[0]:.3f}-{ratios[-1]:.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--clips", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    import torch

    from isotui.data.media import SYNTHETIC_AUDIO_RATE, synthetic_audio

    print(f"device={args.device} threads={torch.get_num_threads()} repeats={args.repeats}")
    samples, pairs = _pairs(VISION, "synthetic:images", args.images, args.repeats, args.device)
    _report(f"ViT-S/16 (untrained), {len(samples)} synthetic images", len(samples), "images", pairs)
    samples, pairs = _pairs(SPEECH, "synthetic:audio", args.clips, args.repeats, args.device)
    seconds = sum(len(synthetic_audio(int(s.rpartition("#")[2]))) for s in samples) / SYNTHETIC_AUDIO_RATE
    _report(f"wav2vec 2.0 base (untrained), {seconds:.0f} s of synthetic audio", seconds, "audio-s", pairs)


if __name__ == "__main__":
    main()
