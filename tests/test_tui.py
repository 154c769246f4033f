"""The terminal app through Textual's pilot: run, table, compare, export, errors, lazy torch."""

from __future__ import annotations

import asyncio
import csv
import subprocess
import sys

from textual.widgets import DataTable, Input

from isotui.tui.app import IsotuiApp

from .conftest import corpus


async def _wait(pilot, predicate, timeout=120.0, why=lambda: ""):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, f"timed out {why()}"
        await pilot.pause(0.1)


def _app(tmp_path, **defaults):
    data = tmp_path / "samples.txt"
    data.write_text("\n".join(corpus(10)) + "\n", encoding="utf-8")
    return IsotuiApp(
        cache_root=tmp_path / "cache",
        spec_defaults={"data": f"text:{data}", "max_samples": None, "max_length": 64, **defaults},
        export_dir=tmp_path,
    )


def test_type_a_model_run_it_compare_and_export(tmp_path, tiny_models):
    async def scenario():
        app = _app(tmp_path)
        async with app.run_test(size=(120, 36)) as pilot:
            for name in ("bert", "gpt2"):
                await pilot.press("slash")
                app.query_one("#model-input", Input).value = str(tiny_models[name])
                await pilot.press("enter")
                await _wait(pilot, lambda n=name: str(tiny_models[n]) in app.results)
            table = app.query_one("#layers", DataTable)
            assert table.row_count == 3  # the selected model's layers (embeddings + 2 blocks)
            drift = app.query_one("#drift", DataTable)
            assert drift.row_count == 2
            rho = app.results[str(tiny_models["gpt2"])].drift["model"].spearman_rho
            assert drift.get_row_at(1)[2] == f"{rho:.3f}"
            assert app.comparison == [str(tiny_models["bert"]), str(tiny_models["gpt2"])]
            await pilot.press("m")
            assert app.metric == "drift_norm"
            await pilot.press("e")
            await pilot.pause()
            exported = list(tmp_path.glob("isotui-*.csv"))
            assert len(exported) == 1
            rows = list(csv.DictReader(exported[0].open()))
            assert {r["model"] for r in rows} == {str(tiny_models["bert"]), str(tiny_models["gpt2"])}
            assert len(rows) == 6
            await pilot.press("a")  # remove the selected model from the comparison
            assert app.comparison == [str(tiny_models["bert"])]

    asyncio.run(scenario())


def test_a_bad_model_is_a_notification_and_nothing_is_lost(tmp_path, tiny_models):
    async def scenario():
        app = _app(tmp_path)
        notes: list[str] = []
        app.notify = lambda message, **_kw: notes.append(message)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("slash")
            app.query_one("#model-input", Input).value = str(tiny_models["bert"])
            await pilot.press("enter")
            await _wait(pilot, lambda: str(tiny_models["bert"]) in app.results)
            await pilot.press("slash")
            app.query_one("#model-input", Input).value = "no-such-org/no-such-model"
            await pilot.press("enter")
            await _wait(
                pilot,
                lambda: any("not in the local Hugging Face cache" in n for n in notes),
                timeout=30,
                why=lambda: f"{notes}",
            )
            assert "failed" in str(app.query_one("#jobs").render())
            assert list(app.results) == [str(tiny_models["bert"])]
            assert app.cache.entries()

    asyncio.run(scenario())


def test_first_frame_without_torch():
    code = (
        "import asyncio, sys\n"
        "from isotui.tui.app import IsotuiApp\n"
        "async def main():\n"
        "    app = IsotuiApp()\n"
        "    async with app.run_test() as pilot:\n"
        "        await pilot.pause()\n"
        "        print('TORCH', 'torch' in sys.modules, 'transformers' in sys.modules)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "TORCH False False" in out.stdout, out.stderr


def test_bundled_themes_load_and_cycle_and_broken_user_theme_is_reported(tmp_path):
    from isotui.paths import resource_dir
    from isotui.tui.themes import load_themes

    themes, problems = load_themes([resource_dir("themes")])
    names = {t.name for t in themes}
    assert {"isotui-dark", "isotui-light", "isotui-high-contrast", "isotui-256"} <= names and not problems
    user = tmp_path / "user-themes"
    user.mkdir()
    (user / "mine.toml").write_text('name = "mine"\nprimary = "#112233"\ndark = false\n')
    (user / "broken.toml").write_text('name = "broken"\nprimary = "not-a-colour"\n')
    (user / "bad.toml").write_text("name = [\n")

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache", theme_dirs=[resource_dir("themes"), user])
        notes: list[str] = []
        app.notify = lambda message, **_kw: notes.append(message)
        async with app.run_test(size=(80, 24)) as pilot:
            assert app.theme == "isotui-dark"
            assert "mine" in app.theme_names and "broken" not in app.theme_names
            problem = notes[0]
            assert f"theme file {user / 'broken.toml'}: primary = 'not-a-colour' is not a colour" in problem
            assert f"theme file {user / 'bad.toml'} is not valid TOML" in problem
            seen = set()
            for _ in app.theme_names:
                await pilot.press("t")
                seen.add(app.theme)
            assert seen == set(app.theme_names)

    asyncio.run(scenario())


def test_settings_file_theme_keys_and_run_options(tmp_path, tiny_models, monkeypatch):
    data = tmp_path / "samples.txt"
    data.write_text("\n".join(corpus(6)) + "\n", encoding="utf-8")
    settings = tmp_path / "isotui.toml"
    settings.write_text(
        'theme = "isotui-light"\n'
        "[run]\n"
        'data = "text:samples.txt"\n'  # relative to the settings file
        "max_samples = 4\n"
        "max_length = 0\n"  # bad: reported by name, the rest still applies
        "[keys]\n"
        'compare = "c"\n'
        'nonsense = "z"\n'
    )
    monkeypatch.setenv("ISOTUI_CONFIG", str(settings))

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache")
        notes: list[str] = []
        app.notify = lambda message, **_kw: notes.append(message)
        async with app.run_test(size=(100, 30)) as pilot:
            assert app.theme == "isotui-light"
            assert (
                f"settings file {settings}: [run] max-length must be a positive integer (got 0)" in notes[0]
            )
            assert "[keys] has no action 'nonsense'" in notes[0]
            await pilot.press("slash")
            app.query_one("#model-input", Input).value = str(tiny_models["bert"])
            await pilot.press("enter")
            await _wait(pilot, lambda: str(tiny_models["bert"]) in app.results)
            result = app.results[str(tiny_models["bert"])]
            assert result.meta["n_samples"] == 4 and result.meta["data"] == f"text:{data}"
            await pilot.press("c")  # remapped from "a"
            assert app.comparison == []

    asyncio.run(scenario())
