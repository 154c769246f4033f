"""One seed's draws (embedding table, block, ids, drift direction) and one N's measurement."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from isotui.core.attention import RangeHistogram
from isotui.experiments.drift_block.config import DriftBlockConfig

if TYPE_CHECKING:
    import torch
    from transformers.models.bert.modeling_bert import BertCrossAttention, BertLayer, BertSelfAttention


@dataclass
class BlockInputs:
    """What one seed draws: the embedding table, the block, the token ids and the bias direction."""

    embeddings: torch.Tensor  # (vocab, hidden) float32
    block: BertLayer  # eval mode; its submodules by name
    ids: torch.Tensor  # (batch, seq_len) int64
    b_u: torch.Tensor  # (hidden,) the raw N(0, I) draw; the bias at norm N is N * b_u / ||b_u||
    kind: str = "post-ln"  # how ``run`` wires the block's modules (``DriftBlockConfig.block``)
    # (embeddings, ids, embeddings[ids]): the tokens' rows, gathered once for every N
    _rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for input ``x``: BertLayer itself (post-ln), or its modules pre-LN."""
        layer = self.block
        out: torch.Tensor
        if self.kind == "post-ln":
            result = layer(x)
            out = result[0] if isinstance(result, tuple) else result  # transformers 4 returns a tuple
            return out
        context = _self_attention(layer)(layer.attention.output.LayerNorm(x))[0]
        h = x + layer.attention.output.dense(context)
        out = h + layer.output.dense(layer.intermediate(layer.output.LayerNorm(h)))
        return out

    def inputs_at(self, norm: float) -> torch.Tensor:
        """(batch, seq_len, hidden) the block's input for bias norm ``norm``."""
        rows = self._rows
        if rows is None or rows[0] is not self.embeddings or rows[1] is not self.ids:
            rows = self._rows = (self.embeddings, self.ids, self.embeddings[self.ids])
        x: torch.Tensor = rows[2] + (float(norm) / self.b_u.norm()) * self.b_u
        return x


def build_block(config: DriftBlockConfig, seed: int, *, attn_implementation: str = "sdpa") -> BlockInputs:
    """Draw everything one seed needs, on the CPU, from a generator seeded by ``seed``.

    Draw order: E, then the block's Linear weights in module order, then the ids, then b_u.
    """
    import torch
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    std = float(config.init_std)
    bert = BertConfig(
        vocab_size=config.vocab,
        hidden_size=config.hidden,
        num_attention_heads=config.heads,
        intermediate_size=config.intermediate,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=std,
        attn_implementation=attn_implementation,  # type: ignore[call-arg]  # a PretrainedConfig kwarg
    )
    with torch.no_grad():
        embeddings = torch.empty(config.vocab, config.hidden).normal_(0.0, std, generator=gen)
        block = BertLayer(bert)  # type: ignore[no-untyped-call]
        init_like_bert(block, std, gen)
        ids = torch.randint(0, config.vocab, (config.batch, config.seq_len), generator=gen)
        b_u = torch.randn(config.hidden, generator=gen)
    block.eval()
    for p in block.parameters():
        p.requires_grad_(False)
    return BlockInputs(embeddings, block, ids, b_u, config.block)


def init_like_bert(module: torch.nn.Module, std: float, gen: torch.Generator) -> None:
    """BERT's ``_init_weights`` on every submodule: Linear N(0, std^2), zero bias; LayerNorm 1, 0."""
    import torch

    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0.0, std, generator=gen)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, torch.nn.LayerNorm) or "LayerNorm" in type(m).__name__:
                weight, bias = getattr(m, "weight", None), getattr(m, "bias", None)
                if weight is not None:
                    weight.fill_(1.0)
                if bias is not None:
                    bias.zero_()


def _self_attention(block: BertLayer) -> BertSelfAttention | BertCrossAttention:
    """The BertLayer's self-attention module (its ``query`` and ``key`` Linear layers are hooked)."""
    attn = block.attention.self
    if not all(hasattr(attn, n) for n in ("query", "key")):
        raise RuntimeError("this transformers' BertLayer has no query/key Linear layers to capture")
    return attn


@dataclass
class _Step:
    values: dict[str, Any]  # DriftBlockRow's metrics, named as its fields (floats; score_outside an int)
    head: dict[str, np.ndarray]  # metric -> (H,)
    hist: RangeHistogram  # counts (H, RANGE_BINS + 2) on this N's data-ranged grid
    position: np.ndarray  # (3, T)


def _measure(built: BlockInputs, norm: float, heads: int, device: str, measure: str = "after-norm") -> _Step:
    """Run the block at one N and fold every statistic (float64 sums, one head at a time).

    ``measure="before-norm"`` takes as the output the input of the block's output LayerNorm."""
    import torch

    attn = _self_attention(built.block)
    captured: dict[str, torch.Tensor] = {}

    def grab(name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def hook(_module: torch.nn.Module, _inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            captured[name] = output

        return hook

    handles = [attn.query.register_forward_hook(grab("q")), attn.key.register_forward_hook(grab("k"))]
    if measure == "before-norm":

        def grab_norm_input(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            captured["pre_norm"] = inputs[0]

        handles.append(built.block.output.LayerNorm.register_forward_pre_hook(grab_norm_input))
    try:
        x = built.inputs_at(norm).to(device)
        out = built.run(x)
    finally:
        for h in handles:
            h.remove()
    if measure == "before-norm":
        if "pre_norm" not in captured:
            raise RuntimeError("the block's output LayerNorm was not called; cannot read its input")
        out = captured.pop("pre_norm")
    if "q" not in captured or "k" not in captured:
        raise RuntimeError("the block's query/key Linear layers were not called; cannot capture them")
    threads = torch.get_num_threads()
    if device == "cpu":  # see _statistics
        torch.set_num_threads(1)
    try:
        return _statistics(x, out, captured["q"], captured["k"], attn, heads, device)
    finally:
        torch.set_num_threads(threads)


def _statistics(
    x: torch.Tensor,
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    attn: BertSelfAttention | BertCrossAttention,
    heads: int,
    device: str,
) -> _Step:
    """Every statistic of one N from the block's input, output, queries and keys. On the CPU at
    one torch thread: its ops here are small or run in numpy, and each op split over threads
    waits a scheduler slice whenever another process holds a core (5-15x the time at load 4 to
    6). Their numbers do not change: the score products are reduced over d_k inside each thread,
    and the rest are element-wise ops, sums to many outputs or numpy's."""
    import torch

    from isotui.core.attention import ScoreSums, VectorSums, range_histogram, row_stats

    B, T, d = x.shape
    dk = d // heads
    scale = float(getattr(attn, "scaling", dk**-0.5))

    def full(v: torch.Tensor) -> tuple[float, float, float, np.ndarray]:
        s = VectorSums(1, d, torch.device(device))
        s.add(v[:, None])  # every position counts
        mean_norm, bar_norm, avg = s.summary()
        return float(avg[0]), float(mean_norm[0]), float(bar_norm[0]), s.mean()[0]

    in_cos, in_norm, in_drift, _ = full(x)
    out_cos, out_norm, out_drift, _ = full(out)
    q_cos, q_norm, q_bar, q_mean = full(q)
    k_cos, k_norm, k_bar, k_mean = full(k)
    qh = q.view(B, T, heads, dk).transpose(1, 2)  # (B, H, T, dk)
    kh = k.view(B, T, heads, dk).transpose(1, 2)
    qs, ks = VectorSums(heads, dk, torch.device(device)), VectorSums(heads, dk, torch.device(device))
    qs.add(qh)
    ks.add(kh)
    qh_norm, qh_bar, qh_cos = qs.summary()
    kh_norm, kh_bar, kh_cos = ks.summary()
    q_means, k_means = qs.mean(), ks.mean()
    with np.errstate(invalid="ignore", divide="ignore"):
        cos_heads = np.einsum("hd,hd->h", q_means, k_means) / (qh_bar * kh_bar)

    position_sums = torch.zeros((3, T), dtype=torch.float64, device=device)
    row_sums = torch.zeros((4, heads), dtype=torch.float64, device=device)
    score_sums = []
    scores = []  # every head's scores, kept for the histogram once their range is known
    for h in range(heads):  # one head of the whole batch at a time: (B, 1, T, T)
        s = torch.matmul(qh[:, h], kh[:, h].transpose(-1, -2)).mul_(scale)[:, None]
        acc = ScoreSums(1, torch.device(device), histogram=False)
        acc.add(s)  # every pair counts
        score_sums.append(acc)
        scores.append(s)
        p = torch.softmax(s, dim=-1)
        stats = row_stats(p)  # each (B, 1, T); every key counts
        del p
        for i in range(3):
            position_sums[i] += stats[i].sum((0, 1))
        for i in range(4):
            row_sums[i, h] = stats[i].sum()
    position = (position_sums / (B * heads)).cpu().numpy()
    rows = (row_sums / (B * T)).cpu().numpy()
    hist = range_histogram(scores)  # one grid for all heads: the range of this N's scores
    del scores

    n = np.array([float(a.n[0]) for a in score_sums])
    ssum = np.array([float(a.sum[0]) for a in score_sums])
    ssq = np.array([float(a.sumsq[0]) for a in score_sums])
    head_mean = ssum / n
    head_std = np.sqrt(np.maximum(ssq / n - head_mean**2, 0.0))
    pooled_mean = ssum.sum() / n.sum()
    pooled_std = math.sqrt(max(ssq.sum() / n.sum() - pooled_mean**2, 0.0))
    denom = float(np.linalg.norm(q_mean) * np.linalg.norm(k_mean))
    values: dict[str, Any] = {
        "in_avg_cos": in_cos,
        "in_mean_norm": in_norm,
        "in_drift_norm": in_drift,
        "out_avg_cos": out_cos,
        "out_mean_norm": out_norm,
        "out_drift_norm": out_drift,
        "q_avg_cos": q_cos,
        "k_avg_cos": k_cos,
        "q_mean_norm": q_norm,
        "k_mean_norm": k_norm,
        "q_bar_norm": q_bar,
        "k_bar_norm": k_bar,
        "cos_qk_bar": float(q_mean @ k_mean) / denom if denom > 0 else math.nan,
        "q_avg_cos_heads": float(np.mean(qh_cos)),
        "k_avg_cos_heads": float(np.mean(kh_cos)),
        "cos_qk_bar_heads": float(np.mean(cos_heads)),
        "score_mean": float(pooled_mean),
        "score_std": pooled_std,
        "score_min": float(min(float(a.min[0]) for a in score_sums)),
        "score_max": float(max(float(a.max[0]) for a in score_sums)),
        "score_outside": int(hist.counts[:, 0].sum() + hist.counts[:, -1].sum()),
        "softmax_max": float(rows[0].mean()),
        "softmax_median": float(rows[1].mean()),
        "softmax_min": float(rows[2].mean()),
        "softmax_max_peak": float(position[0].max()),
        "softmax_min_floor": float(position[2].min()),
        "entropy": float(rows[3].mean()),
    }
    head = {
        "q_avg_cos": qh_cos,
        "k_avg_cos": kh_cos,
        "q_mean_norm": qh_norm,
        "k_mean_norm": kh_norm,
        "q_bar_norm": qh_bar,
        "k_bar_norm": kh_bar,
        "cos_qk_bar": cos_heads,
        "score_mean": head_mean,
        "score_std": head_std,
        "softmax_max": rows[0],
        "softmax_median": rows[1],
        "softmax_min": rows[2],
        "entropy": rows[3],
    }
    return _Step(values, {k: np.asarray(v, dtype=np.float64) for k, v in head.items()}, hist, position)
