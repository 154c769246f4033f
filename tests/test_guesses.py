"""Answers that guess right (issue 29 item 5, issue 30 item 10's preset typo): a typo'd model,
model type, preset or flag gets one sentence with the nearest name isotui knows."""

from __future__ import annotations

import asyncio

import pytest

from isotui.cli import build_parser, main
from isotui.spec import make_spec


def _said(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one sentence, one line
    return err


def test_a_misspelt_model_gets_the_bundled_name(capsys, tmp_path):
    assert main(["run", "-m", "minlm", "-q", "--cache-dir", str(tmp_path)]) == 2
    said = _said(capsys)
    assert "did you mean minilm?" in said


def test_a_misspelt_model_gets_a_model_of_the_local_hub_cache(capsys, tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    (hub / "models--EleutherAI--pythia-70m" / "snapshots").mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert main(["run", "-m", "EleutherAI/pythia-70n", "-q", "--cache-dir", str(tmp_path / "c")]) == 2
    assert "did you mean EleutherAI/pythia-70m?" in _said(capsys)
    assert main(["run", "-m", "someone/else-entirely", "-q", "--cache-dir", str(tmp_path / "c")]) == 2
    assert "did you mean" not in _said(capsys)


def test_a_misspelt_model_type_gets_the_type_not_the_list(capsys, tmp_path):
    assert main(["run", "-m", "random:gtp2:n_layer=1", "-q", "--cache-dir", str(tmp_path)]) == 2
    said = _said(capsys)
    assert "did you mean random:gpt2?" in said
    assert "albert" not in said and "..." not in said


def test_a_preset_typo_gets_the_preset_and_where_presets_are_listed(capsys):
    assert main(["run", "godey2024_fig2_charcters", "-q"]) == 2
    said = _said(capsys)
    assert "did you mean godey2024_fig2_characters?" in said and "`isotui models`" in said
    assert main(["run", "nosuchpreset", "-q"]) == 2
    said = _said(capsys)
    assert "no config file or preset named 'nosuchpreset'" in said and "`isotui models`" in said
    assert main(["run", "runs/nope.toml", "-q"]) == 2
    assert "config file runs/nope.toml does not exist" in _said(capsys)


def test_an_unknown_flag_is_said_by_its_subcommand_with_the_nearest_flag(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["run", "--max-sampels", "5"])
    assert stop.value.code == 2
    said = _said(capsys)
    assert said.startswith("isotui run: error: unrecognized arguments: --max-sampels")
    assert "did you mean --max-samples?" in said and "`isotui run --help`" in said
    with pytest.raises(SystemExit):
        main(["experiment", "attention", "--max-length=9", "--headz"])
    said = _said(capsys)
    assert said.startswith("isotui experiment attention: error:") and "did you mean --heads?" in said


def test_dtype_takes_the_short_names_and_a_bad_one_is_one_line(capsys):
    args = build_parser().parse_args(["run", "--dtype", "fp16"])
    assert args.dtype == "float16"
    assert build_parser().parse_args(["run", "--dtype", "BF16"]).dtype == "bfloat16"
    assert make_spec("minilm", dtype="fp32").dtype == "float32"  # config files and the API too
    with pytest.raises(SystemExit):
        main(["run", "--dtype", "fp8"])
    said = _said(capsys)
    assert "invalid choice: 'fp8'" in said and "usage:" not in said


def test_a_missing_checkpoint_folder_is_said(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert main(["experiment", "qk-dynamics", "-c", "runs/nope", "-q"]) == 2
    said = _said(capsys)
    assert "checkpoint folder runs/nope does not exist" in said and str(tmp_path / "runs") in said
    assert main(["experiment", "qk-dynamics", "-c", "elsewhere/nope", "-q"]) == 2
    assert "which is no folder here" in _said(capsys)


def test_the_app_says_a_typo_at_once_and_does_not_keep_it(tmp_path):
    """Offline, a misspelt model is one notification when typed (no job, no torch), and is
    neither selected nor written to the session as the selected model."""
    import tomllib

    from isotui.settings import settings_path
    from isotui.tui.app import IsotuiApp
    from isotui.tui.jobs import JobsTable

    notes: list[str] = []

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache")
        app.notify = lambda message, **_kw: notes.append(message)
        async with app.run_test(size=(120, 36)) as pilot:
            from textual.widgets import Input

            await pilot.press("slash")
            app.query_one("#model-input", Input).value = "minlm"
            await pilot.press("enter")
            await pilot.pause()
            assert app.selected != "minlm"
            assert not app.query_one("#jobs", JobsTable).records  # no job was started
            app.save_session()

    asyncio.run(scenario())
    assert any("did you mean minilm?" in n for n in notes), notes
    saved = tomllib.loads((settings_path().parent / "session.toml").read_text())
    assert "selected" not in saved


def test_the_options_dialog_takes_a_typed_data_path_from_where_the_app_started(tmp_path, monkeypatch):
    """Issue 29 item 4: not from the settings file's folder; a missing one names the folder."""
    import json

    from textual.widgets import Input, Static

    from isotui.settings import settings_path
    from isotui.tui.app import IsotuiApp
    from isotui.tui.options import OptionsScreen

    from .conftest import corpus

    work = tmp_path / "work"
    work.mkdir()
    (work / "corpus.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in corpus(4)))
    monkeypatch.chdir(work)
    assert settings_path().parent != work
    errors: list[str] = []

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache")
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.press("o")
            screen = app.screen
            assert isinstance(screen, OptionsScreen)
            screen.query_one("#opt-data", Input).value = "jsonl:nope.jsonl:body"
            await pilot.press("ctrl+s")
            assert app.screen is screen
            errors.append(str(screen.query_one("#options-error", Static).render()))
            screen.query_one("#opt-data", Input).value = "jsonl:corpus.jsonl:body"
            await pilot.press("ctrl+s")
            assert app.screen is not screen, str(screen.query_one("#options-error", Static).render())
            return app.spec_defaults["data"], app.spec_for("minilm").data

    data, spec = asyncio.run(scenario())
    assert f"relative paths start from {work}, where isotui was started" in " ".join(errors[0].split())
    assert data == f"jsonl:{work / 'corpus.jsonl'}:body"  # kept whole: the session restores it as is
    assert spec.path == str(work / "corpus.jsonl") and spec.field == "body"


def test_a_misspelt_choice_or_figure_gets_the_nearest(capsys):
    with pytest.raises(SystemExit):
        main(["experiment", "atention"])
    assert "did you mean attention?" in _said(capsys)
    with pytest.raises(SystemExit):
        main(["run", "--dtype", "flaot16"])
    assert "did you mean float16?" in _said(capsys)
    assert main(["figure", "godey2024-fig71"]) == 2
    assert "did you mean godey2024-fig7?" in _said(capsys)
