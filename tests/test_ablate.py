"""``isotui experiment ablate`` (issue 39) against an independent computation.

Every number is checked against plain torch run here, one sample at a time and without padding
(Hugging Face's own ``labels=`` loss for a causal LM, a masked cross-entropy by hand for a masked
LM, the edits as forward hooks written here) and numpy (the site's mean, covariance and
eigenvectors, each dimension's share of avg_cos, avg_cos over all pairs of kept tokens). Only the
random baselines' directions and the masked LM's masks are read from isotui (they are seeded
conventions, not numbers to check); what they do to the loss is computed here.

Bounds. The losses are float32 forwards (isotui's batched and padded, ours one sample at a
time): measured, the clean loss agrees to ~5e-8 relative and a loss difference to ~6e-7 in
absolute terms (the float32 resolution of a ~9 nat loss), so the clean loss is held to 1e-6
relative (the issue asks 1e-4) and each delta to ``DELTA_ABS + 1e-5 |delta|`` (a tenth of the
issue's 2% bar or less for every delta checked, which the test asserts too). Cosines and
avg_cos are float64 sums of float32 vectors: 1e-7 absolute (measured ~1e-11).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re

import numpy as np
import pytest

import isotui
from isotui.cli import main
from isotui.errors import IsotuiError

from .conftest import corpus, same

N = 30  # samples
MAX_LEN = 32  # the tiny models' positions (train-tiny --seq-len)
DELTA_ABS = 5e-6  # nats: ~10x the measured float32 disagreement of two ~9 nat losses
COS_ABS = 1e-7
GPT2_SITE = "transformer.h.0"
BERT_SITE = "bert.encoder.layer.0"
REMOVE = ["mean", "pc:2", "rogue:3", "dims:0,5"]


@pytest.fixture(scope="session")
def tiny_lms(tmp_path_factory):
    """A 60-step train-tiny GPT-2 (causal LM) and BERT (masked LM): width 32, 2 blocks.
    (Both use the bundled MiniLM's WordPiece tokenizer: [CLS] ... [SEP] around each sample,
    the special tokens the kept tokens leave out.)"""
    root = tmp_path_factory.mktemp("ablate-lms")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        for arch in ("gpt2", "bert"):
            args = [
                "train-tiny",
                "--out",
                str(root / arch),
                "--arch",
                arch,
                "--steps",
                "60",
                "--save-at",
                "60",
            ]
            tiny = ["--hidden", "32", "--layers", "2", "--heads", "2", "--seq-len", str(MAX_LEN), "--quiet"]
            with contextlib.redirect_stdout(io.StringIO()):
                assert main([*args, *tiny]) == 0
            out[arch] = root / arch / "step_000060"
    return out


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    lines = corpus(N)
    path = tmp_path_factory.mktemp("ablate-data") / "t.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return lines, f"text:{path}"


def ablate(model, data, remove, modules, **options):
    return isotui.experiment(
        "ablate", model=str(model), data=data, remove=remove, modules=modules, max_length=MAX_LEN, **options
    )


@pytest.fixture
def captured(monkeypatch):
    """The (edit, random baseline) pairs isotui makes, in row order (to apply them ourselves)."""
    from isotui.experiments.ablate import measure

    made = []
    original = measure.changes

    def changes(removal, moments, rng):
        pair = original(removal, moments, rng)
        made.append(pair)
        return pair

    monkeypatch.setattr(measure, "changes", changes)
    return made


class Reference:
    """The model run here one sample at a time; ``run(edit)`` gives the loss and every hidden
    state's kept vectors (float64), with ``edit`` (a tensor -> tensor function) applied to the
    site's output by a hook of ours."""

    def __init__(self, folder, texts, arch, seed=0):
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

        from isotui.extract.objective import mlm_mask

        self.arch = arch
        tok = AutoTokenizer.from_pretrained(str(folder))
        cls = AutoModelForMaskedLM if arch == "bert" else AutoModelForCausalLM
        self.model = cls.from_pretrained(str(folder)).eval()
        self.samples = []  # (input ids as fed, labels or None, kept positions, clean input ids)
        for s, text in enumerate(texts):
            enc = tok(
                text,
                truncation=True,
                max_length=MAX_LEN,
                return_special_tokens_mask=True,
                return_tensors="pt",
            )
            ids, special = enc["input_ids"], enc["special_tokens_mask"].bool()
            keep = ~special[0]
            if arch == "bert":  # isotui's documented masks: mlm_mask(seed, sample, positions, candidates)
                masked = mlm_mask(seed, torch.tensor([s]), torch.arange(ids.shape[1]), ~special)
                labels = torch.where(masked, ids, -100)
                self.samples.append((torch.where(masked, tok.mask_token_id, ids), labels, keep, ids))
            else:
                self.samples.append((ids, None, keep, ids))
        if arch == "bert":
            self.site = self.model.bert.encoder.layer[0]
            self.layers = [self.model.bert.encoder.layer[0], self.model.bert.encoder.layer[1]]
        else:
            self.site = self.model.transformer.h[0]
            self.layers = [self.model.transformer.h[0], self.model.transformer.ln_f]

    def run(self, edit=None, clean_inputs=False):
        """(mean loss per predicted token, [embeddings, site, last hidden state] kept vectors)."""
        import torch

        got: list[list[np.ndarray]] = [[], [], []]
        keep_now = []

        def first(t):
            return t[0] if isinstance(t, tuple) else t

        def edit_hook(_m, _args, out):
            h = edit(first(out))
            return (h, *out[1:]) if isinstance(out, tuple) else h

        def record(i):
            def hook(_m, args, out):
                if i == 0:
                    got[0].append(args[0][0][keep_now[-1]].double().numpy())
                got[i + 1].append(first(out)[0][keep_now[-1]].double().numpy())

            return hook

        handles = [self.site.register_forward_hook(edit_hook)] if edit is not None else []
        handles += [layer.register_forward_hook(record(i)) for i, layer in enumerate(self.layers)]
        total, count = 0.0, 0
        try:
            with torch.no_grad():
                for ids, labels, keep, clean in self.samples:
                    keep_now.append(keep)
                    if self.arch == "bert":
                        logits = self.model(input_ids=clean if clean_inputs else ids).logits[0]
                        at = labels[0] >= 0  # the masked positions: cross-entropy by hand
                        logp = torch.log_softmax(logits[at].double(), -1)
                        total += float(-logp[torch.arange(int(at.sum())), labels[0][at]].sum())
                        count += int(at.sum())
                    else:  # Hugging Face's own convention: the mean over the sample's predicted tokens
                        out = self.model(input_ids=ids, labels=ids)
                        total += float(out.loss) * (ids.shape[1] - 1)
                        count += ids.shape[1] - 1
        finally:
            for h in handles:
                h.remove()
        return total / count, [np.concatenate(g) for g in got]


def avg_cos(x):
    """The mean cosine over all ordered pairs i != j (the full n x n matrix)."""
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    c = u @ u.T
    n = len(u)
    return float((c.sum() - np.trace(c)) / (n * (n - 1)))


def final_change(clean, edited):
    cos = (clean * edited).sum(1) / (np.linalg.norm(clean, axis=1) * np.linalg.norm(edited, axis=1))
    return float(np.mean(1.0 - cos))


def shift(v):
    import torch

    return lambda h: h - torch.as_tensor(v, dtype=h.dtype)


def project_out(basis):
    import torch

    def edit(h):
        b = torch.as_tensor(basis, dtype=h.dtype)
        return h - (h @ b) @ b.T

    return edit


def set_dims(dims, values):
    def edit(h):
        import torch

        h = h.clone()
        h[..., list(dims)] = torch.as_tensor(values, dtype=h.dtype)
        return h

    return edit


def check_delta(got, want, bar=True):
    """``got`` within ``DELTA_ABS + 1e-5 |want|`` of ``want``; with ``bar``, a tolerance within
    the issue's 2% of the delta (a removal's delta is large enough for that; a random
    baseline's may not be)."""
    tol = DELTA_ABS + 1e-5 * abs(want)
    assert not bar or tol <= 0.02 * abs(want), f"delta {want} is too small to check to 2%"
    assert abs(got - want) <= tol, f"{got} != {want} (tolerance {tol:.2g})"


def check_run(row, curves, ref, clean_loss, clean_h, edit, random_edit, bar=True):
    """One row against the reference: its edit's and its random baseline's loss, final change,
    recovery and every layer's avg_cos and drift."""
    loss_a, h_a = ref.run(edit)
    loss_r, h_r = ref.run(random_edit)
    check_delta(row.delta_loss, loss_a - clean_loss, bar)
    check_delta(row.delta_loss_random, loss_r - clean_loss, bar=False)
    assert row.loss_ablated == pytest.approx(loss_a, rel=1e-6)
    assert row.loss_random == pytest.approx(loss_r, rel=1e-6)
    assert row.final_change == pytest.approx(final_change(clean_h[-1], h_a[-1]), rel=1e-5, abs=COS_ABS)
    assert row.final_change_random == pytest.approx(final_change(clean_h[-1], h_r[-1]), rel=1e-5, abs=COS_ABS)
    assert row.recovery == pytest.approx(avg_cos(h_a[-1]) / avg_cos(clean_h[-1]), rel=1e-6)
    assert row.layer == 1
    for got, want in ((curves.avg_cos, h_a), (curves.avg_cos_random, h_r)):
        assert got == pytest.approx([avg_cos(x) for x in want], abs=COS_ABS)
    for got, want in ((curves.drift_norm, h_a), (curves.drift_norm_random, h_r)):
        assert got == pytest.approx([np.linalg.norm(x.mean(0)) for x in want], rel=1e-5, abs=1e-7)


def test_gpt2_every_removal_matches_plain_torch_and_numpy(tiny_lms, texts, captured):
    lines, data = texts
    result = ablate(tiny_lms["gpt2"], data, REMOVE, [GPT2_SITE]).result
    ref = Reference(tiny_lms["gpt2"], lines, "gpt2")
    clean_loss, clean_h = ref.run()
    x = clean_h[1]  # the site's kept vectors: [CLS] and [SEP] left out
    assert result.objective == "causal" and result.notes == []
    assert result.meta["n_samples"] == N and result.meta["n_tokens"] == len(x)
    assert result.meta["loss_tokens"] == sum(len(s[0][0]) - 1 for s in ref.samples)
    assert [r.remove for r in result.rows] == REMOVE and {r.site for r in result.rows} == {GPT2_SITE}
    for row in result.rows:  # (a) the clean loss: HF's labels= convention over the whole corpus
        assert row.loss == pytest.approx(clean_loss, rel=1e-6)
    assert result.avg_cos == pytest.approx([avg_cos(h) for h in clean_h], abs=COS_ABS)
    assert result.drift_norm == pytest.approx([np.linalg.norm(h.mean(0)) for h in clean_h], rel=1e-5)

    mean = x.mean(0)
    vals, vecs = np.linalg.eigh(np.cov(x, rowvar=False))  # ascending
    assert vals[-2] > 1.05 * vals[-3]  # the top 2 directions are well defined (up to sign)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    n = len(u)
    contrib = (u.sum(0) ** 2 - (u**2).sum(0)) / (n * (n - 1))
    rogue = [int(i) for i in np.argsort(-contrib)[:3]]
    assert contrib.sum() == pytest.approx(avg_cos(x), rel=1e-9)  # the shares add up to avg_cos
    edits = [
        shift(mean),
        project_out(vecs[:, -2:]),
        set_dims(rogue, mean[rogue]),
        set_dims([0, 5], mean[[0, 5]]),
    ]

    assert len(captured) == 4
    (m_edit, m_base), (p_edit, p_base), (r_edit, r_base), (d_edit, d_base) = captured
    # the edits isotui made: numpy's mean; numpy's top-2 eigenvectors up to sign (the same
    # projector); numpy's top-3 dimensions by share of avg_cos, and dims 0, 5, set to their means
    np.testing.assert_allclose(m_edit.shift, mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.abs(p_edit.basis.T @ vecs[:, -2:][:, ::-1]), np.eye(2), atol=1e-5)
    assert list(r_edit.dims) == rogue and list(d_edit.dims) == [0, 5]
    np.testing.assert_allclose(r_edit.values, mean[rogue], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(d_edit.values, mean[[0, 5]], rtol=1e-5, atol=1e-7)
    # the random baselines' sizes: a vector of the mean's norm, K orthonormal directions, as
    # many distinct coordinates set to their own means
    assert np.linalg.norm(m_base.shift) == pytest.approx(np.linalg.norm(mean), rel=1e-6)
    assert p_base.basis.shape == (32, 2)
    np.testing.assert_allclose(p_base.basis.T @ p_base.basis, np.eye(2), atol=1e-12)
    for base, k in ((r_base, 3), (d_base, 2)):
        assert len(set(base.dims)) == k and base.basis is None and base.shift is None
        np.testing.assert_allclose(base.values, mean[list(base.dims)], rtol=1e-6, atol=1e-9)
    baselines = [shift(m_base.shift), project_out(p_base.basis), set_dims(r_base.dims, r_base.values)]
    baselines.append(set_dims(d_base.dims, d_base.values))

    rows, curves = result.rows, result.curves
    assert rows[0].removed == pytest.approx(np.linalg.norm(mean), rel=1e-6)
    assert [r.removed for r in rows[1:]] == [2.0, 3.0, 2.0]
    assert curves[2].dims == rogue and curves[3].dims == [0, 5]
    assert curves[0].dims == curves[1].dims == []
    for row, curve, edit, base in zip(rows, curves, edits, baselines, strict=True):
        check_run(row, curve, ref, clean_loss, clean_h, edit, base)
    # the mean removed at the site: its layer's vectors are centred (avg_cos near 0, no drift)
    assert abs(curves[0].avg_cos[1]) < 0.01 and curves[0].drift_norm[1] < 1e-6


def test_bert_masked_loss_and_mean_removal_match_plain_torch(tiny_lms, texts, captured):
    lines, data = texts
    result = ablate(tiny_lms["bert"], data, ["mean", "pc:1"], [BERT_SITE]).result
    ref = Reference(tiny_lms["bert"], lines, "bert")
    clean_loss, clean_h = ref.run()
    assert result.objective == "masked"
    assert result.meta["loss_tokens"] == sum(int((s[1] >= 0).sum()) for s in ref.samples)
    assert result.rows[0].loss == pytest.approx(clean_loss, rel=1e-6)
    # the clean curves are the masked inputs' (the run the edits are compared with)
    assert result.avg_cos == pytest.approx([avg_cos(h) for h in clean_h], abs=COS_ABS)
    # the directions come from the first pass, on the text as given (no masks), as every metric
    _, unmasked = ref.run(clean_inputs=True)
    x = unmasked[1]
    (m_edit, m_base), (p_edit, p_base) = captured
    np.testing.assert_allclose(m_edit.shift, x.mean(0), rtol=1e-5, atol=1e-7)
    vals, vecs = np.linalg.eigh(np.cov(x, rowvar=False))
    assert vals[-1] > 1.05 * vals[-2]
    vecs = vecs[:, -1:]
    assert abs(float(p_edit.basis[:, 0] @ vecs[:, 0])) == pytest.approx(1.0, abs=1e-6)
    rows, curves = result.rows, result.curves
    check_run(rows[0], curves[0], ref, clean_loss, clean_h, shift(x.mean(0)), shift(m_base.shift))
    # the 60-step BERT barely uses its top direction: a delta of ~1e-5, held to DELTA_ABS only
    check_run(
        rows[1], curves[1], ref, clean_loss, clean_h, project_out(vecs), project_out(p_base.basis), False
    )


def test_random_baseline_is_seeded_and_a_second_call_comes_from_the_cache(tiny_lms, texts):
    _, data = texts
    args = (tiny_lms["gpt2"], data, ["mean", "pc:2"], [GPT2_SITE])
    first = ablate(*args).result
    again = ablate(*args).result
    assert not first.from_cache and again.from_cache
    assert same(first.rows, again.rows) and same(first.curves, again.curves)
    fresh = ablate(*args, cache=False).result  # computed again: the same random directions
    assert not fresh.from_cache and same(fresh.rows, first.rows) and same(fresh.curves, first.curves)
    other = ablate(*args, seed=1, cache=False).result
    for a, b in zip(first.rows, other.rows, strict=True):
        assert a.delta_loss == b.delta_loss and a.removed == b.removed  # the seed moves the baseline only
        assert a.delta_loss_random != b.delta_loss_random


def test_out_of_memory_in_an_edited_run_backs_off_and_counts_every_sample_once(tiny_lms, texts, monkeypatch):
    """Out of memory in the first batch's third edited run (runs 0-2 committed that batch): the
    halves run the model unedited again for the final states but fold nothing twice; every
    number as a run without it (to float32 rounding: other batch shapes)."""
    import torch

    from isotui.experiments.ablate.experiment import parse_removals
    from isotui.experiments.ablate.measure import measure_ablation
    from isotui.experiments.ablate.removal import Change
    from isotui.spec import make_spec

    _, data = texts
    spec = make_spec(str(tiny_lms["gpt2"]), data, max_length=MAX_LEN, batch_size=8)
    removals = parse_removals(["mean", "pc:2"])
    clean = measure_ablation(spec, removals, [GPT2_SITE])
    original = Change.__call__
    calls: list[int] = []

    def call(self, h):
        calls.append(h.shape[0])
        if len(calls) == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, h)

    monkeypatch.setattr(Change, "__call__", call)
    events: list = []
    backed = measure_ablation(spec, removals, [GPT2_SITE], on_progress=events.append)
    assert calls[:3] == [8, 8, 8] and calls[3] == 4  # batch 1's runs 1-2, the failure, then halves
    messages = [e.message for e in events if getattr(e, "message", None)]
    assert any("out of memory on a batch of 8" in m for m in messages), messages
    assert (
        backed.meta["n_tokens"] == clean.meta["n_tokens"]
        and backed.meta["loss_tokens"] == clean.meta["loss_tokens"]
    )
    for a, b in zip(clean.rows, backed.rows, strict=True):
        for name in (
            "loss",
            "loss_ablated",
            "loss_random",
            "final_change",
            "final_change_random",
            "recovery",
        ):
            assert getattr(b, name) == pytest.approx(getattr(a, name), rel=1e-6), name
        for name in ("delta_loss", "delta_loss_random"):
            assert getattr(b, name) == pytest.approx(getattr(a, name), rel=1e-4, abs=DELTA_ABS / 10), name
    for a, b in zip(clean.curves, backed.curves, strict=True):
        assert b.avg_cos == pytest.approx(a.avg_cos, abs=COS_ABS)
        assert b.avg_cos_random == pytest.approx(a.avg_cos_random, abs=COS_ABS)
        assert b.drift_norm == pytest.approx(a.drift_norm, rel=1e-5)
    assert backed.avg_cos == pytest.approx(clean.avg_cos, abs=COS_ABS)


BAD_REMOVE = [
    ("pc:0", "K is a whole number from 1"),
    ("pc:x", "is not one of mean, pc:K"),
    ("dims:", "is not one of mean, pc:K"),
    ("foo", "is not one of mean, pc:K"),
    ("pc:5000", "K is a whole number from 1 to 4,096"),
    ("mean:2", "is not one of mean, pc:K"),
    ("dims:1,1", "dims are distinct coordinates"),
    ("pc:32", "site transformer.h.0 is 32 wide; K must be below 32"),
    ("rogue:40", "K must be below 32"),
    ("dims:0,32", "dimension 32 is not one of them"),
]


@pytest.mark.parametrize("value, says", BAD_REMOVE)
def test_bad_remove_is_one_sentence_exit_2_and_an_isotui_error(tiny_lms, texts, capsys, value, says):
    _, data = texts
    model = str(tiny_lms["gpt2"])
    args = [
        "experiment",
        "ablate",
        "-m",
        model,
        "--data",
        data,
        "--remove",
        value,
        "--modules",
        GPT2_SITE,
        "-q",
    ]
    assert main([*args, "--max-samples", "4", "--max-length", str(MAX_LEN)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2  # one sentence (rich may wrap it once)
    with pytest.raises(IsotuiError, match=re.escape(says)):
        ablate(model, data, [value], [GPT2_SITE], max_samples=4)


def test_a_glob_matching_nothing_an_encoder_decoder_and_other_data_are_refused(tiny_lms, texts):
    _, data = texts
    with pytest.raises(IsotuiError) as glob:
        ablate(tiny_lms["gpt2"], data, ["mean"], ["transformer.nothing.*"], max_samples=4)
    assert "transformer.nothing.*" in str(glob.value)
    t5 = "random:t5:d_model=16,d_ff=32,num_layers=1,num_heads=2,d_kv=8"
    with pytest.raises(IsotuiError, match="encoder-decoder"):
        ablate(t5, data, ["mean"], [], max_samples=4)
    with pytest.raises(IsotuiError, match="give text data"):
        ablate(tiny_lms["gpt2"], "synthetic:images", ["mean"], [GPT2_SITE], max_samples=4)


def test_bundled_minilm_has_no_loss_but_keeps_its_representation_columns(texts):
    _, data = texts
    result = isotui.experiment("ablate", model="minilm", data=data, remove=["mean"], max_samples=6)
    res = result.result
    assert res.objective == "none"
    said = [n for n in res.notes if "no loss" in n]
    assert len(said) == 1 and "MiniLM" in said[0]
    assert len(res.rows) == 6  # every block's output, the default sites
    for row in res.rows:
        assert all(math.isnan(getattr(row, k)) for k in ("loss", "loss_ablated", "delta_loss", "loss_random"))
        assert math.isfinite(row.final_change) and row.final_change > 0 and math.isfinite(row.recovery)
    assert [r["layer"] for r in result.rows] == list(range(1, 7))


def test_rows_cached_on_their_own_are_taken_and_only_the_others_measured(tiny_lms, texts):
    """A request whose rows were partly measured before measures only the new ones (its
    ``forwards``: 1 + 2 per measured row), and gives the cached rows as they were."""
    _, data = texts
    sites = [GPT2_SITE, "transformer.h.1"]
    first = ablate(tiny_lms["gpt2"], data, ["mean"], sites).result
    assert first.meta["forwards"] == 1 + 2 * 2
    both = ablate(tiny_lms["gpt2"], data, ["pc:2", "mean"], sites).result
    assert not both.from_cache and both.meta["forwards"] == 1 + 2 * 2  # the two pc:2 rows alone
    assert [(r.site, r.remove) for r in both.rows] == [(s, w) for s in sites for w in ("pc:2", "mean")]
    kept = {(r.site, r.remove): (r, c) for r, c in zip(both.rows, both.curves, strict=True)}
    for row, curves in zip(first.rows, first.curves, strict=True):
        assert same(kept[row.site, row.remove], (row, curves))
    alone = ablate(tiny_lms["gpt2"], data, ["pc:2"], [GPT2_SITE]).result  # every row cached
    assert alone.from_cache and same(alone.rows[0], kept[GPT2_SITE, "pc:2"][0])
    fresh = ablate(tiny_lms["gpt2"], data, ["pc:2"], [GPT2_SITE], cache=False).result
    assert same(fresh.rows, alone.rows) and same(fresh.curves, alone.curves)


def test_an_input_site_is_edited_before_its_module_runs(tiny_lms, texts):
    """A site read at a module's input (the named site ``norm_in``: every norm's input) is edited
    by a pre-hook: the norm sees the edited tensor, the residual stream beside it does not. Its
    loss against our own pre-hook on the same module subtracting numpy's mean of its kept inputs."""
    import torch

    lines, data = texts
    result = ablate(tiny_lms["gpt2"], data, ["mean"], ["norm_in"]).result
    (row,) = [r for r in result.rows if r.site == "transformer.h.0.ln_1 (input)"]
    assert row.layer == -1
    ref = Reference(tiny_lms["gpt2"], lines, "gpt2")
    clean_loss, _ = ref.run()
    module = ref.model.transformer.h[0].ln_1
    seen = []
    handle = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0][0].double().numpy()))
    try:
        ref.run()
    finally:
        handle.remove()
    kept = np.concatenate(
        [x[keep.numpy()] for x, (_ids, _l, keep, _c) in zip(seen, ref.samples, strict=True)]
    )
    mean = torch.as_tensor(kept.mean(0), dtype=torch.float32)
    assert row.removed == pytest.approx(float(np.linalg.norm(kept.mean(0))), rel=1e-6)
    edited = module.register_forward_pre_hook(lambda _m, args: (args[0] - mean, *args[1:]))
    try:
        loss_a, _ = ref.run()
    finally:
        edited.remove()
    assert row.loss == pytest.approx(clean_loss, rel=1e-6)
    check_delta(row.delta_loss, loss_a - clean_loss)


@pytest.mark.parametrize("name", ["final-norm", "token-types", "gradients", "ablate"])
def test_the_apps_max_length_is_a_ceiling_for_every_pass_on_the_layer(tiny_lms, texts, name):
    """The app asks for its max length as a ceiling (``cap_max_length``): a model with fewer
    positions (the tiny GPT-2's 32) runs at its own limit in every experiment that opens a text
    pass (layer_pass.text_stream), and says so, as the layer run does; asked as a flag, it is
    refused."""
    from dataclasses import replace

    from isotui.experiments.base import Context
    from isotui.experiments.registry import get
    from isotui.spec import make_spec

    _, data = texts
    exp = get(name)
    spec = make_spec(str(tiny_lms["gpt2"]), data=data, max_samples=6, max_length=4 * MAX_LEN)
    with pytest.raises(IsotuiError, match=r"max.length"):
        exp.request(spec, exp.params()).compute(Context())
    said: list[str] = []
    context = Context(on_progress=lambda p: said.append(p.message) if p.stage == "notice" else None)
    capped = exp.request(replace(spec, cap_max_length=True), exp.params()).compute(context)
    assert capped is not None
    assert f"capped at its {MAX_LEN} positions" in " ".join(said)  # said, as the layer run says it


@pytest.mark.slow
def test_the_ablate_benchmark_times_both_sides_and_their_loss_changes_agree(tiny_lms, tmp_path):
    """``benchmarks/ablate.py`` at a tiny size: the hand-written ablation and `isotui experiment
    ablate` over the same text, the ratio, and each side's loss change (equal to float32
    rounding: the plain script is the test's independent check of the mean removal, batched)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, str(root / "benchmarks" / "ablate.py"), str(tiny_lms["gpt2"]), "--samples", "20"]
    argv += ["--max-length", str(MAX_LEN)]
    env = dict(os.environ, PYTHONPATH=str(root), ISOTUI_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1].split()
    ratio, plain_delta, ours_delta = last[-3], float(last[-2]), float(last[-1])
    assert re.fullmatch(r"\d+\.\d\dx", ratio)
    assert ours_delta == pytest.approx(plain_delta, rel=1e-3, abs=2e-6)


def test_sizes_are_refused_before_the_passes(monkeypatch):
    """A removal wider than its site is refused at the first batch, not after the whole first
    pass; more sites x removals than ablate takes are refused before any batch runs."""
    from isotui.experiments.ablate.removal import MAX_ROWS
    from isotui.extract.loop import BatchLoop

    batches = []
    attempt = BatchLoop._attempt

    def counted(self, step, idx, ledger=None):
        batches.append(len(idx))
        return attempt(self, step, idx, ledger)

    monkeypatch.setattr(BatchLoop, "_attempt", counted)
    model = "random:gpt2:n_layer=2,n_embd=32,n_head=2"
    run = {"model": model, "max_samples": 8, "batch_size": 2, "cache": False}
    for remove, said in (("dims:0,40", "dimension 40 is not one of them"), ("pc:32", "K must be below 32")):
        batches.clear()
        with pytest.raises(IsotuiError, match=said):
            isotui.experiment("ablate", remove=remove, modules="transformer.h.0", **run)
        assert batches == [2]  # the first batch, not the first pass's four
    batches.clear()
    many = [f"dims:{i}" for i in range(MAX_ROWS // 2 + 1)]
    with pytest.raises(IsotuiError, match=f"2 sites x {len(many)} removals .* at most {MAX_ROWS:,}"):
        isotui.experiment("ablate", remove=many, **run)
    assert batches == []
    with pytest.raises(IsotuiError, match=f"{MAX_ROWS + 1} removals"):
        isotui.experiment("ablate", remove=[f"dims:{i}" for i in range(MAX_ROWS + 1)], **run)


def test_each_site_names_the_hidden_state_it_gives(tiny_lms, texts):
    """``layer``: block i's output is hidden state i + 1, but GPT-2's last block (ln_f follows it:
    its last hidden state is the norm's output) is none (-1); BERT's last block's output is its
    last hidden state. Where a row names one, that hidden state after the edit is the centred
    site: its mean's norm (drift) is ~0 after the mean is removed (GPT-2's: BERT's edited runs
    read masked inputs, whose mean is not the unmasked text's the directions come from)."""
    _, data = texts
    gpt2 = ablate(tiny_lms["gpt2"], data, ["mean"], []).result
    bert = ablate(tiny_lms["bert"], data, ["mean"], []).result
    assert [r.layer for r in gpt2.rows] == [1, -1]
    assert [r.layer for r in bert.rows] == [1, 2]
    row, curves = gpt2.rows[0], gpt2.curves[0]
    assert curves.drift_norm[1] < 1e-5 * row.removed
    assert gpt2.drift_norm[1] == pytest.approx(row.removed, rel=1e-6)


def test_the_dry_run_says_the_forwards_the_run_makes(tiny_lms, texts, tmp_path, capsys):
    """``--dry-run`` from the config alone: each batch once in the first pass and 1 + 2 x sites x
    removals times in the second, as the run's meta counts them; the sites' sums hold an exact
    covariance only when a pc:K asks for one; a glob is refused (its sites are known only when the
    model runs), the default sites and plain module names are planned."""
    import json

    _, data = texts
    model = str(tiny_lms["gpt2"])
    out = tmp_path / "plan.json"
    argv = ["experiment", "ablate", "-m", model, "--data", data, "--remove", "mean", "pc:2", "--dry-run"]
    assert main([*argv, "--json", str(out)]) == 0
    (plan,) = json.loads(out.read_text(encoding="utf-8")).values()  # keyed by the model's label
    said = json.dumps(plan)
    run = ablate(tiny_lms["gpt2"], data, ["mean", "pc:2"], []).result
    assert run.meta["forwards"] == 1 + 2 * 2 * 2
    assert f"{run.meta['forwards']} times in the second" in said
    parts = {p["name"]: p for p in plan["parts"]}
    assert (
        set(parts) == {"2 sites", "clean run", "8 edited runs"}
        and "exact covariance" in parts["2 sites"]["what"]
    )
    assert main([*argv[:-4], "--remove", "mean", "--modules", "transformer.h.*", "--dry-run"]) == 2
    assert "known only when the model runs" in capsys.readouterr().err
    assert main([*argv[:-4], "--remove", "mean", "--modules", "transformer.h.0", "--dry-run"]) == 0
    assert "3 times in the second" in capsys.readouterr().out


def test_a_site_returning_a_model_output_is_edited_in_it(tiny_lms, texts):
    """A module that returns a transformers ModelOutput (BERT's whole encoder) is edited in its
    first field, where it used to pass the first pass and fail the second: the loss moves as
    subtracting the mean from the encoder's output in our own hook moves it."""
    import torch

    lines, data = texts
    row = ablate(tiny_lms["bert"], data, ["mean"], ["bert.encoder"]).result.rows[0]
    ref = Reference(tiny_lms["bert"], lines, "bert")
    clean_loss, _ = ref.run()
    seen: list[np.ndarray] = []
    encoder = ref.model.bert.encoder
    keep = encoder.register_forward_hook(lambda _m, _i, out: seen.append(out[0][0].double().numpy()))
    try:
        ref.run(clean_inputs=True)  # the directions come from the unmasked text
    finally:
        keep.remove()
    kept = np.concatenate([x[k.numpy()] for x, (_ids, _l, k, _c) in zip(seen, ref.samples, strict=True)])
    mean = torch.as_tensor(kept.mean(0), dtype=torch.float32)

    def edit(_m, _i, out):
        out["last_hidden_state"] = out["last_hidden_state"] - mean
        return out

    hook = encoder.register_forward_hook(edit)
    try:
        loss_a, _ = ref.run()
    finally:
        hook.remove()
    assert row.layer == -1 and row.loss == pytest.approx(clean_loss, rel=1e-6)
    check_delta(row.delta_loss, loss_a - clean_loss)


def _flat(x):
    """Every number of rows, curves and lists, in order."""
    import dataclasses

    if dataclasses.is_dataclass(x):
        return _flat(list(dataclasses.asdict(x).values()))
    if isinstance(x, list | tuple):
        return [v for item in x for v in _flat(item)]
    return [float(x)] if isinstance(x, int | float) else []


def test_shards_merge_to_the_one_process_numbers_and_then_answer_from_the_cache(tiny_lms, texts):
    """``shard="I/K"``: each shard's first pass over every sample (the same directions), its
    edited pass over its own slice; the last of the K merges them into the one-process result,
    stored as an unsharded run's (a plain call then answers from the cache).

    Bound. One sample per batch (``batch_size=1``) makes every forward, and each sample's
    float32 loss sum, bit-identical in the shards and the plain run (the default batching pads
    other batches, and a batch's loss is one float32 sum: measured, the losses then agree to
    float32 rounding, ~4e-8 relative, the geometry to 1e-16). What is left is float64 sums of
    30 samples' terms added in another order, and the accumulators' re-centring: ~1e-15 of a
    sum, and the smallest number checked (a delta of ~7e-4 nats, from two ~9 nat losses) keeps
    it under ~1e-11 relative; measured 6e-16. 1e-9 leaves room, and catches a sample counted
    twice or lost (~3%)."""
    from pathlib import Path

    _, data = texts
    args = (tiny_lms["gpt2"], data, ["mean", "pc:2"], [GPT2_SITE, "transformer.h.1"])
    plain = ablate(*args, cache=False, batch_size=1).result
    parts = [ablate(*args, shard=f"{i}/3", batch_size=1) for i in range(3)]
    assert [len(p.results) for p in parts] == [0, 0, 1]  # the last to finish merges
    merged = parts[-1].result
    got, want = (
        np.array(_flat([merged.rows, merged.curves, merged.avg_cos, merged.drift_norm])),
        np.array(_flat([plain.rows, plain.curves, plain.avg_cos, plain.drift_norm])),
    )
    assert got.shape == want.shape and np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=0)
    assert merged.meta["n_samples"] == N and merged.meta["n_tokens"] == plain.meta["n_tokens"]
    assert "merged from 3 shards" in merged.notes
    folder = Path(os.environ["ISOTUI_CACHE_DIR"]) / "ablate"
    assert list(folder.glob("*.safetensors")) and not list(folder.glob("*-of-*")), "partial states removed"
    again = ablate(*args, batch_size=1).result  # a plain call: the merged result, from the cache
    assert again.from_cache and same(again.rows, merged.rows) and same(again.curves, merged.curves)
    row = ablate(tiny_lms["gpt2"], data, ["pc:2"], ["transformer.h.1"], batch_size=1).result
    assert row.from_cache and same(row.rows[0], merged.rows[-1])  # each row stored on its own too
    with pytest.raises(IsotuiError, match=r"^shard 4/3 does not exist: shards count from 0 [^\n]*$"):
        ablate(*args, shard="4/3")


def test_a_merge_names_the_model_as_its_run_asks_and_leaves_no_partial_state(tiny_lms, texts, tmp_path):
    """The merging shard's result names the model as that run asks (a shard before it may have
    named the same folder otherwise), and once the whole result is kept no partial state of its
    key is left: not the merged K's, not an unfinished set of another K."""
    from pathlib import Path

    _, data = texts
    link = tmp_path / "same-model"
    link.symlink_to(tiny_lms["gpt2"], target_is_directory=True)
    args = (data, ["mean"], [GPT2_SITE])
    assert ablate(tiny_lms["gpt2"], *args, shard="0/3").results == []  # another K, never finished
    assert ablate(tiny_lms["gpt2"], *args, shard="0/2").results == []
    merged = ablate(link, *args, shard="1/2").result
    assert merged.model == str(link) and {r.model for r in merged.rows} == {str(link)}
    folder = Path(os.environ["ISOTUI_CACHE_DIR"]) / "ablate"
    assert not list(folder.glob("*-of-*")), "every partial state of the key removed"
