"""Your own metrics (issue 27 item 4): the example of docs/guide/plugins.md, run as the page shows
it, against numpy over every kept vector; installed for real through an ``isotui.metrics`` entry
point (a ``*.dist-info`` on ``sys.path``, no mocking of importlib); merged across 2 shards like one
pass; in the cache key; and bad plug-ins refused in one sentence with the cache unharmed."""

from __future__ import annotations

import csv
import json
import math
import re
import uuid
from pathlib import Path

import numpy as np
import pytest

from isotui.cli import main

from .conftest import corpus
from .reference import hidden_vectors

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "plugins.md"
MAX_LENGTH = 24
N = 9  # not a multiple of 2: the shards differ in size


def page_code() -> str:
    """The page's first Python block: the example metric, exactly as documented."""
    blocks = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(encoding="utf-8"), re.S | re.M)
    assert "class RogueVariance" in blocks[0]
    return blocks[0]


def install(tmp_path: Path, monkeypatch, code: str, value: str, name: str = "rogue_variance") -> Path:
    """A package of one module holding ``code``, with an ``isotui.metrics`` entry point
    ``name = <module>:<value>``, as pip would install it: a folder on ``sys.path``."""
    module = f"isotui_plug_{uuid.uuid4().hex[:10]}"
    site = tmp_path / "site"
    dist = site / f"{module}-0.1.dist-info"
    dist.mkdir(parents=True)
    (site / f"{module}.py").write_text(code, encoding="utf-8")
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n", encoding="utf-8")
    (dist / "entry_points.txt").write_text(f"[isotui.metrics]\n{name} = {module}:{value}\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(site))
    return site


@pytest.fixture
def texts(tmp_path):
    lines = corpus(N)
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return lines, f"text:{path}"


def _run(model, data, cache, *extra) -> int:
    argv = ["run", "-m", str(model), "--data", data, "--max-length", str(MAX_LENGTH), "--batch-size", "1"]
    return main([*argv, "--reservoir", "40", "--cache-dir", str(cache), "-q", *extra])


def _csv(path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def numpy_rogue(x: np.ndarray) -> tuple[float, float]:
    """The example's two columns straight from the vectors (population variance: the share's
    ratio is the same with n - 1)."""
    var = x.var(axis=0)
    mean = x.mean(axis=0)
    rms = math.sqrt(float((x * x).sum(axis=1).mean()))
    return float(var.max() / var.sum()), float(np.abs(mean).max() / rms)


def test_the_pages_example_equals_numpy_over_every_vector(tiny_models, texts, tmp_path):
    import isotui

    lines, data = texts
    ns: dict = {}
    exec(compile(page_code(), str(PAGE), "exec"), ns)
    isotui.register_metric(ns["RogueVariance"]())
    try:
        r = isotui.run(
            str(tiny_models["bert"]),
            data=data,
            max_length=MAX_LENGTH,
            batch_size=3,
            progress=False,
            cache=False,
        )
    finally:
        isotui.unregister_metric("rogue_variance")
    vectors, _ = hidden_vectors(tiny_models["bert"], lines, max_length=MAX_LENGTH)
    assert len(r.rows) == len(vectors)
    for row, x in zip(r.rows, vectors, strict=True):
        share, mean_rms = numpy_rogue(np.asarray(x, dtype=np.float64))
        assert row["top_var_share"] == pytest.approx(share, rel=1e-6)
        assert row["max_mean_rms"] == pytest.approx(mean_rms, rel=1e-6)
        assert list(row)[-2:] == ["top_var_share", "max_mean_rms"]  # after every built-in column
    # the row objects read them as attributes, as the plots and --wide do
    assert r.results[0].rows[1].top_var_share == r.rows[1]["top_var_share"]


@pytest.mark.slow
def test_the_pages_python_blocks_run_as_written(tmp_path, monkeypatch, capsys):
    """The page's second block (register, run MiniLM, print a column) after its first, as a reader
    would paste them: it prints one finite share per layer and leaves nothing registered."""
    from isotui.core.plugin import registered

    monkeypatch.setenv("ISOTUI_CACHE_DIR", str(tmp_path / "cache"))
    blocks = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(encoding="utf-8"), re.S | re.M)
    assert len(blocks) == 2
    ns: dict = {}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), ns)
    shares = [float(v) for v in capsys.readouterr().out.strip().strip("[]").split(",")]
    assert len(shares) == 7 and all(0 < v <= 1 for v in shares)  # MiniLM: embeddings + 6 blocks
    assert "rogue_variance" not in registered()


def test_an_installed_plug_in_merges_across_2_shards_like_one_pass(
    tiny_models, texts, tmp_path, monkeypatch, capsys
):
    """The entry point (a real dist-info on sys.path); --shard 0/2 and 1/2 at --batch-size 1 give
    the one-pass run's plug-in columns to 1e-9; the table and --wide show them."""
    install(tmp_path, monkeypatch, page_code(), "RogueVariance")
    _, data = texts
    model = tiny_models["bert"]
    one, merged = tmp_path / "one.csv", tmp_path / "merged.csv"
    assert _run(model, data, tmp_path / "c1", "--csv", str(one)) == 0
    assert _run(model, data, tmp_path / "c2", "--shard", "0/2") == 0
    assert _run(model, data, tmp_path / "c2", "--shard", "1/2", "--csv", str(merged)) == 0
    a, b = _csv(one), _csv(merged)
    assert list(a[0])[-2:] == ["top_var_share", "max_mean_rms"]
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        for col in ("top_var_share", "max_mean_rms"):
            assert math.isfinite(float(x[col]))
            assert float(y[col]) == pytest.approx(float(x[col]), rel=1e-9, abs=0), col
    capsys.readouterr()
    assert (
        main(
            [
                "run",
                "-m",
                str(model),
                "--data",
                data,
                "--max-length",
                str(MAX_LENGTH),
                "--batch-size",
                "1",
                "--reservoir",
                "40",
                "--cache-dir",
                str(tmp_path / "c1"),
                "--wide",
                "top_var_share",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "top_var_share per layer" in out and "max_mean_rms" in out  # the wide table, the per-layer table


def test_the_cache_key_holds_the_plug_ins_in_force(tiny_models, texts, tmp_path, monkeypatch):
    """A run with a plug-in is not answered by the entry made without it; without it again, the
    first entry answers (its key unchanged)."""
    import isotui

    _, data = texts
    kw = {
        "data": data,
        "max_length": MAX_LENGTH,
        "reservoir": 40,
        "cache_dir": tmp_path / "c",
        "progress": False,
    }
    model = str(tiny_models["bert"])
    plain = isotui.run(model, **kw)
    assert "top_var_share" not in plain.rows[0]
    install(tmp_path, monkeypatch, page_code(), "RogueVariance")
    with_it = isotui.run(model, **kw)
    assert not with_it.results[0].from_cache and with_it.key != plain.key
    assert math.isfinite(with_it.rows[0]["top_var_share"])
    cached = isotui.run(model, **kw)  # with it, cached now: the JSON entry gives the columns back
    assert cached.results[0].from_cache
    assert [r["top_var_share"] for r in cached.rows] == [r["top_var_share"] for r in with_it.rows]
    assert [r["max_mean_rms"] for r in cached.rows] == [r["max_mean_rms"] for r in with_it.rows]
    out = tmp_path / "r.json"
    cached.to_json(out)
    (written,) = json.loads(out.read_text())["results"]
    assert [r["top_var_share"] for r in written["rows"]] == [r["top_var_share"] for r in with_it.rows]
    monkeypatch.undo()  # uninstalled
    again = isotui.run(model, **kw)
    assert again.results[0].from_cache and again.key == plain.key and "top_var_share" not in again.rows[0]


GOOD = page_code()
BAD = {
    "import": (
        "raise ImportError('no module named scipy_extra')\n",
        "RogueVariance",
        "failed to load: ImportError",
    ),
    "collision": (
        GOOD.replace('columns = ("top_var_share", "max_mean_rms")', 'columns = ("avg_cos", "max_mean_rms")'),
        "RogueVariance",
        "names a column 'avg_cos', which isotui's own table already has",
    ),
    "shape": (
        GOOD.replace(
            'return {"n": n, "mean": mean, "m2": ((x - mean) ** 2).sum(0)}',
            'return {"n": n, "mean": mean[:2], "m2": ((x - mean) ** 2).sum(0)}',
        ),
        "RogueVariance",
        "batch() returned a state of shapes",
    ),
    "finalize": (
        GOOD.replace(
            "return (float(var.max()) / total", "return (float(var.max()),) or (float(var.max()) / total"
        ),
        "RogueVariance",
        "finalize() must return 2 numbers",
    ),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_plug_in_is_one_sentence_naming_it_and_the_cache_survives(
    kind, tiny_models, texts, tmp_path, monkeypatch, capsys
):
    _, data = texts
    model, cache = tiny_models["bert"], tmp_path / "c"
    assert _run(model, data, cache) == 0  # a result made before, without it
    code, value, said = BAD[kind]
    install(tmp_path, monkeypatch, code, value)
    capsys.readouterr()
    assert _run(model, data, cache) == 2
    err = capsys.readouterr().err
    assert "'rogue_variance'" in err and said in err, err
    assert "Traceback" not in err and "internal error" not in err
    assert len(err.strip().splitlines()) == 1  # one sentence
    monkeypatch.undo()
    from isotui.experiments.layer_pass import read
    from isotui.store.cache import ResultCache

    (entry,) = ResultCache(cache).entries()  # the earlier entry, alone and whole
    assert read(ResultCache(cache), entry.key).rows


def test_plug_ins_measure_modules_and_model_objects(tiny_models, texts, tmp_path):
    """``--modules`` rows get the plug-in's columns (numpy over the module's outputs, taken with a
    forward hook), and a model object gives the numbers of the same model by name."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    import isotui

    lines, data = texts
    folder = tiny_models["bert"]
    ns: dict = {}
    exec(compile(page_code(), str(PAGE), "exec"), ns)
    isotui.register_metric(ns["RogueVariance"]())
    try:
        kw = {"data": data, "max_length": MAX_LENGTH, "batch_size": 1, "progress": False, "cache": False}
        glob = "encoder.layer.*.output.dense"
        by_module = isotui.run(str(folder), modules=[glob], **kw)
        tok = AutoTokenizer.from_pretrained(str(folder))
        obj = AutoModel.from_pretrained(str(folder)).eval()
        by_object = isotui.run(obj, tokenizer=tok, **kw)
        by_name = isotui.run(str(folder), **kw)
    finally:
        isotui.unregister_metric("rogue_variance")
    for a, b in zip(by_object.rows, by_name.rows, strict=True):
        assert a["top_var_share"] == pytest.approx(b["top_var_share"], rel=1e-9)
        assert a["max_mean_rms"] == pytest.approx(b["max_mean_rms"], rel=1e-9)
    # the module outputs, sample by sample, special tokens out (as isotui keeps them)
    names = [r["module"] for r in by_module.rows]
    seen: dict[str, list[np.ndarray]] = {n: [] for n in names}
    modules = dict(obj.named_modules())
    for text in lines:
        enc = tok(
            text, truncation=True, max_length=MAX_LENGTH, return_special_tokens_mask=True, return_tensors="pt"
        )
        keep = enc["special_tokens_mask"][0] == 0
        handles = [
            modules[n].register_forward_hook(
                lambda _m, _i, out, n=n, keep=keep: seen[n].append(out[0][keep].double().numpy())
            )
            for n in names
        ]
        with torch.no_grad():
            obj(input_ids=enc["input_ids"])
        for h in handles:
            h.remove()
    for row in by_module.rows:
        share, mean_rms = numpy_rogue(np.concatenate(seen[row["module"]]))
        assert row["top_var_share"] == pytest.approx(share, rel=1e-6)
        assert row["max_mean_rms"] == pytest.approx(mean_rms, rel=1e-6)


@pytest.mark.slow
def test_the_app_shows_a_plug_in_in_its_table_and_its_plot_cycle(tmp_path, tiny_models, monkeypatch):
    """An installed plug-in (the app's runs are processes of their own: an entry point, not
    register_metric): the layer table gets its columns, and ``m`` cycles through them after the
    built-in metrics (then back to avg_cos)."""
    import asyncio

    from textual.widgets import DataTable, Input

    from isotui.results import LAYER_METRICS
    from isotui.tui.app import IsotuiApp

    from .test_tui import _wait

    install(tmp_path, monkeypatch, page_code(), "RogueVariance")
    data = tmp_path / "samples.txt"
    data.write_text("\n".join(corpus(6)) + "\n", encoding="utf-8")
    app = IsotuiApp(
        cache_root=tmp_path / "cache",
        spec_defaults={"data": f"text:{data}", "max_samples": None, "max_length": 32},
        export_dir=tmp_path,
    )
    model = str(tiny_models["bert"])

    async def scenario():
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.press("slash")
            app.query_one("#model-input", Input).value = model
            await pilot.press("enter")
            await _wait(pilot, lambda: model in app.results, why=lambda: "the run did not finish")
            assert "top_var_share" in app.results[model].rows[0].extra
            table = app.query_one("#layers", DataTable)
            await _wait(pilot, lambda: table.row_count > 0)  # the selected model's table, drawn
            keys = [str(c.value) for c in table.columns]
            assert keys[-2:] == ["top_var_share", "max_mean_rms"], keys
            seen = []
            for _ in range(len(LAYER_METRICS) + 2):
                await pilot.press("m")
                seen.append(app.metric)
            assert seen[-3:] == ["top_var_share", "max_mean_rms", "avg_cos"]

    asyncio.run(scenario())


@pytest.mark.slow
def test_the_command_line_finds_an_installed_plug_in_on_pythonpath(tiny_models, texts, tmp_path):
    """``python -m isotui run`` in a process of its own, the package on PYTHONPATH as pip's
    site-packages would be: the CSV has the columns; a clashing version exits 2 in one sentence."""
    import os
    import subprocess
    import sys

    _, data = texts
    tree = Path(__file__).resolve().parents[1]

    def run(site: Path, *extra: str) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(site), str(tree)]),
            "ISOTUI_CACHE_DIR": str(tmp_path / "c"),
        }
        argv = [sys.executable, "-m", "isotui", "run", "-m", str(tiny_models["bert"]), "--data", data]
        return subprocess.run(
            [*argv, "--max-length", str(MAX_LENGTH), "-q", *extra], env=env, capture_output=True, text=True
        )

    class Env:  # install() without pytest's monkeypatch: sys.path of this process stays as it was
        @staticmethod
        def syspath_prepend(_path: str) -> None:
            pass

    good = install(tmp_path / "good", Env, page_code(), "RogueVariance")
    out = tmp_path / "out.csv"
    done = run(good, "--csv", str(out))
    assert done.returncode == 0, done.stderr
    rows = _csv(out)
    assert list(rows[0])[-2:] == ["top_var_share", "max_mean_rms"]
    assert all(0 < float(r["top_var_share"]) <= 1 for r in rows)
    clash = page_code().replace('"max_mean_rms")', '"run_key")')
    bad = install(tmp_path / "bad", Env, clash, "RogueVariance")
    done = run(bad)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "isotui: error: metric plug-in 'rogue_variance' names a column 'run_key', which isotui's own "
        "table already has: rename that column"
    )


def test_a_checkpoint_heatmap_of_a_plug_in_column(tiny_models, texts, tmp_path, monkeypatch):
    """``isotui figure machina2024-heatmap --metric top_var_share``: the figure's CSV is the plug-in
    column of every checkpoint, numpy over each checkpoint's vectors."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    lines, data = texts
    root = tmp_path / "run"
    tok = AutoTokenizer.from_pretrained(str(tiny_models["bert"]))
    direction = torch.randn(32, generator=torch.Generator().manual_seed(5))
    for i, step in enumerate((0, 100)):
        model = AutoModel.from_pretrained(str(tiny_models["bert"]))
        with torch.no_grad():
            model.embeddings.word_embeddings.weight += 0.5 * i * direction
        model.save_pretrained(root / f"step_{step}")
        tok.save_pretrained(root / f"step_{step}")
    install(tmp_path, monkeypatch, page_code(), "RogueVariance")
    out = tmp_path / "heat.svg"
    argv = ["figure", "machina2024-heatmap", "-c", str(root), "--data", data, "--max-length", str(MAX_LENGTH)]
    argv += [
        "--batch-size",
        "1",
        "--cache-dir",
        str(tmp_path / "c"),
        "--metric",
        "top_var_share",
        "--out",
        str(out),
    ]
    assert main([*argv, "-q"]) == 0
    rows = _csv(out.with_suffix(".csv"))
    assert [r["step"] for r in rows] == ["0", "0", "0", "100", "100", "100"]
    for step in (0, 100):
        vectors, _ = hidden_vectors(root / f"step_{step}", lines, max_length=MAX_LENGTH)
        got = [float(r["top_var_share"]) for r in rows if r["step"] == str(step)]
        want = [numpy_rogue(np.asarray(x, dtype=np.float64))[0] for x in vectors]
        assert got == pytest.approx(want, rel=1e-6)


def test_a_training_probe_may_log_a_plug_in_column():
    """``Probe(metrics=[...])`` (the training callbacks) takes a plug-in's column while it is in
    force, and refuses it, in one sentence, once it is not."""
    import isotui
    from isotui.callbacks import Probe
    from isotui.errors import IsotuiError

    ns: dict = {}
    exec(compile(page_code(), str(PAGE), "exec"), ns)
    isotui.register_metric(ns["RogueVariance"]())
    try:
        assert Probe(metrics=["avg_cos", "top_var_share"]).metrics == ("avg_cos", "top_var_share")
    finally:
        isotui.unregister_metric("rogue_variance")
    with pytest.raises(IsotuiError, match="metrics= has 'top_var_share', which is no layer metric"):
        Probe(metrics=["top_var_share"])


def test_out_of_memory_in_a_plug_in_backs_off_and_adds_nothing_twice(tiny_models, texts):
    """A plug-in's batch() that runs out of memory on large batches: the error reaches the batch
    loop as itself (not a plug-in error), the loop halves the batch, and the numbers still equal
    numpy over every vector (no batch folded in twice or half); any other error is a sentence."""
    import torch

    import isotui
    from isotui.core.plugin import Plugged, PluginError

    lines, data = texts
    ns: dict = {}
    exec(compile(page_code(), str(PAGE), "exec"), ns)

    class Hungry(ns["RogueVariance"]):
        def batch(self, x):
            if len(x) > 30:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test)")
            return super().batch(x)

    plugged = Plugged(Hungry(), 4, torch.device("cpu"))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        plugged.batch(torch.zeros((31, 4), dtype=torch.float64))
    with pytest.raises(PluginError, match="'rogue_variance' failed in batch\\(\\) on a layer of dimension 4"):
        plugged.batch(torch.zeros((2, 4), dtype=torch.int64))  # x.mean() of integers: RuntimeError
    isotui.register_metric(Hungry())
    try:
        r = isotui.run(
            str(tiny_models["bert"]),
            data=data,
            max_length=MAX_LENGTH,
            batch_size=8,
            progress=False,
            cache=False,
        )
    finally:
        isotui.unregister_metric("rogue_variance")
    vectors, _ = hidden_vectors(tiny_models["bert"], lines, max_length=MAX_LENGTH)
    for row, x in zip(r.rows, vectors, strict=True):
        share, mean_rms = numpy_rogue(np.asarray(x, dtype=np.float64))
        assert row["top_var_share"] == pytest.approx(share, rel=1e-6)
        assert row["max_mean_rms"] == pytest.approx(mean_rms, rel=1e-6)
        assert row["n_vectors"] == len(x)
