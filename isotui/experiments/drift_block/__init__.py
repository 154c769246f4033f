"""``isotui experiment drift-block``: an untrained Transformer block fed inputs that drift along a
random direction (Godey et al. 2024, "Anisotropy is inherent to self-attention in Transformers",
section 4.2, Figures 6-10).

Setting, per seed (everything drawn from one ``torch.Generator`` seeded by the seed, in this
order): an embedding table ``E`` (``vocab`` x ``hidden``, entries N(0, init_std^2), as BERT's word
embeddings; the padding row is *not* zeroed, since no token here is padding), one
``transformers`` ``BertLayer`` built from a ``BertConfig`` of the chosen sizes with dropout 0, in
eval mode, initialised as BERT's ``_init_weights`` does (every Linear N(0, init_std^2) with zero
bias, visiting modules in order; every LayerNorm weight 1, bias 0), token ids ``B`` x ``T``
uniform over the vocabulary, and a direction ``b_u ~ N(0, I_d)``. For each N of the sweep the
block's input is ``x = E[ids] + N * b_u / ||b_u||`` (the same direction for every N; no
embedding LayerNorm, no positions, no mask: every position attends to every position).

Block (``--block``): ``post-ln`` (default) is BERT's ``BertLayer`` as transformers runs it,
``LN2(h + FFN(h))`` with ``h = LN1(x + Attn(x))``; it ends in its output LayerNorm, whose weight 1
and bias 0 give every output vector the norm ``sqrt(d * v / (v + eps))`` (``v`` the vector's
variance over its dimensions), i.e. sqrt(d) whatever the input, so N* there is where the input's
mean norm reaches sqrt(d): a property of the norm, not of attention. ``pre-ln`` runs the same
modules (same weights, same draws) as a pre-LayerNorm block, ``h = x + Attn(LN1(x))``,
``out = h + FFN(LN2(h))`` (LN1 is the attention's output LayerNorm, LN2 the block's output
LayerNorm; both weight 1, bias 0), which ends in the residual sum. Measured output
(``--measure``): ``after-norm`` (default) is the block's output; ``before-norm`` (post-ln only)
is the input of its output LayerNorm, ``h + FFN(h)``, read by a forward pre-hook.

Definitions (over the ``n = B * T`` vectors; float64 sums, as in ``isotui.core``):

- Fig. 6: ``in_*`` are the block's inputs ``x``, ``out_*`` its outputs (after the attention and
  feed-forward sublayers and their LayerNorms). ``avg_cos`` is the exact mean cosine over all
  distinct pairs, ``(||sum u_i||^2 - n) / (n (n - 1))``; ``mean_norm`` the mean of ``||x_i||``;
  ``drift_norm`` the norm of the mean vector.
- N* (fixed point): with ``D(N) = in_mean_norm(N) - out_mean_norm(N)`` over the sweep sorted by N,
  the first N where D is 0 at a sweep point, else the first pair of neighbours where D changes
  sign, linearly interpolated: ``N* = N_i + (N_{i+1} - N_i) * D_i / (D_i - D_{i+1})``. NaN, with a
  note, when D keeps one sign over the sweep. Per seed; across seeds the mean (and std) of the
  seeds that have one.
- Fig. 7: pre-softmax scores ``s = q k^T / sqrt(d_k)`` for every (query, key) pair of a sequence,
  per head, histogrammed on bins chosen from the data at each N (one grid for all heads: a first
  pass takes the scores' min and max, then bins of width 2^e at multiples of 2^e, e the smallest
  that covers them in at most 512 bins; see :class:`isotui.core.attention.RangeHistogram`), so
  small and large d both get a shape. Counts are exact (a score's bin is floor(s / 2^e)); the
  seeds' histograms of one N merge exactly onto their common coarser grid. ``score_*`` pool all
  heads; ``score_outside`` counts the non-finite scores (every finite one is in range).
- Fig. 8: queries and keys are the outputs of the attention module's own ``query``/``key``
  Linear layers (with bias), captured by forward hooks. ``q_*``/``k_*``: the full ``hidden``-sized
  vectors (all heads together); ``*_heads``: per head on its ``d_k`` slice, then averaged over the
  heads. ``cos_qk_bar``: cosine between the mean query and the mean key.
- Fig. 9: per softmax row (one query, all ``T`` keys) its max, median (numpy's: mean of the two
  middle values when ``T`` is even) and min; ``softmax_position[seed, N, stat, t]`` is that
  statistic averaged over the batch and the heads at query position ``t``. The table's
  ``softmax_max/median/min`` are their means over positions (= means over all B * H * T rows).
- Fig. 10: ``softmax_max_peak = max_t softmax_position[.., max, t]`` (the largest per-position
  mean row maximum) and ``softmax_min_floor = min_t softmax_position[.., min, t]`` (the smallest
  per-position mean row minimum).
- Several seeds: per N, the mean and the sample standard deviation (ddof=1; NaN for one seed)
  of each scalar over the seeds.

Results are cached one entry per seed (key: every setting, the sweep, the seed, the schema and
the torch/transformers versions), so a sweep asked again, or with more seeds, reuses what exists.

Modules: :mod:`.config` (settings, cache key), :mod:`.result` (rows, one seed's sweep, the
result), :mod:`.fixed_point` (N*), :mod:`.model` (the drawn block, one N's measurement),
:mod:`.sweep` (seeds and norms), :mod:`.store` (cache), :mod:`.view` (table; rich, so only the
views layer imports it), :mod:`.params` (its parameters: flags and keywords). None imports torch
at import time.
"""

from __future__ import annotations

from isotui.experiments.drift_block.config import (
    BLOCKS,
    DEFAULT_NORMS,
    FOLDER,
    MAX_NORMS,
    MEASURES,
    SCHEMA,
    DriftBlockConfig,
    _version,
    parse_norms,
    parse_seeds,
)
from isotui.experiments.drift_block.fixed_point import fixed_point
from isotui.experiments.drift_block.model import BlockInputs, build_block, init_like_bert
from isotui.experiments.drift_block.params import (
    HELP,
    DriftBlockParams,
    config_from_params,
)
from isotui.experiments.drift_block.result import (
    HEAD_METRICS,
    SOFTMAX_STATS,
    DriftBlockResult,
    DriftBlockRow,
    NormSummary,
    SeedRun,
    _nan_to_none,
)
from isotui.experiments.drift_block.store import _lookup, _store, drift_cache
from isotui.experiments.drift_block.sweep import _assemble, _run_seed, norm_note, run_drift_block

__all__ = [
    "BLOCKS",
    "DEFAULT_NORMS",
    "FOLDER",
    "HEAD_METRICS",
    "HELP",
    "MAX_NORMS",
    "MEASURES",
    "SCHEMA",
    "SOFTMAX_STATS",
    "BlockInputs",
    "DriftBlockConfig",
    "DriftBlockParams",
    "DriftBlockResult",
    "DriftBlockRow",
    "NormSummary",
    "SeedRun",
    "_assemble",
    "_lookup",
    "_nan_to_none",
    "_run_seed",
    "_store",
    "_version",
    "build_block",
    "config_from_params",
    "drift_cache",
    "fixed_point",
    "init_like_bert",
    "norm_note",
    "parse_norms",
    "parse_seeds",
    "run_drift_block",
]
