"""The attention statistics' fast paths (issue 15) against numpy: the sort-free row median over
any mask, float64 sums taken a chunk at a time, score sums with the mask at its own shape or none,
and the data-ranged histogram's float32 path."""

from __future__ import annotations

import math

import numpy as np
import pytest


def _masks(torch, b, t, s, gen):
    """Padding, causal, random (with rows that allow nothing) and no mask."""
    padding = torch.ones(b, 1, t, s, dtype=torch.bool)
    padding[0, :, :, s - s // 3 :] = False
    causal = torch.ones(t, s, dtype=torch.bool).tril(s - t)[None, None]
    noisy = torch.rand(b, 1, t, s, generator=gen) < 0.6
    noisy[-1, :, 0] = False  # a row with no allowed key
    return [padding, causal, noisy, None]


@pytest.mark.parametrize("size", [1, 2, 7, 8, 57, 128])
def test_row_stats_match_numpy_for_any_mask_ties_and_length(size):
    import torch

    from isotui.core.attention import row_stats

    gen = torch.Generator().manual_seed(size)
    b, h, t = 3, 2, min(size, 9)
    for mask in _masks(torch, b, t, size, gen):
        for ties in (False, True):
            logits = torch.randn(b, h, t, size, generator=gen) * 3
            if ties:
                logits = logits.round()
            allowed = torch.ones(1, 1, t, size, dtype=torch.bool) if mask is None else mask
            probs = torch.softmax(logits.masked_fill(~allowed, -math.inf), -1)
            stats = row_stats(probs) if mask is None else row_stats(probs, mask)
            mx, md, mn, ent = (x.numpy() for x in stats)
            p, ok = probs.numpy(), allowed.expand(b, h, t, size).numpy()
            for idx in np.ndindex(b, h, t):
                v = p[idx][ok[idx]].astype(np.float64)
                if len(v) == 0:
                    assert all(math.isnan(x[idx]) for x in (mx, md, mn, ent))
                    continue
                assert mx[idx] == v.max() and mn[idx] == v.min()
                assert md[idx] == np.median(v)  # the same float32 values, averaged in float64
                nz = v[v > 0]
                assert ent[idx] == pytest.approx(-(nz * np.log(nz)).sum(), rel=1e-5, abs=1e-7)


def test_float64_sums_in_chunks_match_numpy(monkeypatch):
    import torch

    import isotui.core.attention as attention

    monkeypatch.setattr(attention, "CHUNK_ELEMENTS", 40)  # many chunks, a ragged last one
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 7, 13, generator=gen) * 100
    np.testing.assert_allclose(
        attention.row_sums64(x).numpy(), x.numpy().astype(np.float64).sum(-1), rtol=1e-12
    )

    v = torch.randn(4, 3, 11, 6, generator=gen) + 0.5
    v[1, :, 2] = 0.0  # zero vectors: counted, but not in the cosine
    keep = torch.rand(4, 11, generator=gen) < 0.7
    strided = v.transpose(1, 2).contiguous().transpose(1, 2)  # (B, T, H, d) in memory, as BERT's
    for x, mask in ((v, keep), (strided, keep), (v, None)):
        sums = attention.VectorSums(3, 6, torch.device("cpu"))
        sums.add(x, mask)
        mean_norm, bar_norm, avg_cos = sums.summary()
        for h in range(3):
            rows = v[:, h].numpy().astype(np.float64).reshape(-1, 6)
            if mask is not None:
                rows = rows[keep.numpy().reshape(-1)]
            norms = np.linalg.norm(rows, axis=1)
            unit = rows[norms > 0] / norms[norms > 0, None]
            gram = unit @ unit.T
            n = len(unit)
            assert sums.n[h] == len(rows)
            assert mean_norm[h] == pytest.approx(norms.mean(), rel=1e-12)
            assert bar_norm[h] == pytest.approx(np.linalg.norm(rows.mean(0)), rel=1e-12)
            assert avg_cos[h] == pytest.approx((gram.sum() - np.trace(gram)) / (n * (n - 1)), rel=1e-10)


@pytest.mark.parametrize("cpu", [True, False])
def test_row_sums_over_counted_rows_match_numpy(cpu, monkeypatch):
    """The softmax row sums the probe keeps per head (max, median, min, entropy over the kept
    query rows) against numpy row by row, for every mask, ties, per-head masks, and a counted
    row that allows no key (NaN for its head, as the row statistics give)."""
    import torch

    import isotui.core.attention as attention

    monkeypatch.setattr(attention, "CPU_PATHS", cpu)
    monkeypatch.setattr(attention, "SMALL_CHUNK", 23)  # entropy a ragged chunk at a time
    gen = torch.Generator().manual_seed(5)
    b, h, t = 3, 4, 9
    masks = [*_masks(torch, b, t, t, gen)[:3], torch.rand(b, h, t, t, generator=gen) < 0.5]
    for mask in masks:
        for ties, additive in ((False, False), (True, False), (False, True)):
            logits = torch.randn(b, h, t, t, generator=gen) * 4
            logits = logits.round() if ties else logits
            if additive:  # as a float mask adds it: a row that allows nothing comes out uniform
                probs = torch.softmax(logits + (~mask) * torch.finfo(torch.float32).min, -1)
            else:
                probs = torch.softmax(logits.masked_fill(~mask, -math.inf), -1)
            rows = torch.rand(b, t, generator=gen) < 0.7
            rows[-1, 0] = True  # the noisy mask's row that allows no key
            sums = attention.RowSums(h, torch.device("cpu"))
            sums.add(probs, mask, rows)
            got = sums.sums.numpy()
            ok = mask.expand(b, h, t, t).numpy()
            for head in range(h):
                want = np.zeros(4)
                for i, j in zip(*np.nonzero(rows.numpy()), strict=True):
                    v = probs.numpy()[i, head, j][ok[i, head, j]].astype(np.float64)
                    if len(v) == 0:
                        want[:] = np.nan
                        continue
                    nz = v[v > 0]
                    want += [v.max(), np.median(v), v.min(), -(nz * np.log(nz)).sum()]
                np.testing.assert_allclose(got[:3, head], want[:3], rtol=1e-12)
                np.testing.assert_allclose(got[3, head], want[3], rtol=1e-6)
            assert (sums.n.numpy() == rows.sum().item()).all()


@pytest.mark.parametrize("scale", [5.0, 40.0])  # 40: scores past the histogram's +-64 too
def test_score_sums_count_only_the_pairs_that_count(monkeypatch, scale):
    import torch

    import isotui.core.attention as attention

    monkeypatch.setattr(attention, "CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(attention, "SMALL_CHUNK", 20)  # squares two rows at a time, a ragged last
    gen = torch.Generator().manual_seed(1)
    b, h, t = 3, 4, 9
    scores = torch.randn(b, h, t, t, generator=gen) * scale
    edges = attention.score_edges()
    q_keep = torch.rand(b, t, generator=gen) < 0.8
    for mask in _masks(torch, b, t, t, gen):
        pairs = None if mask is None else mask & q_keep[:, None, :, None]
        acc = attention.ScoreSums(h, torch.device("cpu"))
        acc.add(scores, pairs)
        ok = np.ones((b, h, t, t), bool) if pairs is None else pairs.expand(b, h, t, t).numpy()
        for head in range(h):
            v = scores[:, head].numpy()[ok[:, head]].astype(np.float64)
            assert acc.n[head] == len(v)
            assert float(acc.sum[head]) == pytest.approx(v.sum(), rel=1e-12, abs=1e-12)
            assert float(acc.sumsq[head]) == pytest.approx(
                (v.astype(np.float32) ** 2).astype(np.float64).sum(), rel=1e-12
            )
            if len(v):
                assert float(acc.min[head]) == v.min() and float(acc.max[head]) == v.max()
            counts = np.bincount(np.searchsorted(edges, v, side="right"), minlength=len(edges) + 1)
            assert np.abs(acc.hist[head].numpy() - counts).sum() <= 2  # a score within float error of an edge
            assert int(acc.hist[head].sum()) == len(v)


@pytest.mark.parametrize(
    "values",
    [
        np.random.default_rng(0).normal(0, 3e-5, 5000),  # an untrained block's scores: exp < 0
        np.random.default_rng(1).normal(0, 5e3, 5000),  # wider than the bins: exp > 0 (float64 path)
        np.concatenate([np.random.default_rng(2).normal(2, 1, 500), [np.inf, -np.inf, -np.inf, np.nan]]),
        np.full(50, 1234.5),  # one value
    ],
)
@pytest.mark.parametrize("chunk", [1 << 18, 37])
def test_range_histogram_counts_match_numpy(values, chunk, monkeypatch):
    import torch

    import isotui.core.attention as attention
    from isotui.core.attention import RANGE_BINS, range_histogram

    monkeypatch.setattr(attention, "SMALL_CHUNK", chunk)  # the CPU's bins a chunk at a time

    chunks = [
        torch.tensor(values[: len(values) // 2], dtype=torch.float32),
        torch.tensor(values, dtype=torch.float32),
    ]
    hist = range_histogram(chunks)
    for row, chunk in zip(hist.counts, chunks, strict=True):
        x = chunk.numpy().astype(np.float64)
        finite = x[np.isfinite(x)]
        ref = np.zeros(RANGE_BINS + 2, np.int64)
        ref[0] = (x == -np.inf).sum()
        ref[-1] = (x == np.inf).sum() + np.isnan(x).sum()
        inner = np.floor(finite / 2.0**hist.exp).astype(np.int64) - hist.start
        assert inner.min() >= 0 and inner.max() < RANGE_BINS
        ref[1:-1] += np.bincount(inner, minlength=RANGE_BINS)
        np.testing.assert_array_equal(row, ref)


def test_cpu_score_paths_give_the_same_bits_as_the_torch_path(monkeypatch):
    """Drift-block's unmasked scores: the CPU's numpy squares, extremes and bins (a chunk at a
    time) give bit for bit what the torch path a GPU takes gives."""
    import torch

    import isotui.core.attention as attention

    monkeypatch.setattr(attention, "SMALL_CHUNK", 50)
    gen = torch.Generator().manual_seed(3)
    scores = [torch.randn(3, 1, 17, 17, generator=gen) * 1e-3 for _ in range(2)]
    out = {}
    for cpu in (True, False):
        monkeypatch.setattr(attention, "CPU_PATHS", cpu)
        accs = [attention.ScoreSums(1, torch.device("cpu"), histogram=False) for _ in scores]
        for acc, s in zip(accs, scores, strict=True):
            acc.add(s)
        hist = attention.range_histogram(scores)
        out[cpu] = ([acc.state() for acc in accs], hist)
    for a, b in zip(out[True][0], out[False][0], strict=True):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert (out[True][1].exp, out[True][1].start) == (out[False][1].exp, out[False][1].start)
    np.testing.assert_array_equal(out[True][1].counts, out[False][1].counts)


def test_the_cpu_work_buffer_serves_calls_inside_and_outside_inference_mode():
    """The float64 work buffer is kept between calls: made first under inference mode (the
    probe's forward) it must still take in-place writes outside it (drift-block, tests)."""
    import threading

    import torch

    import isotui.core.attention as attention

    def run() -> list[np.ndarray]:
        attention._SCRATCH.__dict__.clear()  # this thread's buffer: none yet
        x = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(1))
        means = []
        for inference in (True, False, True):
            sums = attention.VectorSums(3, 4, torch.device("cpu"))
            with torch.inference_mode(inference):
                sums.add(x)
            means.append(sums.mean())
        want = x.numpy().astype(np.float64).transpose(1, 0, 2, 3).reshape(3, -1, 4).mean(1)
        return [np.abs(m - want).max() for m in means]

    errors: list[list[np.ndarray]] = []
    worker = threading.Thread(target=lambda: errors.append(run()))  # a fresh thread-local buffer
    worker.start()
    worker.join()
    assert len(errors) == 1 and max(errors[0]) < 1e-12
