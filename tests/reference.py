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


def step_gradients_by_hand(model, captured: dict, tok, top_k: int = 10) -> tuple[list[dict], float]:
    """A training step's gradients w.r.t. the hidden states, recomputed for the callbacks' tests:
    ``model`` (a masked LM) with the captured weights, the captured batch, torch's CPU generator
    as it was before the step (the same dropout), ``torch.autograd.grad`` of the model's loss,
    then numpy over all pairs of the kept tokens (attended, not CLS/SEP/PAD/UNK). Per layer the
    gradients experiment's metrics; and the loss (to check the recomputation is the step's)."""
    import torch

    model.load_state_dict(captured["weights"])
    model.train()
    torch.set_rng_state(captured["rng"])
    out = model(**captured["batch"], output_hidden_states=True)
    grads = torch.autograd.grad(out.loss, out.hidden_states)
    ids = captured["batch"]["input_ids"].numpy()
    keep = ~np.isin(ids, [tok.cls_token_id, tok.sep_token_id, tok.pad_token_id, tok.unk_token_id])
    if "attention_mask" in captured["batch"]:
        keep &= captured["batch"]["attention_mask"].numpy().astype(bool)
    rows = []
    for h, g in zip(out.hidden_states, grads, strict=True):
        x, gv = h.detach().numpy()[keep].astype(np.float64), g.numpy()[keep].astype(np.float64)
        norms = np.linalg.norm(gv, axis=1)
        u = gv[norms > 0] / norms[norms > 0, None]
        cos = u @ u.T
        n = len(u)
        xc = x - x.mean(0)
        _, vecs = np.linalg.eigh(xc.T @ xc / len(x))
        top = vecs[:, ::-1][:, :top_k]
        rows.append(
            {
                "n_vectors": len(x),
                "n_zero": int((norms == 0).sum()),
                "grad_avg_cos": (cos.sum() - np.trace(cos)) / (n * (n - 1)),
                "grad_mean_norm": norms.mean(),
                "top_share": float(((gv @ top) ** 2).sum() / (gv**2).sum()),
            }
        )
    return rows, out.loss.detach().item()
