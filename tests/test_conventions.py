"""scripts/conventions.py: the relations its table claims, on a tiny run (never its numbers)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "conventions.py"


@pytest.fixture(scope="module")
def conv():
    spec = importlib.util.spec_from_file_location("conventions_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONVENTIONS = SCRIPT.parents[1] / "docs" / "conventions.md"  # the docs page that quotes the script
METRICS = SCRIPT.parents[1] / "docs" / "metrics.md"
NUMBER = re.compile(r"[-−]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
ROUNDING_LEVEL = 1e-5  # below: float rounding, whose size varies with the machine's BLAS
MACHINE_ZERO = 1e-12  # below: a float64 difference that is zero to machine precision, either way


def _section() -> str:
    """The conventions page up to its references."""
    text = CONVENTIONS.read_text(encoding="utf-8")
    return text[text.index("# Conventions: isotui beside the papers' code") : text.index("## Citing")]


def _docs_block() -> str:
    section = _section()
    return section[section.index("```text\n") + 8 : section.index("\n```", section.index("```text\n"))]


def _docs_samples() -> int:
    return int(re.search(r"first (\d+) samples", _docs_block()).group(1))


@pytest.fixture(scope="module")
def res(conv):
    """One run on the samples the docs' quoted output states (its tests and the relations' share it).

    At one BLAS and one torch thread: the script's many small d x d eigendecompositions and
    one-sample forwards ran several times slower with two threads waiting on each other on a busy
    machine (an eigh of 384 x 384: 0.6-1.8 s against 0.1 s at load 8). Only the last bits of float
    sums can change, which the comparisons allow for."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:  # the limit is for speed only
            return conv.run(_docs_samples())
        with threadpool_limits(1):
            return conv.run(_docs_samples())
    finally:
        torch.set_num_threads(threads)


def _same_text(quoted: str, fresh: str, where: str) -> None:
    """The same words; each number to its printed digits (rounding-level ones to their order)."""
    # the columns' padding follows the numbers' widths ("0" or "3.053e-16"): words compared alone
    assert NUMBER.sub("#", quoted).split() == NUMBER.sub("#", fresh).split(), (
        f"{where}: the docs {quoted!r}, the script {fresh!r}"
    )
    for q, f in zip(NUMBER.findall(quoted), NUMBER.findall(fresh), strict=True):
        a, b = float(q.replace("−", "-")), float(f.replace("−", "-"))
        if abs(a) < ROUNDING_LEVEL and abs(b) < ROUNDING_LEVEL:
            if max(abs(a), abs(b)) < MACHINE_ZERO:  # 0 on one numpy build, 3e-16 on another
                continue
            assert a and b and abs(math.log10(abs(a) / abs(b))) <= 1, f"{where}: {q} vs {f}"
            continue
        mantissa = q.split("e")[0].lstrip("-−")
        digits = len(mantissa.replace(".", "").lstrip("0")) or 1
        ulp = 10 ** (math.floor(math.log10(abs(a))) - digits + 1) if a else 1e-12
        assert abs(a - b) <= 0.5 * ulp * 1.5 + 1e-12, f"{where}: the docs {q}, the script now {f}"


@pytest.mark.slow
def test_isotui_equals_each_plain_definition(res):
    assert res["n_vectors"] > res["dim"]  # more vectors than dimensions: eigenvectors are unique
    pairs = [
        ("avg_cos", "avg_cos"),
        ("avg_cos_xctx", "avg_cos_xctx"),
        ("drift_norm", "drift_norm"),
        ("mean_norm", "mean_norm"),
        ("avg_cos_centered", "avg_cos_centered"),
        ("eff_rank", "eff_rank"),
        ("top_pc_share", "top_pc_share"),
        ("isoscore", "isoscore_f64"),
        ("iw", "iw_both"),
        ("iw_centered", "iw_centered_both"),
        ("avg_cos_abtt", "abtt_centred"),
        ("avg_cos_std", "avg_cos_std"),
        ("avg_cos_types", "avg_cos_types"),
        ("drift_norm_types", "drift_norm_types"),
        ("intra_sim", "intra_sim"),
        ("null_p95", "null_p95"),
    ]
    for layer in res["layers"]:
        assert layer["isotui"]["n_sample"] == res["n_vectors"]  # the reservoir held every vector
        for mine, plain in pairs:
            assert layer["isotui"][mine] == pytest.approx(layer["plain"][plain], rel=1e-5, abs=1e-9), mine


@pytest.mark.slow
def test_conventions_relations(res):
    for layer in res["layers"]:
        iso, plain = layer["isotui"], layer["plain"]
        # both signs of each eigenvector: a superset of the Z(c) the one-sign convention takes (the
        # same eigenvectors in float64; isotui's own value is within its 1e-5 of the float64 one)
        for both, one in (("iw_both", "iw_one_sign"), ("iw_centered_both", "iw_centered_one_sign")):
            assert plain[both] <= plain[one] * (1 + 1e-12)
        assert iso["iw"] <= plain["iw_one_sign"] * (1 + 1e-5)
        assert iso["iw_centered"] <= plain["iw_centered_one_sign"] * (1 + 1e-5)
        # Ethayarajh's intra-sentence similarity: every sentence, each rounded to 3 decimals
        assert abs(plain["eth_intra_sim"] - iso["intra_sim"]) <= 1e-3 + 1e-12
        # the isoscore package's departure from float64 is its float32 sqrt(d), nothing else
        assert plain["isoscore_pkg"] == pytest.approx(plain["isoscore_f32_sqrt"], abs=1e-12)
        assert abs(plain["isoscore_pkg"] - plain["isoscore_f64"]) < 1e-6


def test_ethayarajh_baseline_expectation_by_enumeration(conv):
    rng = np.random.default_rng(0)
    per_sample = [rng.normal(size=(k, 6)) + 0.7 for k in (3, 5, 2, 4)]
    tokens = [(list(range(len(x))), [f"w{i}" for i in range(len(x))]) for x in per_sample]
    got = conv.ethayarajh(per_sample, tokens, random.Random(0))
    units = [x / np.linalg.norm(x, axis=1, keepdims=True) for x in per_sample]
    # one token per sentence, then two of those M tokens with replacement: a token with itself is 1
    total, m = 0.0, len(units)
    for a, b in itertools.product(range(m), repeat=2):
        total += 1.0 if a == b else float(np.mean(units[a] @ units[b].T))
    assert got["baseline_expected"] == pytest.approx(total / m**2, rel=1e-12)


def test_one_sign_iw_and_original_abtt(conv):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 8)) * np.linspace(0.2, 2.0, 8) + 1.5
    both, one = conv.iw_both_signs(x, False), conv.iw_one_sign(x, False)
    flipped = x @ np.diag([-1.0] * 8)  # the sign choice moves the one-sign value, never isotui's
    assert both <= one and both == pytest.approx(conv.iw_both_signs(flipped, False), rel=1e-9)
    assert math.isfinite(conv.abtt(x, original=True))
    # Mu & Viswanath's projection of the uncentred v leaves the shared vector -U U^T mean
    tilde = x - x.mean(0)
    vals, vecs = np.linalg.eigh(tilde.T @ tilde)
    u = vecs[:, [np.argmax(vals)]].T
    shared = -(x.mean(0) @ u.T) @ u
    orig = tilde - (x @ u.T) @ u
    np.testing.assert_allclose(orig.mean(0), shared, atol=1e-12)
    assert conv.abtt(x, original=False) == pytest.approx(conv.mean_cos(tilde - (tilde @ u.T) @ u), rel=1e-9)


@pytest.mark.slow
def test_docs_quote_the_scripts_output_as_it_is_now(conv, res):
    """The conventions page's output block is what scripts/conventions.py prints on the samples it
    states."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        conv.print_tables(res)
    quoted = [line.rstrip() for line in _docs_block().splitlines()]
    fresh = [line.rstrip() for line in out.getvalue().rstrip("\n").splitlines()]
    assert len(quoted) == len(fresh)
    for i, (q, f) in enumerate(zip(quoted, fresh, strict=True)):
        _same_text(q, f, f"docs/conventions.md's output block, line {i + 1}")


@pytest.mark.slow
def test_docs_table_column_is_the_scripts_claims(conv, res):
    section = _section()
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ")[-1].removesuffix(" |")
        for line in section.splitlines()
        if line.startswith("| `")
    }
    claims = conv.claims(res)
    assert set(rows) == set(claims)
    for key, cell in claims.items():
        _same_text(rows[key], cell, f"docs/conventions.md's table, {key}")
    assert f"on MiniLM ({_docs_samples()} built-in samples" in section


@pytest.mark.slow
def test_isoscore_star_agrees_with_the_package_as_the_docs_say(res):
    """The package's IsoScore* is off by its float32 steps (sqrt(d) and the constants made from it):
    a value in [0, 1] through a handful of float32 roundings of condition about 1, so at most
    10 units of float32 roundoff (2^-24), and not float64-exact. The size within that bound varies
    with the numpy and torch builds (2.7e-8 and 4.4e-8 seen), so the docs say the bound."""
    u32 = 2.0**-24
    gaps = [
        abs(lay["plain"]["isoscore_star_pkg"] - lay["plain"]["isoscore_star_f64"]) for lay in res["layers"]
    ]
    assert 0 < max(gaps) <= 10 * u32
    assert "`IsoScore_star` given that C₀ to float32 rounding (at most 10 × 2⁻²⁴ = 6e-7" in " ".join(
        METRICS.read_text(encoding="utf-8").split()
    )
