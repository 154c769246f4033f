"""Cost of isotui's attention probe (queries, keys, score histograms, softmax statistics for every
layer and head) beside a bare forward pass and beside the plain way: an eager forward with
``output_attentions=True`` whose attention maps are then reduced in torch, batch by batch.

All three get identical, pre-built, length-sorted batches; runs alternate to share any drift.

    python benchmarks/attention.py [--samples 500] [--max-length 128] [--repeats 3] [--model minilm]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import AutoModel

    from isotui.core.attention import row_stats
    from isotui.data.sources import load_samples, parse_data
    from isotui.extract.attention import extract_attention
    from isotui.extract.loop import BatchLoop
    from isotui.extract.planning import ExtractOptions
    from isotui.models.loading import load_model
    from isotui.models.naming import parse_model

    samples = load_samples(parse_data("builtin"), args.samples)
    loaded = load_model(
        parse_model(args.model), device="cpu", dtype="float32", seed=0, trust_remote_code=False
    )
    opts = ExtractOptions(max_length=args.max_length)
    loop = BatchLoop(loaded, "cpu", opts)
    loop.prepare(samples, "text", args.max_length)
    batches = [loop.batch(idx).inputs for idx in loop.batches()]
    eager = AutoModel.from_pretrained(loaded.model.name_or_path, attn_implementation="eager").eval()

    def bare() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                loaded.model(**batch)
        return time.perf_counter() - start

    def plain() -> float:
        """Eager attention maps out of the model, reduced per batch (no queries or keys)."""
        start = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                out = eager(**batch, output_attentions=True)
                allowed = batch["attention_mask"].bool()[:, None, None, :]
                for probs in out.attentions:
                    row_stats(probs, allowed)
        return time.perf_counter() - start

    def ours() -> float:
        start = time.perf_counter()
        extract_attention(
            loaded,
            samples,
            device="cpu",
            opts=opts,
            on_progress=lambda _e: None,
            should_stop=lambda: False,
            model_name=args.model,
            modality="text",
        )
        return time.perf_counter() - start

    bare()  # warm-up
    runs = [(bare(), plain(), ours()) for _ in range(args.repeats)]
    n_tokens = int(loop.feeder.lengths.sum())
    b, p, o = (min(r[i] for r in runs) for i in range(3))
    to_bare = sorted(r[2] / r[0] for r in runs)
    to_plain = sorted(r[2] / r[1] for r in runs)
    print(
        f"model={args.model} samples={len(samples)} tokens={n_tokens} batches={len(batches)} "
        f"threads={torch.get_num_threads()} repeats={args.repeats}"
    )
    print(f"bare forward (sdpa):                         best {b:.2f} s  ({n_tokens / b:.0f} tok/s)")
    print(f"plain: eager output_attentions + row stats:  best {p:.2f} s  ({n_tokens / p:.0f} tok/s)")
    print(f"isotui attention probe (everything):         best {o:.2f} s  ({n_tokens / o:.0f} tok/s)")
    print(
        f"ratio ours/bare: median {to_bare[len(to_bare) // 2]:.3f} "
        f"(range {to_bare[0]:.3f}-{to_bare[-1]:.3f}); ours/plain: median "
        f"{to_plain[len(to_plain) // 2]:.3f} (range {to_plain[0]:.3f}-{to_plain[-1]:.3f})"
    )


if __name__ == "__main__":
    main()
