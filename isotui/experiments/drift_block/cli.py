"""``isotui experiment drift-block``'s flags and command."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from isotui.errors import IsotuiError
from isotui.experiments.drift_block.config import DEFAULT_NORMS, DriftBlockConfig, parse_norms, parse_seeds

if TYPE_CHECKING:
    pass

HELP = (
    "an untrained BERT block fed token embeddings plus a random bias of norm N, swept over N "
    "(Godey et al. 2024, Fig. 6-10): input/output anisotropy and norms and their fixed point N*, "
    "query/key alignment, score histograms, softmax sharpness. The default (BERT-base, 16 x 512 "
    "tokens, 31 norms) takes about 3 minutes per seed on 2 idle CPU cores (7-9 minutes when they "
    "are busy with other work); smaller --hidden/--seq-len/--norms are faster."
)


def add_options(p: argparse.ArgumentParser) -> None:
    """drift-block's own flags (sizes, sweep, seeds, block wiring), without the flags every
    experiment shares (--device, --seed, --cache-dir, --no-cache, --csv, --json, --quiet)."""
    p.add_argument("--hidden", default="768", help="hidden size d (default 768, BERT-base)")
    p.add_argument("--heads", default="12", help="attention heads; must divide --hidden (default 12)")
    p.add_argument("--intermediate", default="3072", help="feed-forward size (default 3072)")
    p.add_argument("--init-std", default="0.02", help="std of every weight and of E (default 0.02)")
    p.add_argument("--vocab", default="30522", help="rows of the embedding table E (default 30522)")
    p.add_argument("--batch", default="16", help="sequences (default 16)")
    p.add_argument("--seq-len", default="512", help="tokens per sequence (default 512)")
    p.add_argument(
        "--norms",
        default=DEFAULT_NORMS,
        help=f"bias norms N: START:STOP:COUNT, inclusive (default {DEFAULT_NORMS}), or a comma list; "
        "write --norms=-1,5 for a list that starts with a minus",
    )
    p.add_argument("--seeds", help="several seeds, e.g. 0,1,2 (overrides --seed); rows give mean ± std")
    p.add_argument(
        "--block",
        default="post-ln",
        help="post-ln (default): BERT's BertLayer, ending in its output LayerNorm; pre-ln: the same "
        "modules as a pre-LayerNorm block, x + Attn(LN(x)), then + FFN(LN(.))",
    )
    p.add_argument(
        "--measure",
        default="after-norm",
        help="after-norm (default): the block's output; before-norm: the post-ln block's output "
        "before its final LayerNorm (whose fixed output norm otherwise sets N*)",
    )


def _int(args: argparse.Namespace, name: str) -> int:
    text = str(getattr(args, name)).strip()
    flag = "--" + name.replace("_", "-")
    try:
        return int(text)
    except ValueError:
        raise IsotuiError(f"{flag} {text!r} must be a whole number, e.g. {flag} 64") from None


def config_from_args(args: argparse.Namespace) -> DriftBlockConfig:
    """The validated configuration the flags describe (no torch import)."""
    try:
        init_std = float(args.init_std)
    except ValueError:
        raise IsotuiError(f"--init-std {args.init_std!r} must be a positive number, e.g. 0.02") from None
    seeds = parse_seeds(args.seeds) if args.seeds is not None else parse_seeds(args.seed, "--seed")
    return DriftBlockConfig(
        hidden=_int(args, "hidden"),
        heads=_int(args, "heads"),
        intermediate=_int(args, "intermediate"),
        init_std=init_std,
        vocab=_int(args, "vocab"),
        batch=_int(args, "batch"),
        seq_len=_int(args, "seq_len"),
        norms=parse_norms(args.norms),
        seeds=seeds,
        device=args.device,
        block=str(args.block).strip(),
        measure=str(args.measure).strip(),
    )
