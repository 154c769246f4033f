"""Plain, independent reference computations: one sample at a time, all pairs, in float64."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RefLayer:
    avg_cos: float
    avg_cos_xctx: float
    drift_norm: float
    mean_norm: float
    avg_cos_centered: float
    isoscore: float
    eff_rank: float
    top_pc_share: float
    dim_contrib: np.ndarray
    n: int


def hidden_vectors(folder, texts, *, max_length=64, special="exclude"):
    """Per layer: every kept vector (n x d, float64) and its sample label, no batching at all."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder)).eval()
    per_layer, labels = None, []
    for s, text in enumerate(texts):
        enc = tok(
            text,
            truncation=True,
            max_length=max_length,
            return_special_tokens_mask=True,
            return_tensors="pt",
        )
        keep = torch.ones_like(enc["input_ids"][0], dtype=torch.bool)
        if special == "exclude":
            keep &= enc["special_tokens_mask"][0] == 0
        with torch.no_grad():
            hs = model(input_ids=enc["input_ids"], output_hidden_states=True).hidden_states
        if per_layer is None:
            per_layer = [[] for _ in hs]
        for layer, h in enumerate(hs):
            per_layer[layer].append(h[0][keep].double().numpy())
        labels.extend([s] * int(keep.sum()))
    return [np.concatenate(v) for v in per_layer], np.asarray(labels)


def _pairwise_mean(u, mask):
    g = u @ u.T
    return float(g[mask].mean())


def reference_layer(x: np.ndarray, labels: np.ndarray) -> RefLayer:
    """Every metric by its definition, over all pairs (O(n^2) on purpose)."""
    from IsoScore import IsoScore

    n = len(x)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    distinct = ~np.eye(n, dtype=bool)
    cross = labels[:, None] != labels[None, :]
    mean = x.mean(0)
    v = x - mean
    uc = v / np.linalg.norm(v, axis=1, keepdims=True)
    cov = np.cov(x, rowvar=False)
    vals = np.sort(np.linalg.eigvalsh(cov))[::-1].clip(0)
    p = vals[vals > 0] / vals.sum()
    contrib = (np.einsum("ik,jk->k", u, u) - np.einsum("ik,ik->k", u, u)) / (n * (n - 1))
    return RefLayer(
        avg_cos=_pairwise_mean(u, distinct),
        avg_cos_xctx=_pairwise_mean(u, cross),
        drift_norm=float(np.linalg.norm(mean)),
        mean_norm=float(np.linalg.norm(x, axis=1).mean()),
        avg_cos_centered=_pairwise_mean(uc, distinct),
        isoscore=float(IsoScore.IsoScore(x)),
        eff_rank=float(np.exp(-(p * np.log(p)).sum())),
        top_pc_share=float(vals[0] / vals.sum()),
        dim_contrib=contrib,
        n=n,
    )
