"""A careful bare forward pass: what `isotui run` costs at the least, as a whole process.

Only torch and transformers: tokenise once (no padding), sort by length, batches of at most
4,096 padded tokens, one forward each with ``output_hidden_states=True`` under inference mode,
nothing else. benchmarks/process.py times it against `isotui run` over the same text file.

    python benchmarks/bare_forward.py FILE MODEL_DIR [--max-length 128] [--threads N] [--budget 4096]

Prints one line of JSON to stdout: the stages' seconds, tokens, batches and threads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def plan(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices sorted by length, cut into batches whose padded size (count x longest) fits ``budget``."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:  # ascending: the newcomer is the batch's longest
        if current and (len(current) + 1) * lengths[i] > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def main() -> None:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("model_dir")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--budget", type=int, default=4096)
    args = parser.parse_args()

    import torch
    from transformers import AutoModel, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    imported = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModel.from_pretrained(args.model_dir).eval()
    loaded = time.perf_counter()
    with open(args.file, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    ids = tokenizer(lines, truncation=True, max_length=args.max_length)["input_ids"]
    batches = plan([len(x) for x in ids], args.budget)
    tokenised = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            inputs = tokenizer.pad({"input_ids": [ids[i] for i in batch]}, return_tensors="pt")
            model(**inputs, output_hidden_states=True)
    done = time.perf_counter()
    json.dump(
        {
            "imports_s": round(imported - started, 3),
            "load_s": round(loaded - imported, 3),
            "tokenise_s": round(tokenised - loaded, 3),
            "forward_s": round(done - tokenised, 3),
            "tokens": sum(len(x) for x in ids),
            "samples": len(ids),
            "batches": len(batches),
            "threads": torch.get_num_threads(),
        },
        sys.stdout,
    )
    print()


if __name__ == "__main__":
    main()
