"""README's figure gallery: every `isotui figure` drawn as PNG into docs/figures/, offline.

Models: the bundled MiniLM and small untrained ones (`random:gpt2`, `random:t5`, an
encoder-decoder), on the built-in corpus; the checkpoint series is a `train-tiny` run made
here; the drift block is of hidden size 256.
Results go to a temporary cache unless --cache-dir is given. Only the PNGs are kept (each
figure's CSV and JSON name temporary folders).

    python scripts/figure_gallery.py [--out docs/figures] [--max-samples 100] [NAME ...]
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


def gallery(out: Path, max_samples: int, cache_dir: Path | None, names: list[str] | None = None) -> int:
    """Draw every figure (or those ``names``) into ``out``; the first failing command's exit code, else 0."""
    out.mkdir(parents=True, exist_ok=True)
    samples = ["--max-samples", str(max_samples)]
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--cache-dir", str(cache_dir or Path(tmp) / "cache"), "--dpi", "150", "-q"]
        series = Path(tmp) / "tiny"
        training = ["train-tiny", "--out", str(series), "--steps", "200", "--save-every", "25", "-q"]
        training += ["--hidden", "64", "--layers", "4", "--heads", "4"]
        training += ["--seq-len", "32", "--batch-size", "16"]
        commands = [
            ["figure", "godey2024-fig1", *MODELS, *samples, "--out", str(out / "godey2024-fig1.png")],
            ["figure", "godey2024-fig5", *MODELS, *samples, "--out", str(out / "godey2024-fig5.png")],
            ["figure", "godey2024-fig17", "--out", str(out / "godey2024-fig17.png")],
            ["figure", "godey2024-fig6", *DRIFT_BLOCK, "--out", str(out / "godey2024-fig6.png")],
            ["figure", "godey2024-fig18", *MODELS, *samples, "--out", str(out / "godey2024-fig18.png")],
        ]
        for name in ("machina2024-heatmap", "machina2024-curves"):
            commands.append(["figure", name, "-c", str(series), *samples, "--out", str(out / f"{name}.png")])
        for number in DYNAMICS:  # queries and keys along the same series
            name = f"godey2024-fig{number}"
            commands.append(["figure", name, "-c", str(series), *samples, "--out", str(out / f"{name}.png")])
        if main(training) != 0:
            return 1
        only = set(names or ())
        for argv in commands:
            if only and argv[1] not in only:
                continue
            code = main([*argv, *common])
            if code != 0:
                return code
            png = Path(argv[argv.index("--out") + 1])
            png.with_suffix(".csv").unlink()
            png.with_suffix(".json").unlink()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    parser.add_argument("--max-samples", type=int, default=100)
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument("names", nargs="*", metavar="NAME", help="only these figures (default: all)")
    args = parser.parse_args()
    sys.exit(gallery(args.out, args.max_samples, args.cache_dir, args.names))
