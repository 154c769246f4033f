"""Whole `isotui experiment ablate` over the plain script a researcher would write, as a ratio.

The plain alternative (:func:`plain`, run as its own process) is the least that answers
``--remove mean --modules SITE`` by hand, as with TransformerLens or nnsight: torch and
transformers only; tokenise once, sort by length, batches of at most 4,096 padded tokens; a first
pass summing the site's output over the kept tokens (padding and special tokens out) for its
mean; a second pass running each batch clean, with a hook subtracting the mean, and with a hook
subtracting a random vector of the same norm, summing each one's next-token loss. No per-layer
curves, no final-state change, no cache. isotui does all of that too. The two alternate so
adjacent runs share the machine's load; each row records `uptime`'s load averages before it.

    python benchmarks/ablate.py MODEL_DIR [--site transformer.h.0] [--samples 400]
                                [--max-length 64] [--threads 1] [--repeats 1]

MODEL_DIR: a causal LM folder (e.g. `isotui train-tiny --arch gpt2 --out runs/g` then
runs/g/step_000060). Prints a table and each side's loss change, which must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUDGET = 4096  # padded tokens per batch (isotui's CPU default)


def plain(corpus: str, model_dir: str, site: str, max_length: int, threads: int) -> None:
    """The hand-written ablation (see the module's doc); prints its JSON line."""
    import torch
    from bare_forward import plan
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    module = dict(model.named_modules())[site]
    lines = [line.strip() for line in Path(corpus).read_text(encoding="utf-8").splitlines() if line.strip()]
    enc = tok(lines, truncation=True, max_length=max_length, return_special_tokens_mask=True)
    batches = plan([len(x) for x in enc["input_ids"]], BUDGET)

    def padded(batch: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        feats = [
            {"input_ids": enc["input_ids"][i], "special_tokens_mask": enc["special_tokens_mask"][i]}
            for i in batch
        ]
        inputs = tok.pad(feats, return_tensors="pt")
        kept = inputs["attention_mask"].bool() & ~inputs.pop("special_tokens_mask").bool()
        return inputs, kept

    total = torch.zeros(model.config.hidden_size, dtype=torch.float64)
    count = 0
    got: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda _m, _i, o: got.append(o[0] if isinstance(o, tuple) else o))
    with torch.inference_mode():
        for batch in batches:  # first pass: the site's mean over the kept tokens (no LM head)
            inputs, kept = padded(batch)
            got.clear()
            model.base_model(**inputs)
            total += got[0][kept].double().sum(0)
            count += int(kept.sum())
        handle.remove()
        mean = (total / count).float()
        noise = torch.randn(mean.shape, generator=torch.Generator().manual_seed(0))
        shifts = {"clean": None, "mean": mean, "random": noise * (mean.norm() / noise.norm())}
        losses = dict.fromkeys(shifts, 0.0)
        tokens = 0
        for batch in batches:  # second pass: each batch clean, minus the mean, minus the random
            inputs, _ = padded(batch)
            labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
            for name, shift in shifts.items():
                hook = None
                if shift is not None:

                    def edit(_m: object, _i: object, o: object, s: torch.Tensor = shift) -> object:
                        return (o[0] - s, *o[1:]) if isinstance(o, tuple) else o - s  # type: ignore[index,operator]

                    hook = module.register_forward_hook(edit)
                logits = model(**inputs).logits[:, :-1].float()
                target = labels[:, 1:]
                losses[name] += float(
                    torch.nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]),
                        target.reshape(-1),
                        ignore_index=-100,
                        reduction="sum",
                    )
                )
                if hook is not None:
                    hook.remove()
            tokens += int((labels[:, 1:] != -100).sum())
    print(json.dumps({"delta_loss": (losses["mean"] - losses["clean"]) / tokens, "tokens": tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--site", default="transformer.h.0")
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain:
        sys.path.insert(0, str(HERE))
        plain(args.corpus, args.model_dir, args.site, args.max_length, args.threads)
        return

    from isotui.data.sources import load_samples, parse_data

    sys.path.insert(0, str(HERE))
    from process import timed, uptime  # whole processes and load averages, as process.py times them

    samples = load_samples(parse_data("builtin"), args.samples, args.max_length)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(samples) + "\n", encoding="utf-8")
        out = Path(tmp) / "ablate.json"
        mine = [sys.executable, "-m", "isotui", "experiment", "ablate", "-m", args.model_dir]
        mine += ["--remove", "mean", "--modules", args.site, "--data", f"text:{corpus}", "--no-cache", "-q"]
        mine += ["--max-length", str(args.max_length), "--threads", str(args.threads), "--json", str(out)]
        hand = [sys.executable, __file__, args.model_dir, "--plain", "--corpus", str(corpus)]
        hand += ["--site", args.site, "--max-length", str(args.max_length), "--threads", str(args.threads)]
        for _ in range(args.repeats):
            load = uptime()
            plain_s, _cpu, plain_out = timed(hand, env)
            ours_s, _cpu, _ = timed(mine, env)
            row = json.loads(out.read_text(encoding="utf-8"))["results"][0]["rows"][0]
            rows.append((load, plain_s, ours_s, json.loads(plain_out)["delta_loss"], row["delta_loss"]))
    print(f"model={args.model_dir} site={args.site} samples={len(samples)} threads={args.threads}")
    head = f"{'load before':>16} {'plain s':>8} {'isotui s':>9} {'ratio':>6}"
    print(f"{head} {'plain delta':>12} {'isotui delta':>12}")
    for load, plain_s, ours_s, plain_d, ours_d in rows:
        print(
            f"{load:>16} {plain_s:8.2f} {ours_s:9.2f} {ours_s / plain_s:5.2f}x {plain_d:12.6f} {ours_d:12.6f}"
        )


if __name__ == "__main__":
    main()
