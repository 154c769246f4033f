"""``isotui experiment drift-block``'s parameters (its flags and API keywords come from them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from isotui.errors import IsotuiError
from isotui.experiments.drift_block.config import DEFAULT_NORMS, DriftBlockConfig, parse_norms, parse_seeds
from isotui.experiments.params import param

HELP = (
    "an untrained BERT block fed token embeddings plus a random bias of norm N, swept over N "
    "(Godey et al. 2024, Fig. 6-10): input/output anisotropy and norms and their fixed point N*, "
    "query/key alignment, score histograms, softmax sharpness. The default (BERT-base, 16 x 512 "
    "tokens, 31 norms) is the slowest setting (its time per seed, measured, is in "
    "docs/experiments/attention.md); smaller --hidden/--seq-len/--norms are faster."
)


def _whole(flag: str) -> Callable[[object], int]:
    def parse(value: object) -> int:
        text = str(value).strip()
        try:
            return int(text)
        except ValueError:
            raise IsotuiError(f"{flag} {text!r} must be a whole number, e.g. {flag} 64") from None

    return parse


def _init_std(value: str | float) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise IsotuiError(f"--init-std {value!r} must be a positive number, e.g. 0.02") from None


def _text(value: object) -> str:
    return str(value).strip()


@dataclass(frozen=True)
class DriftBlockParams:
    """drift-block's own parameters: sizes, sweep, seeds, block wiring, and the device and seed
    (it streams no model, so it takes no run options). Checked as given; the configuration's
    own limits are said by :class:`DriftBlockConfig`."""

    hidden: int = param(768, parse=_whole("--hidden"), help="hidden size d (default 768, BERT-base)")
    heads: int = param(12, parse=_whole("--heads"), help="attention heads; must divide --hidden (default 12)")
    intermediate: int = param(3072, parse=_whole("--intermediate"), help="feed-forward size (default 3072)")
    init_std: float = param(0.02, parse=_init_std, help="std of every weight and of E (default 0.02)")
    vocab: int = param(30522, parse=_whole("--vocab"), help="rows of the embedding table E (default 30522)")
    batch: int = param(16, parse=_whole("--batch"), help="sequences (default 16)")
    seq_len: int = param(512, parse=_whole("--seq-len"), help="tokens per sequence (default 512)")
    norms: str = param(
        DEFAULT_NORMS,
        parse=_text,
        help=f"bias norms N: START:STOP:COUNT, inclusive (default {DEFAULT_NORMS}), or a comma list; "
        "write --norms=-1,5 for a list that starts with a minus",
    )
    seeds: str | None = param(
        None, parse=_text, help="several seeds, e.g. 0,1,2 (overrides --seed); rows give mean ± std"
    )
    block: str = param(
        "post-ln",
        parse=_text,
        help="post-ln (default): BERT's BertLayer, ending in its output LayerNorm; pre-ln: the same "
        "modules as a pre-LayerNorm block, x + Attn(LN(x)), then + FFN(LN(.))",
    )
    measure: str = param(
        "after-norm",
        parse=_text,
        help="after-norm (default): the block's output; before-norm: the post-ln block's output "
        "before its final LayerNorm (whose fixed output norm otherwise sets N*)",
    )
    device: str = param("auto", parse=_text, help="auto (cuda, mps, cpu), cpu, cuda, cuda:N, mps")
    seed: str = param("0", parse=_text, help="seed (default 0)")


def config_from_params(params: DriftBlockParams) -> DriftBlockConfig:
    """The validated configuration the parameters describe (no torch import)."""
    seeds = parse_seeds(params.seeds) if params.seeds is not None else parse_seeds(params.seed, "--seed")
    return DriftBlockConfig(
        hidden=params.hidden,
        heads=params.heads,
        intermediate=params.intermediate,
        init_std=params.init_std,
        vocab=params.vocab,
        batch=params.batch,
        seq_len=params.seq_len,
        norms=parse_norms(params.norms),
        seeds=seeds,
        device=params.device,
        block=params.block,
        measure=params.measure,
    )
