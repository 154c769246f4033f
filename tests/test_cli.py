"""The ``isotui`` command as a user runs it: tables, CSV/JSON, config files, clear errors."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from isotui.cli import main

from .conftest import corpus

REQUIRED = ["model", "component", "layer", "n_vectors", "avg_cos", "drift_norm", "mean_norm"]


def isotui(*args, cwd=None, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "isotui", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=600,
    )


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(10)) + "\n", encoding="utf-8")
    return path


@pytest.mark.slow
def test_run_two_models_writes_csv_and_json(tmp_path, tiny_models, data):
    out_csv, out_json = tmp_path / "out" / "t.csv", tmp_path / "t.json"
    proc = isotui(
        "run",
        "-m",
        str(tiny_models["bert"]),
        "-m",
        str(tiny_models["gpt2"]),
        "--data",
        f"text:{data}",
        "--csv",
        str(out_csv),
        "--json",
        str(out_json),
    )
    assert proc.returncode == 0, proc.stderr
    assert "drift vs avg_cos" in proc.stdout and "Spearman" in proc.stdout
    assert "(norm)" in proc.stdout  # GPT-2's last layer is flagged
    with out_csv.open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames[: len(REQUIRED)] == REQUIRED
        rows = list(reader)
    assert [(r["model"], r["layer"]) for r in rows] == [
        (str(tiny_models[m]), str(i)) for m in ("bert", "gpt2") for i in range(3)
    ]
    assert all(r["component"] == "model" for r in rows)
    assert float(rows[1]["avg_cos"]) == pytest.approx(float(rows[1]["avg_cos"]))
    payload = json.loads(out_json.read_text())
    # each row says which run it came from
    assert {(r["data"], r["n_samples"]) for r in rows} == {(f"text:{data}", "10")}
    keys = {r["model"]: r["run_key"] for r in rows}
    assert keys == {r["model"]: r["key"] for r in payload["results"]}
    assert {r["model"] for r in payload["results"]} == {
        str(tiny_models["bert"]),
        str(tiny_models["gpt2"]),
    }
    assert "spearman_p" in payload["results"][0]["drift"]["model"]


@pytest.mark.slow
def test_config_file_and_flags_win(tmp_path, tiny_models, data):
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        f'models = ["{tiny_models["bert"]}"]\ndata = "text:{data.name}"\n'
        'max_samples = 6\njson = "from_config.json"\n'
    )
    proc = isotui("run", str(cfg), "--max-samples", "3", cwd=tmp_path / "..")
    assert proc.returncode == 0, proc.stderr
    payload = json.loads((tmp_path / "from_config.json").read_text())  # relative to the config
    assert payload["results"][0]["meta"]["n_samples"] == 3


@pytest.mark.slow
def test_second_identical_run_comes_from_cache_without_torch(tmp_path, tiny_models, data):
    args = ["run", "-m", str(tiny_models["bert"]), "--data", f"text:{data}", "-q"]
    assert main(args) == 0
    probe = (
        f"import sys; from isotui.cli import main; code = main({args!r}); "
        "print('LOADED', 'torch' in sys.modules, 'transformers' in sys.modules); sys.exit(code)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=dict(os.environ), timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert "(cache)" in proc.stdout
    assert "LOADED False False" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "-m", "no-such-org/no-such-model"], "not in the local Hugging Face cache"),
        (["run", "--data", "text:/no/such/file.txt"], "does not exist"),
        (["run", "--data", "ftp:somewhere"], "unknown scheme"),
        (["run", "--max-length", "0"], "max-length must be a positive integer"),
        (["run", "-m", "./no/such/dir"], "does not exist"),
        (["run", "-m", "random:no_such_arch"], "transformers has no model type 'no_such_arch'"),
        (["cache", "rm", "feedbeef"], "matches no cached run"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(args, needle):
    proc = isotui(*args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


@pytest.mark.slow
def test_malformed_and_unknown_config(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("models = [\n")
    proc = isotui("run", str(bad))
    assert proc.returncode == 2 and "is not valid TOML" in proc.stderr and "Traceback" not in proc.stderr
    bad.write_text('modles = ["minilm"]\n')
    proc = isotui("run", str(bad))
    assert proc.returncode == 2 and "unknown setting 'modles'" in proc.stderr
    bad.write_text("max_length = 0\n")
    proc = isotui("run", str(bad))
    assert proc.returncode == 2 and f"config file {bad}: max-length" in proc.stderr


@pytest.mark.slow
def test_failing_model_keeps_other_results(tmp_path, tiny_models, data):
    out_csv = tmp_path / "t.csv"
    out_csv.write_text("the user's old file\n")
    proc = isotui(
        "run",
        "-m",
        str(tiny_models["bert"]),
        "-m",
        "no-such-org/x",
        "--data",
        f"text:{data}",
        "--csv",
        str(out_csv),
    )
    assert proc.returncode == 2
    assert "1 of 2 models failed" in proc.stderr
    rows = list(csv.DictReader(out_csv.open()))
    assert len(rows) == 3 and rows[0]["model"] == str(tiny_models["bert"])


def test_model_without_hidden_states(tmp_path, tiny_models, data, monkeypatch, capsys):
    from transformers import BertModel

    original = BertModel.forward

    def forward(self, *args, **kwargs):
        kwargs["output_hidden_states"] = False
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BertModel, "forward", forward)
    code = main(["run", "-m", str(tiny_models["bert"]), "--data", f"text:{data}", "-q", "--no-cache"])
    assert code == 2
    assert "returned no hidden states" in capsys.readouterr().err


@pytest.mark.slow
def test_cache_ls_rm_path(tmp_path, tiny_models, data):
    assert isotui("run", "-m", str(tiny_models["bert"]), "--data", f"text:{data}", "-q").returncode == 0
    listing = isotui("cache", "ls")
    # the entry's key (12 characters, never wrapped) and its model; a long temp path (pytest-xdist's)
    # wraps inside the model column, so the folder's name stands for it
    (entry,) = (Path(os.environ["ISOTUI_CACHE_DIR"]) / "runs").glob("*.safetensors")
    assert entry.stem[:12] in listing.stdout
    assert tiny_models["bert"].name in listing.stdout
    path = isotui("cache", "path").stdout.strip()
    assert path == os.environ["ISOTUI_CACHE_DIR"]
    assert isotui("cache", "rm", "--all").returncode == 0
    assert "no cached runs" in isotui("cache", "ls").stdout


@pytest.mark.slow
def test_uncached_hub_model_with_the_hub_unreachable_is_one_sentence():
    """Online mode but no network (a closed port as the hub): no traceback, one clear line."""
    proc = isotui(
        "run",
        "-m",
        "someorg/not-downloaded",
        env_extra={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "not in the local Hugging Face cache" in proc.stderr and "could not be reached" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_run_takes_a_preset_by_name(tmp_path):
    """`isotui run minilm_builtin` finds the bundled preset; flags still override it."""
    out = tmp_path / "p.json"
    proc = isotui("run", "minilm_builtin", "--max-samples", "6", "--json", str(out), "-q")
    assert proc.returncode == 0, proc.stderr
    (result,) = json.loads(out.read_text())["results"]
    assert result["model"] == "minilm" and len(result["rows"]) == 7
    assert result["meta"]["n_samples"] == 6 and result["meta"]["max_length"] == 128  # from the preset
    missing = isotui("run", "no_such_preset")
    assert missing.returncode == 2 and "no config file or preset named 'no_such_preset'" in missing.stderr


@pytest.mark.slow
def test_models_lists_bundled_presets_and_hf_cache(tmp_path, tiny_models):
    hub = tmp_path / "hub"
    snap = hub / "models--someorg--tiny-bert" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    for f in tiny_models["bert"].iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (hub / "models--someorg--tiny-bert" / "refs").mkdir()
    (hub / "models--someorg--tiny-bert" / "refs" / "main").write_text("a" * 40)
    proc = isotui("models", env_extra={"HF_HUB_CACHE": str(hub)})
    assert proc.returncode == 0, proc.stderr
    for needle in (
        "minilm",
        "random:TYPE",
        "minilm_builtin",
        "godey2024_fig1_text",
        "someorg/tiny-bert",
    ):
        assert needle in proc.stdout, needle
    # and that cached hub model runs offline by id, with and without a revision
    data = tmp_path / "d.txt"
    data.write_text("\n".join(corpus(4)))
    for name in ("someorg/tiny-bert", "someorg/tiny-bert@main", "someorg/tiny-bert@" + "a" * 40):
        proc = isotui("run", "-m", name, "--data", f"text:{data}", "-q", env_extra={"HF_HUB_CACHE": str(hub)})
        assert proc.returncode == 0, proc.stderr
    proc = isotui(
        "run",
        "-m",
        "someorg/tiny-bert@v9",
        "--data",
        f"text:{data}",
        env_extra={"HF_HUB_CACHE": str(hub)},
    )
    assert proc.returncode == 2 and "revision v9" in proc.stderr


@pytest.mark.slow
def test_unwritable_cache_and_csv_paths_are_reported_not_fatal(tmp_path, tiny_models, data):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = isotui(
        "run",
        "-m",
        str(tiny_models["bert"]),
        "--data",
        f"text:{data}",
        "-q",
        "--cache-dir",
        str(blocker / "cache"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "could not write to the cache" in proc.stderr and "avg_cos" in proc.stdout
    proc = isotui(
        "run",
        "-m",
        str(tiny_models["bert"]),
        "--data",
        f"text:{data}",
        "-q",
        "--csv",
        str(blocker / "out.csv"),
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"cannot write {blocker / 'out.csv'}" in proc.stderr


def test_cache_ls_and_rm_all_cover_experiment_results(tmp_path, capsys):
    """Experiment results (attention, drift-block) are listed and removed with the runs."""
    from isotui.cli import main

    root = tmp_path / "c"
    args = ["experiment", "drift-block", "--hidden", "16", "--heads", "2", "--intermediate", "32"]
    args += [
        "--vocab",
        "50",
        "--batch",
        "2",
        "--seq-len",
        "8",
        "--norms",
        "0,5",
        "--cache-dir",
        str(root),
        "-q",
    ]
    assert main(args) == 0
    assert main(["cache", "--cache-dir", str(root), "ls"]) == 0
    assert "drift-block: 1 cached result(s)" in capsys.readouterr().out
    assert main(["cache", "--cache-dir", str(root), "rm", "--all"]) == 0
    assert "removed 1 cached experiment result(s)" in capsys.readouterr().err
    assert not list((root / "drift-block").glob("*.safetensors"))


def test_every_subcommand_help_says_what_it_does(capsys):
    """`isotui models --help` printed its usage only (issue 29): each command's --help carries
    the line `isotui --help` gives it."""
    import argparse

    from isotui.cli import build_parser

    def commands(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    command = action.choices[choice.dest]
                    yield [*path, choice.dest], command.description, choice.help
                    yield from commands(command, [*path, choice.dest])

    found = {tuple(path): (description, line) for path, description, line in commands(build_parser(), [])}
    assert found[("models",)][0] == found[("models",)][1] and found[("cache", "ls")][0] == "list cached runs"
    for path, (description, _line) in found.items():
        with pytest.raises(SystemExit):
            main([*path, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert description and " ".join(description.split()) in out, (path, out[:300])


@pytest.mark.slow
@pytest.mark.parametrize("dry_run", [False, True])
def test_run_never_writes_onto_the_parsed_flags(tmp_path, tiny_models, data, monkeypatch, dry_run):
    """The settings (config file, then flags) are carried as values: no command function writes
    the config's json/cache_dir (or anything else) back onto the parsed Namespace."""
    import copy

    from isotui import cli

    cfg = tmp_path / "job.toml"
    cfg.write_text('json = "from_config.json"\ncache_dir = "from_config_cache"\nmax_samples = 6\n')
    parsed: list[tuple[object, dict]] = []
    parse_args = cli.Parser.parse_args

    def recording(self, args=None, namespace=None):
        ns = parse_args(self, args, namespace)
        parsed.append((ns, copy.deepcopy(vars(ns))))
        return ns

    monkeypatch.setattr(cli.Parser, "parse_args", recording)
    out_csv = tmp_path / "flag.csv"
    argv = ["run", str(cfg), "-m", str(tiny_models["bert"]), "--data", f"text:{data}"]
    argv += ["--max-samples", "3", "-q", *(["--dry-run"] if dry_run else ["--csv", str(out_csv)])]
    assert cli.main(argv) == 0
    (ns, before), *_ = parsed
    assert vars(ns) == before
    if dry_run:
        assert not (tmp_path / "from_config_cache").exists()
        return
    payload = json.loads((tmp_path / "from_config.json").read_text())  # the config's json, beside it
    assert payload["results"][0]["meta"]["n_samples"] == 3  # the flag over the config's 6
    assert out_csv.is_file()
    assert any((tmp_path / "from_config_cache" / "runs").iterdir())  # the config's cache folder
