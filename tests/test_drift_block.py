"""``isotui experiment drift-block`` (Godey et al. 2024, Fig. 6-10): every number is checked
against a plain numpy computation from the same drawn inputs and the block's own weights."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from isotui.cli import main
from isotui.core.attention import RANGE_BINS
from isotui.errors import Cancelled, IsotuiError
from isotui.experiments import drift_block as db
from isotui.experiments.drift_block import (
    DriftBlockConfig,
    DriftBlockRow,
    build_block,
    parse_norms,
    run_drift_block,
)
from isotui.store.cache import ResultCache

SMALL = dict(hidden=64, heads=4, intermediate=128, vocab=500, batch=4, seq_len=32, device="cpu")
NORMS = (0.0, 4.0, 12.0, 30.0)  # the output norm is ~sqrt(64) = 8: N* lies between 4 and 12
SMALL_FLAGS = [
    *("--hidden", "64", "--heads", "4", "--intermediate", "128", "--vocab", "500"),
    *("--batch", "4", "--seq-len", "32", "--device", "cpu"),
]


def config(**kw) -> DriftBlockConfig:
    return DriftBlockConfig(**{**SMALL, "norms": NORMS, **kw})


@pytest.fixture(scope="module")
def result():
    # init std 0.1, not BERT's 0.02: the softmax rows then differ enough across positions and
    # heads for every statistic (mean vs min over positions...) to be told apart
    return run_drift_block(config(init_std=0.1), None)


def avg_cos(x: np.ndarray) -> float:
    """Mean cosine over all distinct pairs, from the explicit n x n matrix."""
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    c = u @ u.T
    n = len(x)
    return float((c.sum() - np.trace(c)) / (n * (n - 1)))


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def reference(cfg: DriftBlockConfig, seed: int) -> list[dict]:
    """Everything by hand, in float64 numpy, from the drawn inputs and the block's weights; the
    block (eager attention) is only run for its output and its own attention probabilities."""
    built = build_block(cfg, seed, attn_implementation="eager")
    block = built.block
    attn = block.attention.self
    w = {n: p.detach().double().numpy() for n, p in attn.named_parameters()}
    e = built.embeddings.double().numpy()
    ids = built.ids.numpy()
    b_u = built.b_u.double().numpy()
    module_probs = {}
    handle = attn.register_forward_hook(lambda m, i, o: module_probs.__setitem__("p", o[1]))
    bsz, t, d, h = cfg.batch, cfg.seq_len, cfg.hidden, cfg.heads
    dk = d // h
    out = []
    for norm in cfg.norms:
        x = e[ids] + norm * b_u / np.linalg.norm(b_u)  # (B, T, d)
        with torch.no_grad():
            y = block(torch.tensor(x, dtype=torch.float32))
        y = (y[0] if isinstance(y, tuple) else y).double().numpy()
        q = x @ w["query.weight"].T + w["query.bias"]
        k = x @ w["key.weight"].T + w["key.bias"]
        qh = q.reshape(bsz, t, h, dk).transpose(0, 2, 1, 3)  # (B, H, T, dk)
        kh = k.reshape(bsz, t, h, dk).transpose(0, 2, 1, 3)
        s = qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(dk)  # (B, H, T, T)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(p, module_probs["p"].double().numpy(), rtol=0, atol=2e-6)
        flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
        X, Y, Q, K = flat(x), flat(y), flat(q), flat(k)
        q_heads = [qh[:, i].reshape(-1, dk) for i in range(h)]
        k_heads = [kh[:, i].reshape(-1, dk) for i in range(h)]
        row_max, row_med, row_min = p.max(-1), np.median(p, axis=-1), p.min(-1)
        pos = np.stack([row_max.mean((0, 1)), row_med.mean((0, 1)), row_min.mean((0, 1))])
        scores = s.reshape(-1)
        out.append(
            {
                "in_avg_cos": avg_cos(X),
                "in_mean_norm": np.linalg.norm(X, axis=1).mean(),
                "in_drift_norm": np.linalg.norm(X.mean(0)),
                "out_avg_cos": avg_cos(Y),
                "out_mean_norm": np.linalg.norm(Y, axis=1).mean(),
                "out_drift_norm": np.linalg.norm(Y.mean(0)),
                "q_avg_cos": avg_cos(Q),
                "k_avg_cos": avg_cos(K),
                "q_mean_norm": np.linalg.norm(Q, axis=1).mean(),
                "k_mean_norm": np.linalg.norm(K, axis=1).mean(),
                "q_bar_norm": np.linalg.norm(Q.mean(0)),
                "k_bar_norm": np.linalg.norm(K.mean(0)),
                "cos_qk_bar": cos(Q.mean(0), K.mean(0)),
                "q_avg_cos_heads": np.mean([avg_cos(v) for v in q_heads]),
                "k_avg_cos_heads": np.mean([avg_cos(v) for v in k_heads]),
                "cos_qk_bar_heads": np.mean(
                    [cos(a.mean(0), b.mean(0)) for a, b in zip(q_heads, k_heads, strict=True)]
                ),
                "score_mean": scores.mean(),
                "score_std": scores.std(),
                "score_min": scores.min(),
                "score_max": scores.max(),
                "softmax_max": row_max.mean(),
                "softmax_median": row_med.mean(),
                "softmax_min": row_min.mean(),
                "softmax_max_peak": pos[0].max(),
                "softmax_min_floor": pos[2].min(),
                "entropy": (-(p * np.log(p)).sum(-1)).mean(),
                "_position": pos,
                "_scores": s,  # (B, H, T, T)
                "_head": {
                    "q_avg_cos": [avg_cos(v) for v in q_heads],
                    "k_avg_cos": [avg_cos(v) for v in k_heads],
                    "q_mean_norm": [np.linalg.norm(v, axis=1).mean() for v in q_heads],
                    "k_mean_norm": [np.linalg.norm(v, axis=1).mean() for v in k_heads],
                    "q_bar_norm": [np.linalg.norm(v.mean(0)) for v in q_heads],
                    "k_bar_norm": [np.linalg.norm(v.mean(0)) for v in k_heads],
                    "cos_qk_bar": [cos(q_heads[i].mean(0), k_heads[i].mean(0)) for i in range(h)],
                    "score_mean": s.mean((0, 2, 3)),
                    "score_std": s.transpose(1, 0, 2, 3).reshape(h, -1).std(1),
                    "softmax_max": row_max.mean((0, 2)),
                    "softmax_median": row_med.mean((0, 2)),
                    "softmax_min": row_min.mean((0, 2)),
                    "entropy": (-(p * np.log(p)).sum(-1)).mean((0, 2)),
                },
            }
        )
    handle.remove()
    return out


def crossing(norms, a, b) -> float:
    """The test's own N*: first sign change of a - b, linearly interpolated."""
    d = np.asarray(a) - np.asarray(b)
    for i in range(len(d) - 1):
        if d[i] == 0:
            return norms[i]
        if np.sign(d[i]) != np.sign(d[i + 1]):
            return norms[i] - d[i] * (norms[i + 1] - norms[i]) / (d[i + 1] - d[i])
    return norms[-1] if d[-1] == 0 else math.nan


def test_every_number_matches_a_plain_computation(result):
    cfg = result.config
    ref = reference(cfg, 0)
    for i, (row, want) in enumerate(zip(result.rows, ref, strict=True)):
        assert row.seed == 0 and row.norm == cfg.norms[i]
        for name in DriftBlockRow.metrics():
            if name == "score_outside":
                continue
            assert getattr(row, name) == pytest.approx(want[name], rel=2e-4, abs=2e-6), (row.norm, name)
        np.testing.assert_allclose(result.softmax_position[0, i], want["_position"], rtol=1e-5, atol=1e-7)
        assert set(result.head) == set(want["_head"])
        for name, values in want["_head"].items():
            np.testing.assert_allclose(result.head[name][0, i], values, rtol=2e-4, atol=2e-6, err_msg=name)
        # histograms: np.histogram on the same edges, per head; a score within float32 rounding of
        # an edge may land on the other side of it, nothing else may differ
        edges = result.score_edges[i]
        hist = result.score_hist[0, i]
        assert_binned_like_numpy(hist, edges, want["_scores"])
        assert row.score_outside == hist[:, 0].sum() + hist[:, -1].sum() == 0
    in_norm = [w["in_mean_norm"] for w in ref]
    out_norm = [w["out_mean_norm"] for w in ref]
    star = crossing(list(cfg.norms), in_norm, out_norm)
    assert 4 < star < 12
    assert result.n_star == pytest.approx(star, rel=1e-5)
    assert result.n_star_per_seed.tolist() == pytest.approx([star], rel=1e-5)
    assert all(r.n_star == result.n_star for r in result.rows)


def assert_binned_like_numpy(hist: np.ndarray, edges: np.ndarray, scores: np.ndarray) -> None:
    """``hist`` (H, bins + 2) against np.histogram of the plain float64 ``scores`` (B, H, T, T):
    the edges are the data's (they hold every score, equally spaced), and only a score within
    float32 rounding of an edge may be counted on the other side of it."""
    width = np.diff(edges)
    assert np.all(width == width[0]) and edges[0] <= scores.min() + 1e-6 * np.abs(scores).max()
    assert scores.max() - 1e-6 * np.abs(scores).max() < edges[-1]
    for h in range(scores.shape[1]):
        s = scores[:, h].reshape(-1)
        counts, _ = np.histogram(s, edges)
        counts[-1] -= (s == edges[-1]).sum()  # numpy closes the last bin; isotui does not
        mine = np.concatenate([[(s < edges[0]).sum()], counts, [(s >= edges[-1]).sum()]])
        near = np.abs(s[:, None] - edges[None, :]).min(1) < 1e-6 * np.abs(s).max()
        assert near.mean() < 0.01
        assert hist[h].sum() == len(s)
        assert np.abs(hist[h] - mine).sum() <= 2 * near.sum()


def test_shapes_for_plotting(result):
    cfg = result.config
    n = len(cfg.norms)
    assert result.norms.tolist() == list(cfg.norms)
    assert result.score_hist.shape == (1, n, cfg.heads, RANGE_BINS + 2)
    assert result.score_edges.shape == (n, RANGE_BINS + 1)
    assert result.score_hist_pooled().shape == (n, RANGE_BINS + 2)
    assert result.softmax_position.shape == (1, n, 3, cfg.seq_len)
    assert result.softmax_position_mean().shape == (n, 3, cfg.seq_len)
    assert all(v.shape == (1, n, cfg.heads) for v in result.head.values())
    assert result.metric("out_avg_cos").shape == (1, n)
    assert result.mean("out_avg_cos").shape == (n,) and np.isnan(result.std("out_avg_cos")).all()
    json.dumps(db._nan_to_none(result.to_json()))  # everything is JSON-able


def test_block_is_initialised_like_bert():
    """Same places zero and one as transformers' own BERT init, Linear weights N(0, std^2)."""
    from transformers import BertConfig, BertModel

    cfg = config(init_std=0.05, hidden=128, intermediate=256)
    built = build_block(cfg, 0)
    theirs = BertModel(
        BertConfig(
            vocab_size=cfg.vocab,
            hidden_size=cfg.hidden,
            num_attention_heads=cfg.heads,
            intermediate_size=cfg.intermediate,
            initializer_range=cfg.init_std,
            num_hidden_layers=1,
        )
    ).encoder.layer[0]
    ours = dict(built.block.named_parameters())
    for name, p in theirs.named_parameters():
        mine = ours[name].detach()
        if torch.all(p == 0):
            assert torch.all(mine == 0), name
        elif torch.all(p == 1):
            assert torch.all(mine == 1), name
        else:
            assert float(mine.std()) == pytest.approx(cfg.init_std, rel=0.05), name
            assert float(p.detach().std()) == pytest.approx(cfg.init_std, rel=0.05), name
    assert float(built.embeddings.std()) == pytest.approx(cfg.init_std, rel=0.02)
    assert abs(float(built.b_u.mean())) < 0.3 and float(built.b_u.std()) == pytest.approx(1, rel=0.25)
    assert built.ids.shape == (cfg.batch, cfg.seq_len) and int(built.ids.max()) < cfg.vocab
    assert not built.block.training


def test_reproducible_under_a_seed(result):
    again = run_drift_block(result.config, None)
    assert again.rows == result.rows
    np.testing.assert_array_equal(again.score_hist, result.score_hist)
    np.testing.assert_array_equal(again.softmax_position, result.softmax_position)
    other = run_drift_block(config(init_std=0.1, seeds=(1,)), None)
    assert other.rows[0].in_avg_cos != result.rows[0].in_avg_cos
    assert other.rows[-1].cos_qk_bar != result.rows[-1].cos_qk_bar


def test_several_seeds_give_numpy_mean_and_std(result):
    multi = run_drift_block(config(init_std=0.1, seeds=(0, 1, 2)), None)
    assert multi.seeds == (0, 1, 2) and len(multi.rows) == 3 * len(NORMS)
    assert multi.rows[: len(NORMS)] == result.rows  # a seed's numbers do not depend on the others
    for name in DriftBlockRow.metrics():
        per_seed = np.array([[getattr(r, name) for r in multi.rows if r.seed == s] for s in (0, 1, 2)])
        np.testing.assert_allclose(multi.mean(name), per_seed.mean(0), rtol=1e-12)
        np.testing.assert_allclose(multi.std(name), per_seed.std(0, ddof=1), rtol=1e-12, atol=1e-300)
    stars = multi.n_star_per_seed
    assert multi.n_star == pytest.approx(stars.mean()) and multi.n_star_std == pytest.approx(
        stars.std(ddof=1)
    )


def test_no_crossing_is_nan_with_a_note():
    r = run_drift_block(config(norms=(0.0, 1.0, 2.0)), None)
    assert math.isnan(r.n_star) and math.isnan(r.rows[0].n_star)
    assert any("do not cross" in n for n in r.notes)


def test_cache_hit_returns_the_same_without_running(tmp_path, monkeypatch, result):
    cache = ResultCache(tmp_path, folder="drift-block", schema=db.SCHEMA)
    first = run_drift_block(result.config, cache)
    assert first.from_cache == (False,) and first.rows == result.rows

    def boom(*a, **k):
        raise AssertionError("recomputed")

    monkeypatch.setattr(db.sweep, "_run_seed", boom)
    events = []
    hit = run_drift_block(result.config, cache, on_progress=events.append)
    assert hit.from_cache == (True,)
    assert hit.rows == first.rows and hit.n_star == first.n_star
    np.testing.assert_array_equal(hit.score_hist, first.score_hist)
    np.testing.assert_array_equal(hit.softmax_position, first.softmax_position)
    for k in first.head:
        np.testing.assert_array_equal(hit.head[k], first.head[k])
    assert events[-1].samples_done == events[-1].samples_total == len(NORMS)
    with pytest.raises(AssertionError, match="recomputed"):
        run_drift_block(config(init_std=0.03), cache)  # another setting is another key


def test_progress_per_norm_and_cancel():
    events = []
    run_drift_block(config(norms=(0.0, 1.0, 2.0)), None, on_progress=events.append)
    assert [e.samples_done for e in events] == [1, 2, 3] and events[-1].samples_total == 3
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 1

    with pytest.raises(Cancelled):
        run_drift_block(config(norms=(0.0, 1.0, 2.0)), None, should_stop=stop)
    assert len(asked) == 2


def test_parse_norms():
    assert parse_norms("0:30:31") == tuple(float(v) for v in range(31))
    assert parse_norms("5, 0,2.5") == (0.0, 2.5, 5.0)
    assert parse_norms("3:3:1") == (3.0,)
    for bad in ("5:1:0", "5:1:3", "0:1", "a,b", "1,1", "-1,2", "0:nan:3", ""):
        with pytest.raises(IsotuiError):
            parse_norms(bad)


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--norms", "5:1:0"], "--norms"),
        (["--heads", "5"], "--heads"),
        (["--seeds", "0,x"], "--seeds"),
        (["--init-std", "-1"], "--init-std"),
        (["--seq-len", "ten"], "--seq-len"),
        (["--device", "tpu"], "tpu"),
    ],
)
def test_bad_input_exits_2_with_one_sentence(capsys, flags, flag):
    code = main(["experiment", "drift-block", *SMALL_FLAGS, *flags, "--no-cache"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert flag in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_table_csv_and_json(tmp_path, capsys):
    out_csv, out_json = tmp_path / "d.csv", tmp_path / "d.json"
    args = ["experiment", "drift-block", *SMALL_FLAGS, "--norms", "0:30:4", "--seeds", "0,1", "-q"]
    code = main([*args, "--csv", str(out_csv), "--json", str(out_json), "--cache-dir", str(tmp_path / "c")])
    out = capsys.readouterr().out
    assert code == 0
    assert "drift-block" in out and "fixed point N*" in out and "±" in out
    with out_csv.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 4
    assert list(rows[0])[:4] == ["seed", "norm", "in_avg_cos", "in_mean_norm"]
    assert [(int(r["seed"]), float(r["norm"])) for r in rows] == [
        (s, n) for s in (0, 1) for n in (0, 10, 20, 30)
    ]
    assert all(-1 <= float(r["out_avg_cos"]) <= 1 for r in rows)
    data = json.loads(out_json.read_text())
    assert data["seeds"] == [0, 1] and len(data["summary"]) == 4
    assert np.array(data["score_hist"]).shape == (2, 4, 4, RANGE_BINS + 2)
    assert np.array(data["score_edges"]).shape == (4, RANGE_BINS + 1)
    assert np.array(data["softmax_position"]).shape == (2, 4, 3, 32)
    # the same question again comes from the cache
    assert main([*args[:-1], "--cache-dir", str(tmp_path / "c")]) == 0
    assert "2 of 2 seeds from the cache" in capsys.readouterr().err


def test_no_torch_at_import_nor_for_a_cached_answer(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def python(code: str) -> str:
        cmd = [sys.executable, "-c", code]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().splitlines()[-1]

    assert python("import sys, isotui.experiments.drift_block; print('torch' in sys.modules)") == "False"
    run_drift_block(config(norms=(0.0, 10.0)), ResultCache(tmp_path, folder="drift-block", schema=db.SCHEMA))
    flags = " ".join([*SMALL_FLAGS, "--norms", "0,10", "--cache-dir", str(tmp_path)])
    code = (
        "import sys; from isotui.cli import main; "
        f"code = main(['experiment', 'drift-block', *{flags!r}.split()]); "
        "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    assert python(code) == "0 False False"


def test_table_fits_a_narrow_terminal(result):
    from rich.console import Console

    from isotui.experiments.drift_block.view import result_table

    console = Console(width=80, record=True, color_system=None)
    console.print(result_table(result, 80))
    text = console.export_text()
    assert "some columns hidden" in text and "in cos" in text and "out |x|" in text
    assert "fixed point N*" in text and "floor min" not in text
    assert max(len(line) for line in text.splitlines()) <= 80


# ----------------------------------------------------------------------------- block and measure


def plain_block(cfg: DriftBlockConfig, seed: int) -> list[dict]:
    """The block re-implemented in float64 numpy from its weights, as ``cfg.block`` wires it;
    per N the measured output's statistics (before the output LayerNorm for ``before-norm``) and
    the softmax rows' max, median and min."""
    from scipy.special import erf

    built = build_block(cfg, seed)
    w = {n: p.detach().double().numpy() for n, p in built.block.named_parameters()}
    eps1 = built.block.attention.output.LayerNorm.eps
    eps2 = built.block.output.LayerNorm.eps
    e, ids, b_u = built.embeddings.double().numpy(), built.ids.numpy(), built.b_u.double().numpy()
    bsz, t, d, h = cfg.batch, cfg.seq_len, cfg.hidden, cfg.heads
    dk = d // h

    def linear(x, name):
        return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    def layer_norm(x, name, eps):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[f"{name}.weight"] + w[f"{name}.bias"]

    def attention(x):
        split = lambda a: a.reshape(bsz, t, h, dk).transpose(0, 2, 1, 3)  # noqa: E731
        q = linear(x, "attention.self.query")
        k = linear(x, "attention.self.key")
        v = linear(x, "attention.self.value")
        s = split(q) @ split(k).transpose(0, 1, 3, 2) / math.sqrt(dk)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        context = (p @ split(v)).transpose(0, 2, 1, 3).reshape(bsz, t, d)
        return linear(context, "attention.output.dense"), q, p

    def ffn(x):
        a = linear(x, "intermediate.dense")
        return linear(0.5 * a * (1 + erf(a / math.sqrt(2))), "output.dense")  # BERT's exact GELU

    out = []
    for norm in cfg.norms:
        x = e[ids] + norm * b_u / np.linalg.norm(b_u)
        if cfg.block == "post-ln":
            a, q, p = attention(x)
            hid = layer_norm(x + a, "attention.output.LayerNorm", eps1)
            y = hid + ffn(hid)
            if cfg.measure == "after-norm":
                y = layer_norm(y, "output.LayerNorm", eps2)
        else:
            a, q, p = attention(layer_norm(x, "attention.output.LayerNorm", eps1))
            hid = x + a
            y = hid + ffn(layer_norm(hid, "output.LayerNorm", eps2))
        Y, X, Q = y.reshape(-1, d), x.reshape(-1, d), q.reshape(-1, d)
        out.append(
            {
                "in_mean_norm": np.linalg.norm(X, axis=1).mean(),
                "out_avg_cos": avg_cos(Y),
                "out_mean_norm": np.linalg.norm(Y, axis=1).mean(),
                "out_drift_norm": np.linalg.norm(Y.mean(0)),
                "q_avg_cos": avg_cos(Q),
                "softmax_max": p.max(-1).mean(),
                "softmax_median": np.median(p, axis=-1).mean(),
                "softmax_min": p.min(-1).mean(),
            }
        )
    return out


VARIANTS = [("post-ln", "after-norm"), ("post-ln", "before-norm"), ("pre-ln", "after-norm")]


@pytest.mark.parametrize(("block", "measure"), VARIANTS)
def test_each_block_and_measure_matches_a_plain_block(block, measure):
    cfg = config(init_std=0.1, block=block, measure=measure, norms=(0.0, 4.0, 12.0, 30.0, 60.0))
    got = run_drift_block(cfg, None)
    want = plain_block(cfg, 0)
    for row, ref in zip(got.rows, want, strict=True):
        assert (row.block, row.measure) == (block, measure)
        for name, value in ref.items():
            assert getattr(row, name) == pytest.approx(value, rel=2e-4, abs=2e-6), (row.norm, name)
    star = crossing(list(cfg.norms), [r["in_mean_norm"] for r in want], [r["out_mean_norm"] for r in want])
    assert got.n_star == pytest.approx(star, rel=1e-4, nan_ok=True)


def test_the_norm_note_exactly_when_the_block_ends_in_a_norm():
    cfg = config(init_std=0.1, norms=(0.0, 12.0))
    ends = run_drift_block(cfg, None)
    # what the note claims: the output LayerNorm (weight 1, bias 0) pins the norm at ~sqrt(d)
    assert [r.out_mean_norm for r in ends.rows] == pytest.approx([math.sqrt(cfg.hidden)] * 2, rel=1e-5)
    assert sum("ends in its output LayerNorm" in n for n in ends.notes) == 1
    for block, measure in VARIANTS[1:]:
        other = run_drift_block(config(init_std=0.1, norms=(0.0, 12.0), block=block, measure=measure), None)
        assert not any("LayerNorm" in n for n in other.notes), (block, measure)
        # attention of the post-ln block is the same whichever output is measured
        if block == "post-ln":
            assert [r.softmax_max for r in other.rows] == [r.softmax_max for r in ends.rows]
            assert other.rows[1].out_mean_norm != pytest.approx(math.sqrt(cfg.hidden), rel=1e-3)


def test_cli_says_so_in_the_output(tmp_path, capsys):
    base = ["experiment", "drift-block", *SMALL_FLAGS, "--norms", "0,12", "--no-cache", "-q"]
    assert main(base) == 0
    assert "ends in its output LayerNorm" in capsys.readouterr().out.replace("\n", " ")
    for extra in (["--measure", "before-norm"], ["--block", "pre-ln"]):
        assert main([*base, *extra]) == 0
        out = capsys.readouterr().out
        assert "ends in its output" not in out.replace("\n", " ") and extra[1] in out


def test_default_block_keeps_the_earlier_cache_key():
    cfg = config()
    earlier = {  # the key's fields before --block and --measure existed
        "experiment": "drift-block",
        "schema": db.SCHEMA,
        "torch": db._version("torch"),
        "transformers": db._version("transformers"),
        "dtype": "float32",
        "seed": 0,
        **{k: v for k, v in cfg.settings().items() if k not in ("block", "measure")},
    }
    assert (
        cfg.key(0)
        == __import__("hashlib").sha256(json.dumps(earlier, sort_keys=True).encode()).hexdigest()[:32]
    )
    keys = {config(block=b, measure=m).key(0) for b, m in VARIANTS}
    assert len(keys) == 3


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--block", "mid-ln"], "--block"),
        (["--measure", "inside"], "--measure"),
        (["--block", "pre-ln", "--measure", "before-norm"], "--measure before-norm"),
    ],
)
def test_bad_block_or_measure_exits_2(capsys, flags, flag):
    code = main(["experiment", "drift-block", *SMALL_FLAGS, *flags, "--no-cache"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and flag in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_lab_settings_take_block_and_measure():
    from isotui.tui.lab_drift import parse_settings

    cfg = parse_settings("hidden=32 heads=4 block=pre-ln")
    assert (cfg.block, cfg.measure) == ("pre-ln", "after-norm")
    assert parse_settings("measure=before-norm").measure == "before-norm"
    with pytest.raises(IsotuiError, match="block"):
        parse_settings("block=sandwich")


# ----------------------------------------------------------------------------- Fig. 7's range


def test_seeds_histograms_merge_exactly_on_a_common_grid(result):
    """Three seeds' histograms of one N sit on one grid (each seed's own, coarsened exactly) and
    each still equals np.histogram of that seed's plain scores on it."""
    multi = run_drift_block(config(init_std=0.1, seeds=(0, 1, 2)), None)
    cfg = multi.config
    for seed_index, seed in enumerate(multi.seeds):
        ref = reference(cfg, seed)
        for i in range(len(cfg.norms)):
            assert_binned_like_numpy(multi.score_hist[seed_index, i], multi.score_edges[i], ref[i]["_scores"])
    # the common grid is a coarsening of seed 0's own: power-of-two widths, aligned edges
    for i in range(len(cfg.norms)):
        own, common = np.diff(result.score_edges[i])[0], np.diff(multi.score_edges[i])[0]
        ratio = common / own
        assert ratio >= 1 and ratio == 2 ** round(math.log2(ratio))
        assert np.all(np.mod(multi.score_edges[i], common) == 0)


class _Plt:
    """Records what a figure draws (plotext's calls the lab makes; the rest do nothing)."""

    def __init__(self) -> None:
        self.bars: list[tuple[list[float], list[float]]] = []

    def bar(self, xs, heights, **_kw) -> None:
        self.bars.append((list(xs), list(heights)))

    def __getattr__(self, _name):
        return lambda *a, **k: None


def fig7_bars(result, row: int, log: bool) -> tuple[list[float], list[float]]:
    """The bars the lab's Drift tab draws for Fig. 7 at table row ``row``."""
    from types import SimpleNamespace

    from isotui.tui.lab_drift import plot_drift

    plt = _Plt()
    widgets = {
        # a plot tall enough that no bar is under half a row (those are left out on screen)
        "#drift-fig": SimpleNamespace(
            plt=plt, refresh=lambda: None, size=SimpleNamespace(width=200, height=10**6)
        ),
        "#drift-table": SimpleNamespace(cursor_row=row),
    }
    screen = SimpleNamespace(
        app=SimpleNamespace(lab_results={"drift-block": result}),
        query_one=lambda selector, _type=None: widgets[selector],
        drift_figure=1,
        log_counts=log,
        app_colours=lambda: ["cyan", "orange", "green", "red"],
    )
    plot_drift(screen)
    assert len(plt.bars) == 1
    return plt.bars[0]


def test_fig7_at_small_d_spreads_over_many_bars():
    """At BERT's init and d=32 the scores lie within about 1e-5 of 0: the fixed asinh bins held
    them in a handful of bars; the data's range gives Fig. 7 many, each checked against
    np.histogram of the plainly computed scores on the same edges."""
    from isotui.core.attention import score_edges
    from isotui.experiments.drift_block.view import score_bars
    from isotui.figures import histogram_bars

    cfg = config(hidden=32, heads=4, intermediate=64, init_std=0.02, norms=(0.0, 5.0))
    got = run_drift_block(cfg, None)
    ref = reference(cfg, 0)
    for i in range(len(cfg.norms)):
        scores = ref[i]["_scores"].reshape(-1)
        counts, edges = score_bars(got, i)
        width = np.diff(edges)
        assert np.allclose(width, width[0], rtol=1e-9) and len(edges) - 1 <= 60
        plain, _ = np.histogram(scores, edges)
        plain[-1] -= (scores == edges[-1]).sum()
        near = np.abs(scores[:, None] - edges[None, :]).min(1) < 1e-6 * np.abs(scores).max()
        assert np.abs(counts[1:-1] - plain).sum() <= 2 * near.sum() and near.mean() < 0.01
        outside = (scores < edges[0]).sum() + (scores >= edges[-1]).sum()
        assert abs(counts[0] + counts[-1] - outside) <= near.sum()
        assert counts[0] + counts[-1] <= 0.002 * len(scores) + 2  # only the thin tails left out
        _, heights = fig7_bars(got, i, log=False)
        assert sum(h > 0 for h in heights) >= 20, heights
        assert sum(heights) == pytest.approx(counts[1:-1].sum(), rel=0.002)
        _, log_heights = fig7_bars(got, i, log=True)  # the l key: log10(1 + count), same bars
        assert log_heights == pytest.approx([math.log10(1 + h) for h in heights])
    # what the fixed bins showed for the same scores (the six-bar Fig. 7 this replaces)
    old, _ = np.histogram(ref[0]["_scores"].reshape(-1), score_edges())
    _, old_heights = histogram_bars(np.concatenate([[0], old, [0]]), score_edges())
    assert sum(h > 0 for h in old_heights) < 20


def test_range_histograms_of_different_scales_merge_exactly():
    """Histograms whose ranges differ a thousandfold (and one with a constant value, one with
    non-finite values) merge onto one grid where each still equals np.histogram of its values."""
    from isotui.core.attention import merge_range_histograms, range_histogram

    rng = np.random.default_rng(0)
    values = [
        rng.normal(0.0, 1e-5, 5000),
        rng.normal(0.3, 1e-2, 5000),
        np.full(100, 0.25),
        np.array([-np.inf, 0.1, np.inf, np.nan, -0.2]),
    ]
    hists = [range_histogram([torch.tensor(v, dtype=torch.float32)], bins=64) for v in values]
    for v, h in zip(values, hists, strict=True):  # each on its own data range: fine and full
        assert h.edges()[0] <= np.nanmin(v[np.isfinite(v)]) and np.nanmax(v[np.isfinite(v)]) < h.edges()[-1]
    merged = merge_range_histograms(hists, bins=64)
    edges = merged[0].edges()
    assert all(np.array_equal(m.edges(), edges) for m in merged)
    for v, m in zip(values, merged, strict=True):
        x = v.astype(np.float32).astype(np.float64)
        finite = x[np.isfinite(x)]
        counts, _ = np.histogram(finite, edges)
        assert m.counts[0, 1:-1].tolist() == counts.tolist()
        assert m.counts[0, 0] == (x == -np.inf).sum()
        assert m.counts[0, -1] == np.isposinf(x).sum() + np.isnan(x).sum()


def test_statistics_run_at_one_thread_and_the_callers_threads_are_kept(monkeypatch):
    """On the CPU the statistics run at one torch thread (each op split over threads waits for a
    core another process holds); the forward and the caller keep their own thread count."""
    import isotui.core.attention as attention

    seen: list[int] = []
    real = attention.row_stats

    def spy(probs, allowed=None):
        seen.append(torch.get_num_threads())
        return real(probs, allowed)

    monkeypatch.setattr(attention, "row_stats", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_drift_block(config(norms=(0.0, 4.0)), None)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}


def test_the_help_quotes_no_time_that_can_go_stale():
    """Issue 37: ``--help`` said "about 3 minutes" per seed where the docs measure 51 s: the help
    now points at the measurement instead of pasting a number."""
    import re
    from pathlib import Path

    from isotui.experiments.drift_block.params import HELP

    assert not re.search(r"\d\s*(minutes?|min|seconds?|s)\b", HELP)
    assert "docs/experiments/attention.md" in HELP
    docs = (Path(__file__).parents[1] / "docs" / "experiments" / "attention.md").read_text(encoding="utf-8")
    assert "The BERT-base default takes" in docs and "benchmarks/drift_block.py" in docs
