"""The docs' figure gallery (docs/experiments/figures.md): every `isotui figure` drawn as PNG into
docs/figures/, offline.

Models: the bundled MiniLM and small untrained ones (`random:gpt2`, `random:t5`, an
encoder-decoder), on the built-in corpus; the checkpoint series is a `train-tiny` run made
here (its last checkpoint, a trained masked LM, for gradient-energy); the drift block is of hidden
size 256.
Results go to a temporary cache unless --cache-dir is given. Only the PNGs are kept (each
figure's CSV and JSON name temporary folders).

    python scripts/figure_gallery.py [--out docs/figures] [--max-samples 100] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from isotui.cli import main

MODELS = [
    "-m",
    "minilm",
    "-m",
    "random:gpt2:n_layer=6,n_embd=128,n_head=4",
    "-m",
    "random:t5:num_layers=3,d_model=128,num_heads=4,d_ff=256,d_kv=32",
]

DYNAMICS = (11, 19, 21, 13, 23, 15)  # one of each layout (12, 14, 20, 22 repeat 11, 13, 19, 21)

DRIFT_BLOCK = ["--hidden", "256", "--heads", "4", "--intermediate", "1024", "--batch", "4"]
DRIFT_BLOCK += ["--seq-len", "128", "--seeds", "0,1,2"]


def gallery(out: Path, max_samples: int, cache_dir: Path | None, only: list[str] | None = None) -> int:
    """Draw every figure (or those named in ``only``) into ``out``; the first failing command's
    exit code, else 0."""
    out.mkdir(parents=True, exist_ok=True)
    samples = ["--max-samples", str(max_samples)]
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--cache-dir", str(cache_dir or Path(tmp) / "cache"), "--dpi", "150", "-q"]
        series = Path(tmp) / "tiny"
        training = ["train-tiny", "--out", str(series), "--steps", "200", "--save-every", "25", "-q"]
        training += ["--hidden", "64", "--layers", "4", "--heads", "4"]
        training += ["--seq-len", "32", "--batch-size", "16"]
        trained = str(series / "step_000200")  # the series' last checkpoint: a trained masked LM
        commands = {
            "godey2024-fig1": [*MODELS, *samples],
            "godey2024-fig5": [*MODELS, *samples],
            "godey2024-fig17": [],
            "godey2024-fig6": DRIFT_BLOCK,
            "godey2024-fig7": [*DRIFT_BLOCK, "--log-counts"],
            "godey2024-fig8": DRIFT_BLOCK,
            "godey2024-fig9": DRIFT_BLOCK,
            "godey2024-fig10": DRIFT_BLOCK,
            "godey2024-fig16": [*MODELS, *samples],
            "godey2024-fig18": [*MODELS, *samples],
            "machina2024-heatmap": ["-c", str(series), *samples],
            "machina2024-curves": ["-c", str(series), *samples],
            "machina2024-final-norm": ["-m", "minilm", *samples],
            "gradient-energy": ["-m", trained, *samples, "--ks", "1,2,4,8,16,32"],
        }
        for number in DYNAMICS:  # queries and keys along the same series
            commands[f"godey2024-fig{number}"] = ["-c", str(series), *samples]
        unknown = sorted(set(only or []) - set(commands))
        if unknown:
            print(f"figure_gallery: no gallery figure {', '.join(unknown)}; known: {', '.join(commands)}")
            return 2
        names = [n for n in commands if not only or n in only]
        if any(str(series) in " ".join(commands[n]) for n in names) and main(training) != 0:
            return 1
        for name in names:
            png = out / f"{name}.png"
            code = main(["figure", name, *commands[name], "--out", str(png), *common])
            if code != 0:
                return code
            png.with_suffix(".csv").unlink()
            png.with_suffix(".json").unlink()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    parser.add_argument("--max-samples", type=int, default=100)
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument("--only", action="append", metavar="NAME", help="draw only this figure (repeat)")
    args = parser.parse_args()
    sys.exit(gallery(args.out, args.max_samples, args.cache_dir, args.only))
