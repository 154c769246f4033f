"""cache ls run parameters, --cache-dir after the subcommand, ``isotui show``, the wide table (issue 12)."""

from __future__ import annotations

import csv
import json

import pytest

from isotui.cli import main

from .conftest import corpus


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(6)) + "\n", encoding="utf-8")
    return f"text:{path}"


def _keys(root) -> list[str]:
    return sorted(p.stem for p in (root / "runs").glob("*.safetensors"))


def test_cache_ls_shows_run_parameters_and_takes_cache_dir_after_ls(tiny_models, data, tmp_path, capsys):
    root = tmp_path / "c"
    model = str(tiny_models["bert"])
    for extra in ([], ["--max-length", "16", "--special-tokens", "include"]):
        assert main(["run", "-m", model, "--data", data, "-q", "--cache-dir", str(root), *extra]) == 0
    capsys.readouterr()
    assert main(["cache", "ls", "--cache-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "max len" in out and "dtype" in out and "special" in out
    lines = [line for line in out.splitlines() if line.count("float32") == 1]
    assert len(lines) == 2  # the two entries differ visibly
    assert any(" 128 " in line and "exclude" in line for line in lines)
    assert any(" 16 " in line and "include" in line for line in lines)
    assert main(["cache", "--cache-dir", str(root), "ls"]) == 0  # the old order still works
    assert main(["cache", "path", "--cache-dir", str(root)]) == 0
    assert capsys.readouterr().out.strip().endswith(str(root))


def test_show_prints_and_exports_a_cached_run(tiny_models, data, tmp_path, capsys):
    root = tmp_path / "c"
    first = tmp_path / "run.csv"
    run = ["run", "-m", str(tiny_models["gpt2"]), "--data", data, "-q", "--cache-dir", str(root)]
    assert main([*run, "--csv", str(first)]) == 0
    run_out = capsys.readouterr().out
    key = _keys(root)[0]
    shown, shown_json = tmp_path / "show.csv", tmp_path / "show.json"
    args = ["show", key[:8], "--cache-dir", str(root), "--csv", str(shown), "--json", str(shown_json)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert str(tiny_models["gpt2"]) in out and "(cache)" in out and "avg_cos" in out
    table = run_out[run_out.index("┏") : run_out.rindex("┘")]
    assert table == out[out.index("┏") : out.rindex("┘")]  # the same table as the run printed
    assert first.read_text() == shown.read_text()
    assert json.loads(shown_json.read_text())["results"][0]["key"] == key


@pytest.mark.parametrize(
    ("prefix", "says"), [("abc", "at least 6 characters"), ("ffffffffff", "matches no cached run")]
)
def test_show_bad_key_is_one_sentence(prefix, says, tmp_path, capsys):
    assert main(["show", prefix, "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_wide_table_of_a_multi_model_run(tiny_models, data, tmp_path, capsys):
    models = [str(tiny_models["bert"]), str(tiny_models["gpt_neox"])]
    per_model, wide_csv = tmp_path / "all.csv", tmp_path / "wide.csv"
    args = ["run", "-m", models[0], "-m", models[1], "--data", data, "-q", "--csv", str(per_model)]
    assert main([*args, "--wide", "isoscore", "--wide-csv", str(wide_csv)]) == 0
    out = capsys.readouterr().out
    assert "isoscore per layer, 2 models" in out
    rows = list(csv.DictReader(per_model.open()))
    wide = list(csv.DictReader(wide_csv.open()))
    assert [w["layer"] for w in wide] == ["0", "1", "2"]
    for w in wide:
        for m in models:
            (row,) = [r for r in rows if r["model"] == m and r["layer"] == w["layer"]]
            assert float(w[m]) == pytest.approx(float(row["isoscore"]), rel=1e-12)
    assert main([*args, "--wide"]) == 0
    assert "avg_cos per layer, 2 models" in capsys.readouterr().out
    assert main([*args, "--wide", "nonsense"]) == 2
    assert "--wide nonsense is not a layer metric" in capsys.readouterr().err


def test_an_experiment_without_a_view_of_its_own_prints_its_rows():
    """A new experiment needs no view: its CSV rows are its table (numbers to 4 digits)."""
    from types import SimpleNamespace

    from rich.console import Console

    from isotui.views import view_for

    rows = [{"model": "m", "layer": 0, "value": 0.123456}, {"model": "m", "layer": 1, "value": 2.0}]
    demo = SimpleNamespace(name="demo-exp", view="demo-exp", rows=lambda results: rows)
    (table,) = view_for(demo).tables(object(), None, 80)
    console = Console(width=80, record=True, color_system=None)
    console.print(table)
    text = console.export_text()
    assert "demo-exp" in text and "value" in text and "0.1235" in text and "2" in text
