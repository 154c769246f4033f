"""The Python API (``isotui.run``, ``isotui.experiment``, ``isotui.load``): the CLI's own path,
its files byte for byte, its cache, its one-sentence errors; ``import isotui`` stays light."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

import isotui
from isotui.cli import main

from .conftest import corpus


@pytest.fixture
def data(tmp_path) -> str:
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(6)) + "\n", encoding="utf-8")
    return f"text:{path}"


def test_import_isotui_loads_no_torch_rich_or_api():
    probe = (
        "import sys, isotui; before = sorted(m for m in ('torch', 'transformers', 'rich', 'isotui.api') "
        "if m in sys.modules); f = isotui.run; e = isotui.IsotuiError; "
        "print('BEFORE', before, 'AFTER', 'torch' in sys.modules, f.__module__, e.__name__)"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "BEFORE [] AFTER False isotui.api IsotuiError" in proc.stdout


def test_run_csv_and_json_are_the_clis_byte_for_byte(tmp_path, tiny_models, data):
    """Two models: the CLI's --csv/--json, then the API (from the cache the CLI filled)."""
    bert, gpt2 = str(tiny_models["bert"]), str(tiny_models["gpt2"])
    cli_csv, cli_json = tmp_path / "cli.csv", tmp_path / "cli.json"
    argv = [
        "run",
        "-m",
        bert,
        "-m",
        gpt2,
        "--data",
        data,
        "--csv",
        str(cli_csv),
        "--json",
        str(cli_json),
        "-q",
    ]
    assert main(argv) == 0
    both = isotui.run([bert, gpt2], data=data)
    assert isinstance(both, isotui.Results) and [r.models for r in both] == [[bert], [gpt2]]
    assert all(r.results[0].from_cache for r in both)  # the same cache, the same keys
    assert both.to_csv(tmp_path / "api.csv").read_bytes() == cli_csv.read_bytes()
    assert both.to_json(tmp_path / "api.json").read_bytes() == cli_json.read_bytes()
    with open(cli_csv, newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert len(both.rows) == len(table) and list(both.rows[0]) == list(table[0])
    assert [str(r["avg_cos"]) for r in both.rows] == [r["avg_cos"] for r in table]
    one = both[0]
    assert one.key == one.result.key and one.rows[0]["run_key"] == one.key
    # one model on its own gives the CLI's single-model file, computed afresh without the cache
    fresh = isotui.run(bert, data=data, cache=False)
    assert not fresh.result.from_cache
    assert (
        main(["run", "-m", bert, "--data", data, "--csv", str(tmp_path / "b.csv"), "--no-cache", "-q"]) == 0
    )
    assert fresh.to_csv(tmp_path / "fresh.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()


def test_experiment_csv_and_json_match_the_cli(tmp_path, tiny_models, data):
    model = str(tiny_models["gpt_neox"])
    cli_csv, cli_json = tmp_path / "cli.csv", tmp_path / "cli.json"
    argv = ["experiment", "attention", "-m", model, "--data", data, "--csv", str(cli_csv), "-q"]
    assert main([*argv, "--json", str(cli_json)]) == 0
    r = isotui.experiment("attention", model=model, data=data)
    assert r.command == "attention" and r.result.from_cache
    assert r.to_csv(tmp_path / "api.csv").read_bytes() == cli_csv.read_bytes()
    # the same document; the arrays' key order differs between a computed result and one read
    # back from the cache (safetensors sorts names), as it does between two CLI runs
    api_json = json.loads(r.to_json(tmp_path / "api.json").read_text(encoding="utf-8"))
    assert api_json == json.loads(cli_json.read_text(encoding="utf-8"))
    # not cached: gradients recompute, deterministically, to the same bytes
    lm = tmp_path / "lm"
    _save_causal_lm(tiny_models["gpt2"], lm)
    assert (
        main(
            [
                "experiment",
                "gradients",
                "-m",
                str(lm),
                "--data",
                data,
                "--top-k",
                "2",
                "--csv",
                str(cli_csv),
                "-q",
            ]
        )
        == 0
    )
    g = isotui.experiment("gradients", model=str(lm), data=data, top_k=2)
    assert g.to_csv(tmp_path / "g.csv").read_bytes() == cli_csv.read_bytes()
    assert {row["layer"] for row in g.rows} == {0, 1, 2}


def _save_causal_lm(folder, out) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(out)
    AutoTokenizer.from_pretrained(str(folder)).save_pretrained(out)


def test_final_norm_and_drift_block_through_the_api(tmp_path, tiny_models, data):
    r = isotui.experiment("final-norm", model=str(tiny_models["gpt2"]), data=data)
    assert r.result.module == "ln_f" and len(r.rows) == 32  # one row per hidden dimension
    cli_csv = tmp_path / "cli.csv"
    argv = [
        "experiment",
        "final-norm",
        "-m",
        str(tiny_models["gpt2"]),
        "--data",
        data,
        "--csv",
        str(cli_csv),
        "-q",
    ]
    assert main(argv) == 0
    assert r.to_csv(tmp_path / "api.csv").read_bytes() == cli_csv.read_bytes()
    sizes = {
        "hidden": 16,
        "heads": 2,
        "intermediate": 32,
        "vocab": 50,
        "batch": 2,
        "seq_len": 8,
        "norms": "0:4:3",
    }
    d = isotui.experiment("drift-block", **sizes)
    assert d.command == "drift-block" and len(d.rows) == 3
    argv = ["experiment", "drift-block", *[f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()]]
    assert main([*argv, "--csv", str(cli_csv), "-q"]) == 0
    assert d.to_csv(tmp_path / "d.csv").read_bytes() == cli_csv.read_bytes()


def test_to_pandas_has_the_csv_columns(tiny_models, data):
    pd = pytest.importorskip("pandas")
    r = isotui.run(str(tiny_models["bert"]), data=data)
    frame = r.to_pandas()
    assert isinstance(frame, pd.DataFrame)
    assert list(frame.columns) == list(r.rows[0]) and len(frame) == len(r.rows)
    assert frame["avg_cos"].tolist() == [row["avg_cos"] for row in r.rows]


def test_load_reopens_a_cached_run_by_prefix(tiny_models, data, tmp_path):
    r = isotui.run(str(tiny_models["bert"]), data=data)
    back = isotui.load(r.key[:10])
    assert back.key == r.key and back.command == "run"
    assert back.to_csv(tmp_path / "a.csv").read_bytes() == r.to_csv(tmp_path / "b.csv").read_bytes()
    a = isotui.experiment("attention", model=str(tiny_models["bert"]), data=data)
    again = isotui.load(a.key)
    assert again.command == "attention" and len(again.rows) == len(a.rows) == 8  # 2 layers x 4 heads
    assert again.to_csv(tmp_path / "c.csv").read_bytes() == a.to_csv(tmp_path / "d.csv").read_bytes()
    with pytest.raises(isotui.IsotuiError, match="matches no cached result"):
        isotui.load("feedbeef")


@pytest.mark.parametrize(
    ("call", "argv"),
    [
        (lambda: isotui.run("minilm", max_samples=-3), ["run", "--max-samples", "-3"]),
        (
            lambda: isotui.run("minilm", data="text:/no/such/file.txt"),
            ["run", "--data", "text:/no/such/file.txt"],
        ),
        (lambda: isotui.run("random:no_such_arch"), ["run", "-m", "random:no_such_arch"]),
        (
            lambda: isotui.experiment("gradients", model="minilm", top_k=0),
            ["experiment", "gradients", "--top-k", "0"],
        ),
    ],
)
def test_errors_raise_the_sentence_the_cli_prints(call, argv, capsys):
    with pytest.raises(isotui.IsotuiError) as caught:
        call()
    assert main([*argv, "-q"]) == 2
    printed = capsys.readouterr().err
    assert f"isotui: error: {caught.value}" in " ".join(printed.split())


def test_options_the_command_lacks_are_said():
    with pytest.raises(isotui.IsotuiError, match="experiment 'attention' has no option 'top_k'"):
        isotui.experiment("attention", model="minilm", top_k=3)
    with pytest.raises(isotui.IsotuiError, match="no experiment 'nope'"):
        isotui.experiment("nope")
    with pytest.raises(isotui.IsotuiError, match=r"result\.to_csv"):
        isotui.experiment("attention", model="minilm", csv="x.csv")
    with pytest.raises(isotui.IsotuiError, match=r"qk-dynamics. needs checkpoints="):
        isotui.experiment("qk-dynamics", model="minilm")


def test_api_in_a_fresh_process_answers_from_the_cache_without_torch(tiny_models, data, tmp_path):
    isotui.run(str(tiny_models["bert"]), data=data)
    probe = (
        f"import sys, isotui; r = isotui.run({str(tiny_models['bert'])!r}, data={data!r}); "
        "print('ROWS', len(r.rows), 'TORCH', 'torch' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=dict(os.environ), timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert "ROWS 3 TORCH False" in proc.stdout
    assert json.loads(json.dumps(isotui.load(isotui.run(str(tiny_models["bert"]), data=data).key).payload))
