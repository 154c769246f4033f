"""``--modules``: any module's output measured as the layers are, checked against forward hooks and
numpy over all pairs computed here; named sites; refusals; the plain run left as it was."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import numpy as np
import pytest

import isotui
from isotui.cli import main
from isotui.errors import IsotuiError

from .conftest import corpus

ATTN = "encoder.layer.{i}.attention.output.dense"
MLP_IN = "encoder.layer.{i}.intermediate.dense"  # 1536 wide: another module kind, another d


@pytest.fixture
def text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("ISOTUI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "t.txt"
    path.write_text("\n".join(corpus(6)) + "\n", encoding="utf-8")
    return f"text:{path}"


def _hooked(folder: Path, texts: list[str], names: list[str]) -> dict[str, list[tuple[int, np.ndarray]]]:
    """Per module name, (sample, its kept token vectors) from plain forward hooks, one sample at a
    time (no padding), CLS/SEP left out by the tokenizer's special-tokens mask."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder)).eval()
    modules = dict(model.named_modules())
    out: dict[str, list[tuple[int, np.ndarray]]] = {n: [] for n in names}
    for s, line in enumerate(texts):
        enc = tok(line, return_tensors="pt", return_special_tokens_mask=True)
        keep = ~enc.pop("special_tokens_mask")[0].bool()
        seen: dict[str, torch.Tensor] = {}

        def keep_output(name: str, kept: dict[str, torch.Tensor] = seen):
            return lambda _m, _i, o: kept.__setitem__(name, o.detach().clone())

        handles = [modules[n].register_forward_hook(keep_output(n)) for n in names]
        with torch.no_grad():
            model(**enc)
        for h in handles:
            h.remove()
        for n in names:
            out[n].append((s, seen[n][0][keep].double().numpy()))
    return out


def _pair_metrics(parts: list[tuple[int, np.ndarray]]) -> dict[str, float]:
    """avg_cos over all distinct pairs, over pairs of different samples, drift and mean norm."""
    x = np.concatenate([v for _, v in parts])
    sample = np.concatenate([np.full(len(v), s) for s, v in parts])
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    cos = u @ u.T
    upper = np.triu(np.ones_like(cos, dtype=bool), k=1)
    other = upper & (sample[:, None] != sample[None, :])
    return {
        "n_vectors": len(x),
        "avg_cos": float(cos[upper].mean()),
        "avg_cos_xctx": float(cos[other].mean()),
        "drift_norm": float(np.linalg.norm(x.mean(axis=0))),
        "mean_norm": float(np.linalg.norm(x, axis=1).mean()),
    }


def test_modules_equal_forward_hooks_and_numpy_over_all_pairs(text):
    from isotui.models.naming import bundled_minilm_dir

    got = isotui.run(
        "minilm", text, modules=["attn_out", "encoder.layer.*.intermediate.dense"], progress=False
    )
    rows = got.rows
    n_blocks = 6
    # the order they run: each block's attention output before its intermediate dense
    expected_names = [p.format(i=i) for i in range(n_blocks) for p in (ATTN, MLP_IN)]
    assert [r["module"] for r in rows] == expected_names
    assert [r["layer"] for r in rows] == list(range(len(expected_names)))
    assert list(rows[0])[-1] == "module"  # appended after every existing column
    hooked = _hooked(bundled_minilm_dir(), corpus(6), expected_names)
    for row in rows:
        want = _pair_metrics(hooked[row["module"]])
        assert row["n_vectors"] == want["n_vectors"]
        assert row["dim"] == (1536 if "intermediate" in row["module"] else 384)
        for metric in ("avg_cos", "avg_cos_xctx", "drift_norm", "mean_norm"):
            assert row[metric] == pytest.approx(want[metric], rel=1e-5, abs=1e-6), (row["module"], metric)
    # the same globs again: the cache's entry, under a key of its own
    again = isotui.run(
        "minilm", text, modules=["attn_out", "encoder.layer.*.intermediate.dense"], progress=False
    )
    assert again.result.from_cache and again.key == got.key
    plain = isotui.run("minilm", text, progress=False)
    assert plain.key != got.key and all(r["module"] == "" for r in plain.rows)


@pytest.mark.parametrize("arch", ["minilm", "gpt2", "gpt_neox"])
def test_resid_post_is_the_plain_run(arch, text, tiny_models):
    """The named site resid_post gives the rows a plain run gives (BERT: embeddings and block
    outputs; GPT-2, GPT-NeoX: block inputs and the final norm's output)."""
    model = "minilm" if arch == "minilm" else str(tiny_models[arch])
    plain = isotui.run(model, text, cache=False, progress=False).rows
    sites = isotui.run(model, text, modules=["resid_post"], cache=False, progress=False).rows
    assert len(sites) == len(plain)
    for a, b in zip(sites, plain, strict=True):
        for metric in ("n_vectors", "avg_cos", "drift_norm", "mean_norm", "isoscore", "avg_cos_centered"):
            assert a[metric] == pytest.approx(b[metric], rel=1e-9, abs=1e-12), (a["module"], metric)
    assert (
        sites[-1]["module"]
        == {"minilm": "encoder.layer.5", "gpt2": "ln_f", "gpt_neox": "final_layer_norm"}[arch]
    )


@pytest.mark.parametrize(
    ("arch", "block"),
    [
        ("gpt2", ["h.{i}.ln_1 (input)", "h.{i}.attn", "h.{i}.ln_2 (input)", "h.{i}.mlp"]),
        # GPT-NeoX declares post_attention_layernorm before attention, and runs it after
        (
            "gpt_neox",
            [
                "layers.{i}.input_layernorm (input)",
                "layers.{i}.attention",
                "layers.{i}.post_attention_layernorm (input)",
                "layers.{i}.mlp",
            ],
        ),
    ],
)
def test_named_sites_come_in_the_order_they_run(arch, block, text, tiny_models):
    """attn_out, mlp_out and norm_in name each block's attention and MLP outputs and every
    norm's input, in the order the model runs them (not the order it declares them)."""
    rows = isotui.run(
        str(tiny_models[arch]), text, modules=["norm_in", "attn_out", "mlp_out"], cache=False, progress=False
    ).rows
    final = {"gpt2": "ln_f (input)", "gpt_neox": "final_layer_norm (input)"}[arch]
    assert [r["module"] for r in rows] == [*(p.format(i=i) for i in range(2) for p in block), final]
    assert all(math.isfinite(r["avg_cos"]) for r in rows)


def test_modules_shards_merge_as_one_pass(text, tmp_path):
    cache = tmp_path / "shards"
    base = ["run", "-m", "minilm", "--data", text, "--modules", "mlp_out", "-q", "--cache-dir", str(cache)]
    assert main([*base, "--shard", "0/2"]) == 0
    out = tmp_path / "merged.csv"
    assert main([*base, "--shard", "1/2", "--csv", str(out)]) == 0
    merged = list(csv.DictReader(out.open(encoding="utf-8")))
    one = isotui.run("minilm", text, modules=["mlp_out"], cache=False, progress=False).rows
    assert (
        [r["module"] for r in merged]
        == [r["module"] for r in one]
        == [f"encoder.layer.{i}.output.dense" for i in range(6)]
    )
    for a, b in zip(merged, one, strict=True):
        for metric in ("n_vectors", "avg_cos", "drift_norm", "mean_norm"):
            assert float(a[metric]) == pytest.approx(b[metric], rel=1e-9), metric


def test_refusals_name_the_module(text, capsys):
    def refused(modules: list, said: str) -> None:
        with pytest.raises(IsotuiError, match=said):
            isotui.run("minilm", text, modules=modules, cache=False, progress=False)

    refused(["encoder.layers.*"], r"matches no module of BertModel; the nearest names: .*encoder\.layer")
    refused(["pooler"], r"module pooler gives a torch.float32 tensor of shape \(\d+, 384\), not a")
    dropout = "encoder.layer.0.attention.self.dropout"  # sdpa attention drops out inside its kernel
    refused([dropout], re.escape(f"module {dropout} did not run"))
    refused([3], "modules must be module name globs")
    assert main(["run", "-m", "minilm", "--data", text, "--modules", "nothing*", "-q", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "--modules 'nothing*' matches no module of BertModel" in err and "Traceback" not in err
    # the dry run plans from the config alone, which cannot say what the modules give
    assert main(["run", "-m", "minilm", "--data", text, "--modules", "attn_out", "--dry-run"]) == 2
    assert "drop --dry-run or --modules" in capsys.readouterr().err


NEOX4 = "random:gpt_neox:hidden_size=32,num_hidden_layers=4,num_attention_heads=4,intermediate_size=64"
GPT2_4 = "random:gpt2:n_layer=4,n_embd=32,n_head=4"


def _permutation_p(x: list[float], y: list[float]) -> float:
    """Two-sided permutation p of Spearman's rho over every pairing, by brute force."""
    import itertools

    from scipy import stats

    rx, ry = stats.rankdata(x), stats.rankdata(y)
    rho = stats.spearmanr(x, y).statistic
    rhos = [stats.pearsonr(rx, [ry[i] for i in p]).statistic for p in itertools.permutations(range(len(x)))]
    eps = 1e-12
    less = sum(r <= rho + eps for r in rhos) / len(rhos)
    more = sum(r >= rho - eps for r in rhos) / len(rhos)
    return min(1.0, 2 * min(less, more))


def test_norm_inputs_that_repeat_count_once_and_kinds_correlate_apart(text):
    """Issue 37 item 4: GPT-NeoX's two norms of a block read one input (parallel residual), so
    --modules norm_in has each block's input twice: those rows count once, and the correlation is
    across the layers of one module kind, never across interleaved kinds."""
    import torch
    from scipy import stats
    from transformers import GPTNeoXConfig, GPTNeoXModel

    # independently of isotui: the two norms of a block are handed the same tensor
    config = GPTNeoXConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64)
    model = GPTNeoXModel(config).eval()
    seen: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if name.endswith("layernorm"):
            module.register_forward_pre_hook(lambda m, a, name=name: seen.__setitem__(name, a[0]))
    model(input_ids=torch.tensor([[3, 7, 11, 19]]))
    assert all(
        torch.equal(seen[f"layers.{i}.input_layernorm"], seen[f"layers.{i}.post_attention_layernorm"])
        for i in range(4)
    )

    result = isotui.run(NEOX4, text, modules=["norm_in"], cache=False, progress=False).result
    kind = "layers.*.input_layernorm (input)"
    assert list(result.drift) == [f"model:{kind}"]  # post_attention_layernorm: all repeats; final: 1 row
    points = [r for r in result.rows if r.module.endswith("input_layernorm (input)")]
    assert len(points) == 4
    x, y = [r.drift_norm for r in points], [r.avg_cos for r in points]
    d = result.drift[f"model:{kind}"]
    assert d.n_layers == 4
    assert d.spearman_rho == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    assert d.spearman_p == pytest.approx(_permutation_p(x, y), rel=1e-12)
    assert d.pearson_r == pytest.approx(stats.pearsonr(x, y).statistic, abs=1e-12)
    notes = " ".join(result.meta["notes"])
    assert "layers.0.post_attention_layernorm (input)" in notes and "left out" in notes
    assert "fewer than 3 distinct rows" in notes


def test_attention_and_mlp_outputs_correlate_per_kind(text):
    """Rows of two module kinds (attn_out and mlp_out, interleaved as they run): one correlation
    per kind, each scipy's over that kind's rows alone, and the header names the kind."""
    from scipy import stats

    from isotui.render import result_table

    result = isotui.run(GPT2_4, text, modules=["attn_out", "mlp_out"], cache=False, progress=False).result
    assert list(result.drift) == ["model:h.*.attn", "model:h.*.mlp"]
    for kind in ("attn", "mlp"):
        rows = [r for r in result.rows if r.module.endswith(f".{kind}")]
        x, y = [r.drift_norm for r in rows], [r.avg_cos for r in rows]
        d = result.drift[f"model:h.*.{kind}"]
        assert d.n_layers == 4
        assert d.spearman_rho == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
        assert d.pearson_r == pytest.approx(stats.pearsonr(x, y).statistic, abs=1e-12)
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(result_table(result))
    shown = console.export_text()
    assert "model:h.*.attn: drift vs avg_cos over 4 layers" in shown, shown


def test_a_star_stays_within_one_dotted_name_and_two_cross_dots(text):
    """Issue 38 item 4: `*` within a dotted name, `**` across (as .gitignore). The docs' MLP glob
    matches the 6 MLP outputs alone (under fnmatch's rule it also took the 6 attention outputs),
    and the run's notes say what changed and the spelling that gives the old set."""
    import fnmatch

    from transformers import AutoModel

    from isotui.models.naming import bundled_minilm_dir

    names = [n for n, _ in AutoModel.from_pretrained(str(bundled_minilm_dir())).named_modules()]
    before = [n for n in names if fnmatch.fnmatchcase(n, "encoder.layer.*.output.dense")]
    within = [
        n
        for n in names
        if n.count(".") == 4 and n.startswith("encoder.layer.") and n.endswith(".output.dense")
    ]
    assert len(before) == 12 and len(within) == 6  # the attention's output.dense too, under fnmatch

    got = isotui.run("minilm", text, modules=["encoder.layer.*.output.dense"], cache=False, progress=False)
    assert [r["module"] for r in got.rows] == within
    notes = " ".join(got.result.meta["notes"])
    assert "where * crossing dots matched 12" in notes and "'encoder.layer.**.output.dense'" in notes
    crossing = isotui.run(
        "minilm", text, modules=["encoder.layer.**.output.dense"], cache=False, progress=False
    )
    assert [r["module"] for r in crossing.rows] == before
    assert "crossing dots matched" not in " ".join(crossing.result.meta["notes"])


def test_a_glob_that_now_matches_nothing_is_refused_with_the_crossing_spelling(text):
    with pytest.raises(
        IsotuiError, match=r"matched \d+ when \* crossed dots, as --modules 'encoder\*\*dense'"
    ):
        isotui.run("minilm", text, modules=["encoder*dense"], cache=False, progress=False)


def test_a_patterns_key_says_the_glob_rule_and_a_names_key_does_not():
    """Entries of a pattern computed under fnmatch's rule may hold other modules: its key holds
    the rule; a module's plain name and the named sites keep the keys they had."""
    from isotui.experiments.layer_pass import prepare
    from isotui.spec import make_spec

    from .test_keys_unchanged import _sha, layer_fields

    def key_without_rule(modules: list[str]) -> str:
        prepared = prepare(make_spec("minilm", "builtin", max_samples=2, modules=tuple(modules)))
        sha = _sha(layer_fields(prepared, 0, modules=modules))
        return sha if prepared.key == sha else prepared.key + " != " + sha

    name = key_without_rule(["encoder.layer.0.output.dense"])
    assert "!=" not in name
    site = key_without_rule(["mlp_out"])
    assert "!=" not in site
    pattern = key_without_rule(["encoder.layer.*.output.dense"])
    assert "!=" in pattern  # the rule is in its key


def test_module_rows_are_named_in_the_table(text):
    """Issue 38 item 4: the terminal's table (and the app's, the same columns) names each
    --modules row's module, not only the CSV."""
    from rich.console import Console

    from isotui.render import result_table

    result = isotui.run("minilm", text, modules=["mlp_out"], cache=False, progress=False).result
    console = Console(width=200, record=True)
    console.print(result_table(result))
    shown = console.export_text()
    for i in range(6):
        assert f"{i} encoder.layer.{i}.output.dense" in shown, shown
