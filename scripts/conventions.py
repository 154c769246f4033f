"""isotui's layer metrics beside the conventions of the public implementations they come from.

Runs MiniLM (the bundled all-MiniLM-L6-v2) over the first ``--max-samples`` samples of the
built-in corpus twice: through isotui's own Python path (``isotui.experiments.layerwise.measure``,
with a reservoir that holds every vector, so the sampled metrics are exact), and independently,
one sample at a time through ``transformers`` directly (no padding, special tokens left out as
isotui does by default), with every number recomputed from the raw hidden states in float64
numpy. Each alternative convention is implemented the way its authors' code does it:

- I(W), Machina & Mercer 2024 (``src/partition_function.py``, ``compute_IW``): Z(c) = sum exp(W c)
  over the eigenvectors c of W^T W as the solver returns them (one sign each), min Z / max Z;
  "centred" subtracts the mean first. isotui takes both signs of every eigenvector, so its
  I(W) is at most theirs by construction (the solver's sign choice is arbitrary).
- All-but-the-top, Mu & Viswanath 2018 (their Algorithm 1, and the implementation widely copied
  from it): v~ = v - mean,
  u_1..u_D the top principal components of v~, v' = v~ - sum_i (u_i . v) u_i, projecting the
  *uncentred* v, which leaves the shared vector -sum_i (u_i . mean) u_i in every v'. isotui
  projects the centred v~ (the correction Bis et al. 2021 use). avg_cos of the result, D = ceil(d/100).
- Ethayarajh 2019 (``kawine/contextual``, ``preprocess.py`` and ``analyze.py``): self-similarity
  over the tokens that are not punctuation and occur at least 5 times, each over up to 1,000
  randomly sampled ordered pairs of its occurrences (pairs within one sentence included), each
  word's mean rounded to 3 decimals, then averaged over words; intra-sentence similarity as the
  mean over sentences (a random sample of up to 1,000) of the per-sentence mean cosine to the
  sentence's mean vector, each rounded to 3 decimals; the anisotropy baseline as the mean cosine
  of 1,000 random pairs drawn with replacement from one random token per sampled sentence
  (sentences equally weighted, a token may be paired with itself). The baseline's exact
  expectation, (||sum_s m_s||^2 - sum_s ||m_s||^2 + M) / M^2 with m_s the mean unit vector of
  sentence s, is printed beside the draw.
- IsoScore and IsoScore* (the ``isoscore`` package, ``IsoScore.IsoScore`` and
  ``IsoScore.IsoScore_star(points, I, 0.2)``) on the float64 points, and the package's formula in
  float64 (the package takes sqrt(d) of an integer tensor, which torch computes in float32).

Usage (from the repository root)::

    PYTHONPATH=. python scripts/conventions.py                 # 100 samples, about a minute of CPU
    PYTHONPATH=. python scripts/conventions.py --max-samples 500 --json out.json --claims
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import unicodedata
from pathlib import Path

import numpy as np

ABTT_D = None  # None: ceil(d / 100), as Mu & Viswanath
ETHAYARAJH_SAMPLES = 1000
ETHAYARAJH_MIN_COUNT = 5


# ----------------------------------------------------------------------------- data


def hidden_states(
    model_dir: Path, samples: list[str], max_length: int
) -> tuple[list[list[np.ndarray]], list]:
    """Per layer, per sample: the (n_s x d) float64 hidden states of the non-special tokens, one
    sample at a time (no padding); and per sample its kept token strings."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir)).eval()
    layers: list[list[np.ndarray]] | None = None
    tokens = []
    for text in samples:
        enc = tok(
            text, truncation=True, max_length=max_length, return_special_tokens_mask=True, return_tensors="pt"
        )
        keep = enc["special_tokens_mask"][0] == 0
        feed = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        with torch.no_grad():
            hs = model(**feed, output_hidden_states=True).hidden_states
        if layers is None:
            layers = [[] for _ in hs]
        for i, h in enumerate(hs):
            layers[i].append(h[0][keep].double().numpy())
        ids = enc["input_ids"][0][keep].tolist()
        tokens.append((ids, tok.convert_ids_to_tokens(ids)))
    assert layers is not None
    return layers, tokens


# ----------------------------------------------------------------------------- isotui's definitions


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def mean_cos(x: np.ndarray) -> float:
    """Exact mean cosine over all distinct pairs."""
    u = unit(x)
    s = u.sum(0)
    n = len(u)
    return float((s @ s - n) / (n * (n - 1)))


def avg_cos_xctx(per_sample: list[np.ndarray]) -> float:
    """Mean cosine over the pairs from different samples."""
    us = [unit(x) for x in per_sample]
    sums = np.array([u.sum(0) for u in us])
    counts = np.array([len(u) for u in us], dtype=np.float64)
    total = sums.sum(0)
    within = float((sums * sums).sum())
    n = counts.sum()
    return float((total @ total - within) / (n * n - (counts**2).sum()))


def intra_sim_exact(per_sample: list[np.ndarray]) -> float:
    return float(np.mean([np.mean(unit(x) @ (x.mean(0) / np.linalg.norm(x.mean(0)))) for x in per_sample]))


def package_formula_f64(vals: np.ndarray) -> float:
    """The ``isoscore`` package's steps on eigenvalues, all in float64."""
    n = float(len(vals))
    pcs = vals * math.sqrt(n) / np.linalg.norm(vals)
    defect = np.linalg.norm(pcs - 1.0) / math.sqrt(2 * (n - math.sqrt(n)))
    return float(((n - defect**2 * (n - math.sqrt(n))) ** 2 - n) / (n * (n - 1)))


def package_formula_f32_sqrt(vals: np.ndarray) -> float:
    """The package's steps with its three float32 constants taken from torch as it computes them
    (``torch.sqrt`` of an integer tensor is float32: sqrt(d), d - sqrt(d) and
    sqrt(2 (d - sqrt(d)))), everything else in float64."""
    import torch

    d = torch.tensor(len(vals))
    root, spread = torch.sqrt(d), d - torch.sqrt(d)
    spice = float(torch.sqrt(2 * spread))
    pcs = vals * float(root) / np.linalg.norm(vals)
    defect = np.linalg.norm(pcs - 1.0) / spice
    n = float(len(vals))
    return float(((n - defect**2 * float(spread)) ** 2 - n) / (n * (n - 1)))


# ----------------------------------------------------------------------------- the authors' conventions


def iw_one_sign(w: np.ndarray, centred: bool) -> float:
    """Machina & Mercer's compute_IW: eigenvectors of W^T W as eigh returns them, one sign each."""
    if centred:
        w = w - w.mean(0)
    _, vecs = np.linalg.eigh(w.T @ w)
    z = np.exp(w @ vecs).sum(0)
    return float(z.min() / z.max())


def iw_both_signs(w: np.ndarray, centred: bool) -> float:
    """isotui's convention (both signs of every eigenvector), in log space."""
    if centred:
        w = w - w.mean(0)
    _, vecs = np.linalg.eigh(w.T @ w)
    p = w @ vecs
    both = np.concatenate([p, -p], axis=1)
    top = both.max(0)
    log_z = top + np.log(np.exp(both - top).sum(0))
    return float(np.exp(log_z.min() - log_z.max()))


def abtt(x: np.ndarray, original: bool) -> float:
    """avg_cos after all-but-the-top: Mu & Viswanath's projection of v (original) or of v~ (centred)."""
    d = x.shape[1]
    top = ABTT_D or max(1, math.ceil(d / 100))
    tilde = x - x.mean(0)
    vals, vecs = np.linalg.eigh(tilde.T @ tilde)
    u = vecs[:, np.argsort(vals)[::-1][:top]].T  # (D, d), the top principal components
    return mean_cos(tilde - ((x if original else tilde) @ u.T) @ u)


def is_punct(token: str) -> bool:
    return bool(token) and all(unicodedata.category(c).startswith("P") for c in token)


def ethayarajh(per_sample: list[np.ndarray], tokens: list, rng: random.Random) -> dict[str, float]:
    """Self-similarity, intra-sentence similarity and the random-pair baseline as analyze.py does."""
    occurrences: dict[str, list[tuple[int, int]]] = {}
    for s, (_, strings) in enumerate(tokens):
        for i, t in enumerate(strings):
            if not is_punct(t):
                occurrences.setdefault(t, []).append((s, i))
    words = {w: occ for w, occ in occurrences.items() if len(occ) >= ETHAYARAJH_MIN_COUNT}
    units = [unit(x) for x in per_sample]
    per_word = []
    for occ in words.values():
        idx = range(len(occ))
        pairs = [(i, j) for i in idx for j in idx if i != j]
        if len(pairs) > ETHAYARAJH_SAMPLES:
            pairs = rng.sample(pairs, ETHAYARAJH_SAMPLES)
        a = np.array([units[occ[i][0]][occ[i][1]] for i, _ in pairs])
        b = np.array([units[occ[j][0]][occ[j][1]] for _, j in pairs])
        per_word.append(round(float(np.mean((a * b).sum(1))), 3))
    m = min(ETHAYARAJH_SAMPLES, len(per_sample))
    chosen = rng.sample(range(len(per_sample)), m)
    intra = []
    picked = []
    for s in chosen:
        x = per_sample[s]
        centre = x.mean(0)
        intra.append(round(float(np.mean(unit(x) @ (centre / np.linalg.norm(centre)))), 3))
        picked.append(units[s][rng.choice(range(len(x)))])
    baseline = np.mean([float(rng.choice(picked) @ rng.choice(picked)) for _ in range(ETHAYARAJH_SAMPLES)])
    means = np.array([units[s].mean(0) for s in chosen])
    total = means.sum(0)
    expected = (total @ total - (means * means).sum() + m) / m**2
    return {
        "self_sim": float(np.mean(per_word)) if per_word else math.nan,
        "self_sim_words": len(per_word),
        "intra_sim": round(float(np.mean(intra)), 3),
        "baseline": round(float(baseline), 3),
        "baseline_expected": float(expected),
    }


# ----------------------------------------------------------------------------- one layer


def layer_numbers(per_sample: list[np.ndarray], tokens: list, seed: int) -> dict[str, float]:
    """Every alternative (and isotui's definition, recomputed plainly) for one layer."""
    import torch
    from IsoScore import IsoScore
    from scipy.stats import beta

    x = np.concatenate(per_sample)
    d = x.shape[1]
    cov = np.cov(x, rowvar=False)
    vals = np.clip(np.linalg.eigvalsh(cov)[::-1], 0, None)
    target = np.trace(cov) / d  # IsoScore*'s C0 = (tr C / d) I: the same total variance, isotropic
    shrunk = np.clip(np.linalg.eigvalsh(0.8 * cov + 0.2 * target * np.eye(d))[::-1], 0, None)
    ids = np.concatenate([np.asarray(i) for i, _ in tokens])
    counts = {t: c for t, c in zip(*np.unique(ids, return_counts=True), strict=True)}
    w = np.array([1.0 / counts[t] for t in ids])
    u = unit(x)
    su = (w[:, None] * u).sum(0)
    mean = x.mean(0)
    std = x.std(0)
    live = std > 0
    out = {
        "avg_cos": mean_cos(x),
        "avg_cos_xctx": avg_cos_xctx(per_sample),
        "drift_norm": float(np.linalg.norm(mean)),
        "mean_norm": float(np.linalg.norm(x, axis=1).mean()),
        "avg_cos_centered": mean_cos(x - mean),
        "eff_rank": float(np.exp(-(p := vals[vals > 0] / vals.sum()) @ np.log(p))),
        "top_pc_share": float(vals[0] / vals.sum()),
        "isoscore_f64": package_formula_f64(vals),
        "isoscore_pkg": float(IsoScore.IsoScore(x)),
        "isoscore_f32_sqrt": package_formula_f32_sqrt(vals),
        "isoscore_star_f64": package_formula_f64(shrunk),
        "isoscore_star_pkg": float(
            IsoScore.IsoScore_star(x, target * torch.eye(d, dtype=torch.float64), 0.2)
        ),
        "iw_both": iw_both_signs(x, False),
        "iw_one_sign": iw_one_sign(x, False),
        "iw_centered_both": iw_both_signs(x, True),
        "iw_centered_one_sign": iw_one_sign(x, True),
        "abtt_centred": abtt(x, original=False),
        "abtt_original": abtt(x, original=True),
        "avg_cos_std": mean_cos((x[:, live] - mean[live]) / std[live]),
        "avg_cos_types": float((su @ su - (w**2).sum()) / (w.sum() ** 2 - (w**2).sum())),
        "drift_norm_types": float(np.linalg.norm((w[:, None] * x).sum(0) / w.sum())),
        "intra_sim": intra_sim_exact(per_sample),
        "null_p95": float(2 * beta.ppf(0.95, (d - 1) / 2, (d - 1) / 2) - 1),
        "n": len(x),
    }
    eth = ethayarajh(per_sample, tokens, random.Random(seed))
    out.update({f"eth_{k}": v for k, v in eth.items()})
    return out


# ----------------------------------------------------------------------------- isotui's own numbers


def isotui_rows(max_samples: int, reservoir: int):
    from isotui.experiments.layerwise import measure
    from isotui.spec import make_spec

    spec = make_spec("minilm", max_samples=max_samples, reservoir=reservoir, device="cpu")
    return measure(spec, None)


def run(max_samples: int, seed: int = 0) -> dict:
    """Both sides, every layer: ``{"layers": [...], "n_samples": ..., "n_vectors": ...}``."""
    from isotui.data.sources import load_samples, parse_data
    from isotui.models.naming import bundled_minilm_dir

    samples = load_samples(parse_data("builtin"), max_samples)
    model_dir = bundled_minilm_dir()
    layers, tokens = hidden_states(model_dir, samples, 512)
    n_vectors = sum(len(x) for x in layers[0])
    result = isotui_rows(max_samples, max(n_vectors, 2))
    out = []
    for row, per_sample in zip(result.rows, layers, strict=True):
        mine = layer_numbers(per_sample, tokens, seed)
        if row.n_vectors != mine["n"]:
            raise RuntimeError(
                f"layer {row.layer}: isotui kept {row.n_vectors} vectors, this script {mine['n']}"
            )
        theirs = {
            k: getattr(row, k)
            for k in (
                "avg_cos",
                "avg_cos_xctx",
                "drift_norm",
                "mean_norm",
                "avg_cos_centered",
                "isoscore",
                "isoscore_star",
                "eff_rank",
                "top_pc_share",
                "iw",
                "iw_centered",
                "avg_cos_abtt",
                "avg_cos_std",
                "avg_cos_types",
                "drift_norm_types",
                "intra_sim",
                "self_sim",
                "self_sim_types",
                "null_p95",
                "n_sample",
                "spectrum_from",
            )
        }
        out.append({"layer": row.layer, "isotui": theirs, "plain": mine})
    return {"n_samples": len(samples), "n_vectors": n_vectors, "dim": layers[0][0].shape[1], "layers": out}


# ----------------------------------------------------------------------------- printing


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def print_tables(res: dict) -> None:
    layers = res["layers"]
    print(
        f"MiniLM (all-MiniLM-L6-v2), built-in corpus, first {res['n_samples']} samples, "
        f"{res['n_vectors']} token vectors per layer, d = {res['dim']}, special tokens excluded\n"
    )
    same = [
        ("avg_cos", "avg_cos"),
        ("avg_cos_xctx", "avg_cos_xctx"),
        ("drift_norm", "drift_norm"),
        ("mean_norm", "mean_norm"),
        ("avg_cos_centered", "avg_cos_centered"),
        ("eff_rank", "eff_rank"),
        ("top_pc_share", "top_pc_share"),
        ("isoscore", "isoscore_f64"),
        ("isoscore_star", "isoscore_star_f64"),
        ("iw", "iw_both"),
        ("iw_centered", "iw_centered_both"),
        ("avg_cos_abtt", "abtt_centred"),
        ("avg_cos_std", "avg_cos_std"),
        ("avg_cos_types", "avg_cos_types"),
        ("drift_norm_types", "drift_norm_types"),
        ("intra_sim", "intra_sim"),
        ("null_p95", "null_p95"),
    ]
    print("1. isotui against the same definition in float64 numpy (largest relative difference over layers)")
    for mine, plain in same:
        worst = max(rel(lay["isotui"][mine], lay["plain"][plain]) for lay in layers)
        print(f"   {mine:<17} {worst:.1e}")
    print()
    header = "layer " + " ".join(f"{lay['layer']:>10}" for lay in layers)

    def line(label: str, values) -> None:
        print(f"   {label:<38}" + " ".join(f"{v:>10.4g}" for v in values))

    def block(title: str, rows) -> None:
        print(title)
        print(f"   {'':<38}" + header[6:])
        for label, values in rows:
            line(label, values)
        print()

    iso = [lay["isotui"] for lay in layers]
    pl = [lay["plain"] for lay in layers]
    block(
        "2. I(W): isotui (both signs of each eigenvector) vs Machina & Mercer's compute_IW (solver's sign)",
        [
            ("isotui iw", [r["iw"] for r in iso]),
            ("one sign (numpy eigh's signs)", [r["iw_one_sign"] for r in pl]),
            ("ratio one-sign / isotui", [p["iw_one_sign"] / r["iw"] for p, r in zip(pl, iso, strict=True)]),
            ("isotui iw_centered", [r["iw_centered"] for r in iso]),
            ("one sign, centred", [r["iw_centered_one_sign"] for r in pl]),
            (
                "ratio one-sign / isotui, centred",
                [p["iw_centered_one_sign"] / r["iw_centered"] for p, r in zip(pl, iso, strict=True)],
            ),
        ],
    )
    block(
        "3. all-but-the-top: isotui (centred projection, Bis et al.) vs Mu & Viswanath's Algorithm 1",
        [
            ("isotui avg_cos_abtt", [r["avg_cos_abtt"] for r in iso]),
            ("Mu & Viswanath (projects uncentred v)", [r["abtt_original"] for r in pl]),
            (
                "ratio original / isotui",
                [p["abtt_original"] / r["avg_cos_abtt"] for p, r in zip(pl, iso, strict=True)],
            ),
        ],
    )
    block(
        "4. Ethayarajh 2019: isotui (exact, every pair) vs his analyze.py (sampled, rounded)",
        [
            ("isotui self_sim", [r["self_sim"] for r in iso]),
            ("his self-similarity", [p["eth_self_sim"] for p in pl]),
            (
                "relative difference",
                [p["eth_self_sim"] / r["self_sim"] - 1 for p, r in zip(pl, iso, strict=True)],
            ),
            ("isotui intra_sim", [r["intra_sim"] for r in iso]),
            ("his intra-sentence similarity", [p["eth_intra_sim"] for p in pl]),
            ("isotui avg_cos", [r["avg_cos"] for r in iso]),
            ("isotui avg_cos_xctx", [r["avg_cos_xctx"] for r in iso]),
            ("his random-pair baseline (one draw)", [p["eth_baseline"] for p in pl]),
            ("its expectation", [p["eth_baseline_expected"] for p in pl]),
            (
                "expectation / avg_cos - 1",
                [p["eth_baseline_expected"] / r["avg_cos"] - 1 for p, r in zip(pl, iso, strict=True)],
            ),
            (
                "expectation / avg_cos_xctx - 1",
                [p["eth_baseline_expected"] / r["avg_cos_xctx"] - 1 for p, r in zip(pl, iso, strict=True)],
            ),
        ],
    )
    types, words = iso[0]["self_sim_types"], pl[0]["eth_self_sim_words"]
    print(f"   (self-similarity: isotui over {types} token types seen in two or more samples; his over")
    print(f"   the {words} non-punctuation tokens that occur at least 5 times)\n")
    block(
        "5. IsoScore: the isoscore package (sqrt(d) in float32) vs its formula in float64 and isotui",
        [
            ("isotui isoscore", [r["isoscore"] for r in iso]),
            ("package IsoScore", [p["isoscore_pkg"] for p in pl]),
            ("|package - float64 formula|", [abs(p["isoscore_pkg"] - p["isoscore_f64"]) for p in pl]),
            (
                "|isotui - float64 formula|",
                [abs(r["isoscore"] - p["isoscore_f64"]) for p, r in zip(pl, iso, strict=True)],
            ),
            (
                "|package - formula, float32 sqrt|",
                [abs(p["isoscore_pkg"] - p["isoscore_f32_sqrt"]) for p in pl],
            ),
            ("isotui isoscore_star", [r["isoscore_star"] for r in iso]),
            ("package IsoScore_star(C0=tr/d I, 0.2)", [p["isoscore_star_pkg"] for p in pl]),
            (
                "|package - float64 formula|, star",
                [abs(p["isoscore_star_pkg"] - p["isoscore_star_f64"]) for p in pl],
            ),
        ],
    )


def _e(x: float) -> str:
    """``2.7e-8``: two significant digits, no padded exponent."""
    mantissa, _, exponent = f"{x:.1e}".partition("e")
    return f"{mantissa}e{int(exponent)}"


def _g(x: float) -> str:
    return f"{x:.2g}".replace("-", "−")


def _pct(x: float) -> str:
    return f"{abs(x):.1%} {'below' if x < 0 else 'above'}"


def claims(res: dict) -> dict[str, str]:
    """docs/conventions.md's table, last column ("on MiniLM"), generated from a run: the cell of
    each row, keyed by the row's first cell. tests/test_conventions.py checks the page against it."""
    iso = [lay["isotui"] for lay in res["layers"]]
    pl = [lay["plain"] for lay in res["layers"]]

    def worst(*pairs: tuple[str, str]) -> str:
        return "equal to " + _e(max(rel(i[a], p[b]) for i, p in zip(iso, pl, strict=True) for a, b in pairs))

    def span(values) -> str:  # rounding-level gaps: their largest (a range's ends vary by build)
        return "≤ " + _e(max(values))

    def times(values) -> str:
        values = [abs(v) for v in values]
        return " to ".join(f"{v:.0f}×" if v >= 10 else f"{v:.2g}×" for v in (min(values), max(values)))

    expect = [p["eth_baseline_expected"] / i["avg_cos"] - 1 for i, p in zip(iso, pl, strict=True)]
    draws = [p["eth_baseline"] for p in pl]
    cos = [i["avg_cos"] for i in iso]
    self_rel = [p["eth_self_sim"] / i["self_sim"] - 1 for i, p in zip(iso, pl, strict=True)]
    last = len(iso) - 1
    theirs, ours = [p["abtt_original"] for p in pl], [i["avg_cos_abtt"] for i in iso]
    intra = max(abs(p["eth_intra_sim"] - i["intra_sim"]) for i, p in zip(iso, pl, strict=True))
    return {
        "`avg_cos`": worst(("avg_cos", "avg_cos")),
        "`avg_cos_xctx`": f"isotui {worst(('avg_cos_xctx', 'avg_cos_xctx'))}; his baseline's expectation is "
        f"{_pct(min(expect))} to {_pct(max(expect))} `avg_cos` by layer (one seeded draw: "
        f"{min(draws):.3f} to {max(draws):.3f} where `avg_cos` is {min(cos):.3f} to {max(cos):.3f})",
        "`drift_norm`, `mean_norm`": worst(("drift_norm", "drift_norm"), ("mean_norm", "mean_norm")),
        "`avg_cos_centered`": worst(("avg_cos_centered", "avg_cos_centered")),
        "`isoscore`": "package − float64: "
        + span(abs(p["isoscore_pkg"] - p["isoscore_f64"]) for p in pl)
        + " on every layer; isotui − float64: ≤ "
        + _e(max(abs(i["isoscore"] - p["isoscore_f64"]) for i, p in zip(iso, pl, strict=True))),
        "`isoscore_star`": "package − float64: "
        + span(abs(p["isoscore_star_pkg"] - p["isoscore_star_f64"]) for p in pl)
        + "; isotui − float64: ≤ "
        + _e(max(abs(i["isoscore_star"] - p["isoscore_star_f64"]) for i, p in zip(iso, pl, strict=True))),
        "`eff_rank`, `top_pc_share`": worst(("eff_rank", "eff_rank"), ("top_pc_share", "top_pc_share")),
        "`iw`, `iw_centered`": "one-sign ÷ isotui: "
        + times(p["iw_one_sign"] / i["iw"] for i, p in zip(iso, pl, strict=True))
        + " (raw), "
        + times(p["iw_centered_one_sign"] / i["iw_centered"] for i, p in zip(iso, pl, strict=True))
        + " (centred) with numpy's signs",
        "`avg_cos_abtt`": f"theirs {_g(min(theirs))} to {_g(max(theirs))}, "
        f"isotui {_g(min(ours))} to {_g(max(ours))}: theirs "
        + times(p["abtt_original"] / i["avg_cos_abtt"] for i, p in zip(iso, pl, strict=True))
        + " isotui's in size",
        "`avg_cos_std`": worst(("avg_cos_std", "avg_cos_std")),
        "`avg_cos_types`, `drift_norm_types`": worst(
            ("avg_cos_types", "avg_cos_types"), ("drift_norm_types", "drift_norm_types")
        ),
        "`intra_sim`": f"within {_e(intra)} (the rounding)",
        "`self_sim`": f"his {_pct(self_rel[0])} (layer 0) to {_pct(self_rel[last])} (layer {last}) isotui's; "
        f"{pl[0]['eth_self_sim_words']} words vs {iso[0]['self_sim_types']} types",
        "`null_p95`": f"{iso[0]['null_p95']:.4f} for d = {res['dim']}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-samples", type=int, default=100, help="first N built-in samples (default 100)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of Ethayarajh's random sampling (default 0)"
    )
    parser.add_argument("--json", help="also write every number to this file")
    parser.add_argument(
        "--claims",
        action="store_true",
        help='also print docs/conventions.md\'s table column ("on MiniLM") from this run',
    )
    args = parser.parse_args(argv)
    if args.max_samples < 2:
        parser.error("--max-samples must be at least 2")
    res = run(args.max_samples, args.seed)
    print_tables(res)
    if args.claims:
        for key, cell in claims(res).items():
            print(f"{key}: {cell}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
