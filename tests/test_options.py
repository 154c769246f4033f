"""Run options and layer metrics are declared once (isotui.spec, isotui.results): every front end
(flags, config keys, the settings file, the options dialog, the tables, the plot, the docs) reads
the declaration, so one declared option or metric reaches all of them."""

from __future__ import annotations

import argparse
import asyncio
import csv
import re
from pathlib import Path

import pytest

from isotui.cli import build_parser, main
from isotui.config import RUN_SETTINGS, load_run_config
from isotui.experiments.registry import commands_taking, options_for
from isotui.results import LAYER_METRICS, METRICS, SE_FIELDS, LayerRow
from isotui.settings import RUN_KEYS, load_settings
from isotui.spec import MODEL, RUN_OPTIONS, RunSpec, make_spec

from .conftest import corpus

DOCS = Path(__file__).resolve().parents[1] / "docs"  # the documentation site's pages
# A valid value other than the default for each option: as a flag (text), as a TOML value, and
# the RunSpec field it must become. A new option needs its line here (the test says so).
SAMPLES = {
    "data": ("synthetic:images", '"synthetic:images"', lambda d: d.scheme == "synthetic"),
    "max_samples": ("7", "7", 7),
    "max_length": ("33", "33", 33),
    "batch_size": ("5", "5", 5),
    "device": ("cpu", '"cpu"', "cpu"),
    "device_map": ("sequential", '"sequential"', "sequential"),
    "max_memory": ("cpu=2GiB", '"cpu=2GiB"', (("cpu", 2 << 30),)),
    "threads": ("3", "3", 3),
    "dtype": ("bfloat16", '"bfloat16"', "bfloat16"),
    "special_tokens": ("include", '"include"', "include"),
    "seed": ("9", "9", 9),
    "tokenizer": ("minilm", '"minilm"', "minilm"),
    "trust_remote_code": (None, "true", True),
    "map_units": ("position", '"position"', "position"),
    "reservoir": ("50", "50", 50),
    "exact": (None, "true", True),
    "modules": ("attn_out", '["attn_out"]', ("attn_out",)),
    "stream": (None, "true", True),
    "shard": ("1/4", '"1/4"', (1, 4)),
}
# The CSV header of ``isotui run --csv``, as it has been since the standard errors were added.
CSV_HEADER = (
    "model,component,layer,n_vectors,avg_cos,drift_norm,mean_norm,avg_cos_xctx,avg_cos_centered,"
    "isoscore,eff_rank,top_pc_share,null_p95,above_null,top_rogue_dim,top_rogue_share,rogue_dims,"
    "final_norm,depth,dim,n_zero,n_sample,spectrum_from,isoscore_star,iw,iw_centered,avg_cos_abtt,"
    "avg_cos_std,avg_cos_types,drift_norm_types,intra_sim,self_sim,self_sim_types,data,n_samples,"
    "max_length,special_tokens,dtype,run_key,avg_cos_centered_se,iw_se,iw_centered_se,avg_cos_abtt_se,"
    "avg_cos_std_se,null_mean_p95,above_null_mean,"  # issue 28's test of the mean: appended
    "module"  # issue 27's --modules: appended last
)


def _subparser(command: str) -> argparse.ArgumentParser:
    """The parser of ``isotui run`` or ``isotui experiment NAME``."""
    parser = build_parser()

    def children(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(
            (a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction)),
            {},  # type: ignore[arg-type]
        )

    top = children(parser)
    return top[command] if command in top else children(top["experiment"])[command]


def _flags(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def test_every_option_has_a_sample_here():
    assert set(SAMPLES) == {o.name for o in RUN_OPTIONS}, "give the new option a sample value above"


@pytest.mark.parametrize("option", RUN_OPTIONS, ids=lambda o: o.name)
def test_a_declared_option_reaches_its_flags_config_key_settings_and_dialog(option, tmp_path, monkeypatch):
    flag_text, toml_text, expected = SAMPLES[option.name]
    check = expected if callable(expected) else (lambda v: v == expected)
    # the flag: on every command it applies to, on none of the others (but an experiment whose
    # own parameter of that name takes it: ablate's --modules, its sites)
    from isotui.experiments.params import params_of
    from isotui.experiments.registry import get

    taking = commands_taking(option.scope)
    for command in commands_taking(MODEL):
        own = command != "run" and option.name in {p.name for p in params_of(get(command).params)}
        assert (option.flag in _flags(_subparser(command))) == (command in taking or own), command
    # ... and what the flag says becomes the spec's field (run: through _settings; experiments:
    # through spec_from_args)
    monkeypatch.chdir(tmp_path)
    argv = [option.flag] if flag_text is None else [option.flag, flag_text]
    for command in commands_taking(option.scope):
        if command == "run":
            from isotui.cli import _settings
            from isotui.spec import given_options

            args = build_parser().parse_args(["run", *argv])
            spec = make_spec("minilm", **given_options(_settings(args, None)))
        else:
            from isotui.cli.experiments import spec_from_args

            series = ["-c", "a,b"] if command in ("checkpoints", "qk-dynamics") else []
            args = build_parser().parse_args(["experiment", command, *series, *argv])
            spec = spec_from_args(args, "minilm")
        assert check(getattr(spec, option.name)), (command, getattr(spec, option.name))
    # the config file key (isotui run CONFIG.toml), with its type
    assert RUN_SETTINGS[option.name] == option.toml
    config = tmp_path / "c.toml"
    config.write_text(f"{option.name} = {toml_text}\n", encoding="utf-8")
    given = ("trust_remote_code",) if option.name == "trust_remote_code" else ()
    settings = load_run_config(config, given)
    assert check(getattr(make_spec("minilm", **{option.name: settings[option.name]}), option.name))
    # the app's settings file [run]
    assert (option.name in RUN_KEYS) == option.in_settings
    app_settings = tmp_path / "settings.toml"
    app_settings.write_text(f"[run]\n{option.name} = {toml_text}\n", encoding="utf-8")
    loaded = load_settings(app_settings)
    if option.in_settings:
        assert loaded.problems == [] and option.name in loaded.run
    else:
        assert "has no setting" in loaded.problems[0] and not loaded.run
    # the options dialog: a field for every option that declares one, which sets the option
    if option.label:
        assert _dialog_sets(option.name, flag_text) is True


def _dialog_sets(name: str, text: str | None) -> bool:
    """Open the options dialog, put ``text`` (None: switch on) in the field of ``name``, apply."""
    from textual.app import App
    from textual.widgets import Input, Label, Select

    from isotui.tui.options import OptionsScreen

    result: dict = {}

    class Host(App):
        def on_mount(self) -> None:
            def done(options: dict | None) -> None:
                result.update(options or {})

            self.push_screen(OptionsScreen({"data": "builtin"}), done)

    async def scenario() -> bool:
        app = Host()
        async with app.run_test(size=(110, 32)) as pilot:
            screen = app.screen
            widget = screen.query_one(f"#opt-{name}")
            labels = [str(w.render()) for w in screen.query(Label)]
            option = next(o for o in RUN_OPTIONS if o.name == name)
            assert option.label in labels
            if isinstance(widget, Input):
                widget.value = text or ""
            else:
                assert isinstance(widget, Select)
                widget.value = "on" if text is None else text
            await pilot.press("ctrl+s")
            await pilot.pause()
        spec = make_spec("minilm", **{k: v for k, v in result.items() if k != "base_dir"})
        value = getattr(spec, name)
        if text is None:
            return value is True
        return str(value) == text or value == SAMPLES[name][2] or getattr(value, "scheme", "") == "synthetic"

    return asyncio.run(scenario())


def test_options_that_do_not_apply_are_not_flags_there(capsys):
    """attention and qk-dynamics measure queries and keys (no reservoir, no conv maps, no second
    pass); gradients measures gradients: --reservoir there is not a flag (exit 2)."""
    assert options_for("attention") == options_for("gradients") == options_for("qk-dynamics")
    assert {o.name for o in RUN_OPTIONS} - {o.name for o in options_for("attention")} == {
        "map_units",
        "reservoir",
        "exact",
        "modules",
        "shard",
    }
    with pytest.raises(SystemExit) as stop:
        main(["experiment", "attention", "--reservoir", "50", "-q"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --reservoir 50" in capsys.readouterr().err


def test_checkpoints_take_reservoir_and_exact(tiny_models, tmp_path):
    """The reservoir keeps --reservoir vectors per layer; --exact leaves no sampling error."""
    import shutil

    for step in (0, 1):
        shutil.copytree(tiny_models["bert"], tmp_path / "series" / f"step_{step}")
    data = tmp_path / "t.txt"
    data.write_text("\n".join(corpus(12)) + "\n", encoding="utf-8")
    base = ["experiment", "checkpoints", "-c", str(tmp_path / "series"), "--data", f"text:{data}"]
    base += ["-q", "--no-cache", "--max-length", "32"]
    out = tmp_path / "a.csv"
    assert main([*base, "--reservoir", "20", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 2 * 3 and all(int(r["n_sample"]) == min(20, int(r["n_vectors"])) for r in rows)
    assert all(int(r["n_vectors"]) > 20 for r in rows)
    assert all(float(r["avg_cos_centered_se"]) > 0 for r in rows)
    assert main([*base, "--reservoir", "20", "--exact", "--csv", str(out)]) == 0
    exact = list(csv.DictReader(out.open()))
    assert all(float(r["avg_cos_centered_se"]) == 0 for r in exact)


def test_final_norm_takes_reservoir(tiny_models, tmp_path):
    """final-norm's accumulators keep --reservoir vectors: another reservoir is another result."""
    from isotui.experiments.final_norm import FOLDER
    from isotui.store.cache import ResultCache

    data = tmp_path / "t.txt"
    data.write_text("\n".join(corpus(8)) + "\n", encoding="utf-8")
    cache = tmp_path / "cache"
    base = ["experiment", "final-norm", "-m", str(tiny_models["gpt2"]), "--data", f"text:{data}", "-q"]
    assert main([*base, "--cache-dir", str(cache)]) == 0
    assert main([*base, "--cache-dir", str(cache), "--reservoir", "16"]) == 0
    assert len(ResultCache(cache, folder=FOLDER).scan().entries) == 2


def test_run_spec_fields_are_the_options_and_the_model():
    declared = {o.name for o in RUN_OPTIONS}
    internal = {"model", "cap_max_length", "given"}  # given: a model object (isotui.models.given)
    assert {f for f in RunSpec.__dataclass_fields__} == declared | internal


# -- metrics ---------------------------------------------------------------------------------


def test_metrics_are_layer_row_fields_and_the_csv_header_is_unchanged(tiny_models, tmp_path):
    columns = LayerRow.columns()
    for m in METRICS:
        assert m.name in columns
        assert m.se is None or m.se in columns
        assert m.null is None or m.null in columns
    assert len(LAYER_METRICS) == 17 and tuple(f"{m}_se" for m in SE_FIELDS_OF) == SE_FIELDS
    data = tmp_path / "t.txt"
    data.write_text("\n".join(corpus(4)) + "\n", encoding="utf-8")
    out = tmp_path / "r.csv"
    argv = ["run", "-m", str(tiny_models["bert"]), "--data", f"text:{data}", "-q", "--no-cache"]
    assert main([*argv, "--csv", str(out)]) == 0
    assert out.read_text(encoding="utf-8").splitlines()[0] == CSV_HEADER


SE_FIELDS_OF = ("avg_cos_centered", "iw", "iw_centered", "avg_cos_abtt", "avg_cos_std")


def test_table_columns_plot_cycle_and_wide_choices_come_from_the_metrics():
    from isotui.render import COLUMNS
    from isotui.tui.app import PLOT_METRICS
    from isotui.tui.plots import NULL_METRICS

    assert [c.field for c in COLUMNS] == ["layer", "n_vectors", *(m.name for m in METRICS if m.header)]
    assert [c.header for c in COLUMNS[2:]] == [m.header for m in METRICS if m.header]
    assert tuple(m.name for m in METRICS if m.plottable) == PLOT_METRICS
    assert tuple(m.name for m in METRICS if m.null) == NULL_METRICS
    text = _subparser("run").format_help()
    assert all(re.search(rf"^  {m} +\S", text, re.M) for m in LAYER_METRICS)
    assert all(len(line) <= 80 for line in text.split("layer metrics")[1].splitlines())


def test_wide_accepts_every_layer_metric_and_names_them_when_wrong(capsys):
    assert main(["run", "--wide", "nope", "--max-samples", "2", "-q"]) == 2
    assert ", ".join(LAYER_METRICS) in capsys.readouterr().err


# -- the docs ------------------------------------------------------------------------------


def _page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def test_docs_m_key_lists_every_plotted_metric_in_cycle_order():
    line = next(x for x in _page("app.md").splitlines() if x.startswith("| `m` | `metric` |"))
    listed = re.search(r"\(([^)]*)\)", line)
    assert listed and tuple(listed.group(1).split(", ")) == LAYER_METRICS


def test_docs_o_key_lists_every_dialog_field():
    from isotui.tui.options import CHOICES, SWITCHES, TEXT_FIELDS

    line = next(x for x in _page("app.md").splitlines() if x.startswith("| `o` | `options` |"))
    labels = [label for _, label, *_ in (*TEXT_FIELDS, *CHOICES, *SWITCHES)]
    assert f"data and run options: {', '.join(labels)} (checked before they apply)" in line


def test_docs_what_is_measured_defines_every_metric():
    cells = re.findall(r"^\| ([^|]+) \|", _page("metrics.md"), re.M)
    names = {n.strip("` ") for cell in cells for n in cell.split(",")}
    assert {m.name for m in METRICS} <= names


def options_table() -> str:
    """The docs' table of the run options (docs/guide/options.md), from their declaration
    (isotui.spec); a ``[`` is escaped, as Markdown reads ``[a][b]`` as a link."""
    lines = ["| flag | config key | default | commands | what |", "| --- | --- | --- | --- | --- |"]
    for o in RUN_OPTIONS:
        default = "" if o.default is None else f"`{o.default}`"
        if o.switch:
            default = "on" if o.default else "off"
        key = f"`{o.name}`" if o.in_settings else f"`{o.name}` (not in the app's settings file)"
        taking = commands_taking(o.scope)
        commands = "all" if taking == commands_taking(MODEL) else ", ".join(taking)
        what = o.help.replace("[", "\\[")
        lines.append(f"| `{o.flag}` | {key} | {default} | {commands} | {what} |")
    return "\n".join(lines) + "\n"


def test_docs_options_table_is_the_declaration():
    table = options_table()
    assert table in _page("guide/options.md"), (
        "docs/guide/options.md's table differs from isotui.spec; it should read:\n" + table
    )
