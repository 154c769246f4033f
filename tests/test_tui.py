"""The terminal app through Textual's pilot: run, table, compare, export, errors, lazy torch."""

from __future__ import annotations

import asyncio
import csv
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
from textual.widgets import DataTable, Input, OptionList, Select

from isotui.backend import Backend
from isotui.errors import Cancelled, IsotuiError
from isotui.experiments.layer_pass import Prepared
from isotui.extract.progress import Progress
from isotui.render import distinct_names, shorten
from isotui.tui.app import IsotuiApp
from isotui.tui.help import HelpScreen
from isotui.tui.jobs import JobsTable
from isotui.tui.options import OptionsScreen

from .conftest import corpus


async def _wait(pilot, predicate, timeout=600.0, why=lambda: ""):
    """Until ``predicate`` holds; the limit only stops a hang (the app's jobs run at nice +10, and
    on a loaded 2-core machine a few seconds of CPU can take minutes)."""
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


async def _run_typed(pilot, app, model: str) -> None:
    await pilot.press("slash")
    app.query_one("#model-input", Input).value = model
    await pilot.press("enter")


@pytest.mark.slow
def test_type_a_model_run_it_compare_sort_and_export(tmp_path, tiny_models):
    async def scenario():
        app = _app(tmp_path)
        async with app.run_test(size=(120, 36)) as pilot:
            for name in ("bert", "gpt2"):
                await _run_typed(pilot, app, str(tiny_models[name]))
                await _wait(pilot, lambda n=name: str(tiny_models[n]) in app.results)
            bert, gpt2 = str(tiny_models["bert"]), str(tiny_models["gpt2"])
            table = app.query_one("#layers", DataTable)
            assert table.row_count == 3  # the selected model's layers (embeddings + 2 blocks)
            drift = app.query_one("#drift", DataTable)
            assert drift.row_count == 2
            rho = app.results[gpt2].drift["model"].spearman_rho
            assert drift.get_row_at(1)[2] == f"{rho:.3f}"
            assert app.comparison == [bert, gpt2]
            await pilot.press("m")
            assert app.metric == "avg_cos_xctx"
            # sort by avg_cos (third column), highest first, then reversed
            table.focus()
            table.move_cursor(column=2)
            await pilot.press("s")
            want = [str(i) for i in np.argsort([-r.avg_cos for r in app.results[gpt2].rows], kind="stable")]
            assert [row.key.value for row in table.ordered_rows] == want  # row keys: layer indices
            await pilot.press("s")
            assert [row.key.value for row in table.ordered_rows] == want[::-1]
            await pilot.press("e")  # the comparison set
            await pilot.press("E")  # the shown table only
            await pilot.pause()
            (both,) = tmp_path.glob("isotui-*-comparison.csv")
            rows = list(csv.DictReader(both.open()))
            assert {r["model"] for r in rows} == {bert, gpt2} and len(rows) == 6
            (shown,) = tmp_path.glob("isotui-*-table.csv")
            rows = list(csv.DictReader(shown.open()))
            assert {r["model"] for r in rows} == {gpt2} and len(rows) == 3
            assert [float(r["avg_cos"]) for r in rows] == [r.avg_cos for r in app.results[gpt2].rows]
            await pilot.press("a")  # remove the selected model from the comparison
            assert app.comparison == [bert]
            app.select(bert)  # the drift plot follows the selection
            assert app.query_one("#drift-plot").border_title == shorten(bert, 30)

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_bad_model_is_a_notification_and_nothing_is_lost(tmp_path, tiny_models):
    async def scenario():
        app = _app(tmp_path)
        notes: list[str] = []
        app.notify = lambda message, **_kw: notes.append(message)
        async with app.run_test(size=(80, 24)) as pilot:
            await _run_typed(pilot, app, str(tiny_models["bert"]))
            await _wait(pilot, lambda: str(tiny_models["bert"]) in app.results)
            await _run_typed(pilot, app, "no-such-org/no-such-model")
            await _wait(
                pilot,
                lambda: any("not in the local Hugging Face cache" in n for n in notes),
                timeout=30,
                why=lambda: f"{notes}",
            )
            states = {r.model: r.state for r in app.query_one("#jobs", JobsTable).records.values()}
            assert states == {str(tiny_models["bert"]): "done", "no-such-org/no-such-model": "failed"}
            assert list(app.results) == [str(tiny_models["bert"])]
            assert app.comparison == [str(tiny_models["bert"])]
            assert app.cache.entries()

    asyncio.run(scenario())


def fake_backend(submitted: list, steps: int = 200_000, delay: float = 0.01):
    """A backend whose model is a slow loop: progress every ``delay`` s, stops when asked."""

    def prepare(spec):
        submitted.append(spec)
        return Prepared(spec, f"fake-{len(submitted)}", [], "fp", "dfp", "float32", "cpu")

    def compute(prepared, on_progress, should_stop):
        for i in range(steps):
            if should_stop():
                raise Cancelled()
            on_progress(Progress(i + 1, steps, (i + 1) * 100, (i + 1) * delay, memory_bytes=300 * 2**20))
            time.sleep(delay)
        raise IsotuiError("the fake model has no result")

    return lambda cache, post: Backend(cache, post, compute=compute, prepare=prepare)


@pytest.mark.slow
def test_jobs_pane_shows_progress_and_cancels_the_chosen_job(tmp_path):
    async def scenario():
        submitted: list = []
        app = IsotuiApp(cache_root=tmp_path / "cache", backend_factory=fake_backend(submitted))
        async with app.run_test(size=(120, 36)) as pilot:
            jobs = app.query_one("#jobs", JobsTable)
            for model in ("fake-a", "fake-b", "fake-c"):
                await _run_typed(pilot, app, model)
            await _run_typed(pilot, app, "fake-a")  # identical request: the same job
            await _wait(pilot, lambda: jobs.records.get(1) and jobs.records[1].state == "running")
            await pilot.pause(0.3)
            assert len(jobs.records) == 3
            assert [r.state for r in jobs.ordered()] == ["running", "queued", "queued"]
            cells = jobs.get_row_at(0)
            assert cells[2] == "running" and "%" in cells[3] and cells[6] == "cpu" and cells[7] == "300 MiB"
            assert int(cells[4].replace(",", "")) > 0 and ":" in cells[5]  # tok/s and ETA
            jobs.focus()
            jobs.move_cursor(row=1)  # job 2, queued
            await pilot.press("x")
            await _wait(pilot, lambda: jobs.records[2].state == "cancelled")
            assert jobs.records[1].state == "running" and jobs.records[3].state == "queued"
            jobs.move_cursor(row=jobs.get_row_index("2"))
            await pilot.press("x")  # the picked job has ended: the newest in flight (job 3)
            await _wait(pilot, lambda: jobs.records[3].state == "cancelled")
            app.query_one("#models").focus()
            await pilot.press("x")  # nothing picked: job 1, stopped between batches
            await _wait(pilot, lambda: jobs.records[1].state == "cancelled")
            assert app.backend.in_flight() == [] and app.results == {}

    asyncio.run(scenario())


def test_jobs_pane_shows_each_phase_as_it_is(tmp_path):
    """Loading is not "running 0%": the state is the phase the job's events say (issue 29)."""
    import threading

    go = {phase: threading.Event() for phase in ("tokenising", "running", "finalising")}

    def prepare(spec):
        return Prepared(spec, "fake", [], "fp", "dfp", "float32", "cpu")

    def compute(prepared, on_progress, should_stop):
        on_progress(Progress(0, 8, 0, 0.0, stage="prepare", phase="loading", detail="90.9 MB"))
        go["tokenising"].wait(60)
        on_progress(Progress(0, 8, 0, 0.0, stage="prepare", phase="tokenising", detail="text 8 samples"))
        go["running"].wait(60)
        on_progress(Progress(4, 8, 400, 2.0, phase="running", memory_bytes=300 * 2**20))
        go["finalising"].wait(60)
        done = Progress(8, 8, 800, 4.0, phase="running")
        on_progress(replace(done, stage="finalize", phase="finalising", layers_done=1, layers_total=4))
        while not should_stop():
            time.sleep(0.02)
        raise Cancelled()

    async def scenario():
        app = IsotuiApp(
            cache_root=tmp_path / "cache",
            backend_factory=lambda cache, post: Backend(cache, post, compute=compute, prepare=prepare),
        )
        async with app.run_test(size=(120, 36)) as pilot:
            jobs = app.query_one("#jobs", JobsTable)
            await _run_typed(pilot, app, "fake-model")
            seen = {}
            for phase, cue in (*go.items(), (None, None)):
                await _wait(pilot, lambda: jobs.records.get(1) and jobs.records[1].progress is not None)
                want = {"tokenising": "loading", "running": "tokenising", "finalising": "running"}
                state = want.get(phase or "", "finalising")
                await _wait(pilot, lambda s=state: jobs.records[1].state == s, why=lambda: jobs.records[1])
                await pilot.pause()
                seen[state] = jobs.get_row_at(0)[2:6]
                if cue is not None:
                    cue.set()
            assert seen["loading"] == ["loading", "90.9 MB", "", ""]  # no bar, no 0 tok/s
            assert seen["tokenising"] == ["tokenising", "text 8 samples", "", ""]
            state, bar, speed, eta = seen["running"]
            assert state == "running" and bar.endswith(" 50%") and speed == "200" and eta == "0:02"
            state, bar, speed, eta = seen["finalising"]
            assert state == "finalising" and bar.endswith(" 25% layers") and speed == ""
            await pilot.press("x")
            await _wait(pilot, lambda: jobs.records[1].state == "cancelled")

    asyncio.run(scenario())


def test_a_job_stuck_at_0_percent_on_a_busy_machine_says_why(tmp_path, monkeypatch):
    """A job whose worker gets no CPU posts nothing: its row says so once it has sat at 0% a
    while on a machine whose load is above its cores (issue 30); the job queued behind it waits
    for it, not for the CPU, and says nothing; the first sample done brings the bar back."""
    import threading

    import isotui.tui.jobs as jobs_module

    monkeypatch.setattr(jobs_module, "SLOW_START_S", 0.4)
    monkeypatch.setattr(jobs_module, "load_average", lambda: 20.3)
    monkeypatch.setattr(jobs_module, "usable_cores", lambda: 2)
    release = threading.Event()

    def prepare(spec):
        return Prepared(spec, f"fake-{spec.model}", [], "fp", "dfp", "float32", "cpu")

    def compute(prepared, on_progress, should_stop):
        while not release.wait(0.05):  # starved: nothing to say
            if should_stop():
                raise Cancelled()
        on_progress(Progress(1, 2, 100, 1.0))
        while not should_stop():
            time.sleep(0.05)
        raise Cancelled()

    async def scenario():
        app = IsotuiApp(
            cache_root=tmp_path / "cache",
            backend_factory=lambda cache, post: Backend(cache, post, compute=compute, prepare=prepare),
        )
        async with app.run_test(size=(140, 36)) as pilot:
            jobs = app.query_one("#jobs", JobsTable)
            for model in ("fake-a", "fake-b"):
                await _run_typed(pilot, app, model)
            said = "waiting for CPU: load 20 on 2 cores"
            await _wait(pilot, lambda: jobs.row_count == 2 and jobs.get_row("1")[3] == said)
            assert jobs.records[1].state == "loading" and jobs.get_row("2")[2:4] == ["queued", ""]
            release.set()
            await _wait(pilot, lambda: "%" in jobs.get_row("1")[3])
            await pilot.pause(0.6)  # past SLOW_START_S again: a job that moved says nothing more
            assert "50%" in jobs.get_row("1")[3] and said not in jobs.get_row("2")[3]
            app.backend.close(wait=False)

    asyncio.run(scenario())
    assert jobs_module.waiting_for_cpu(1.5, 2) == ""  # a machine that is not busy: nothing to say


@pytest.mark.slow
def test_models_pane_presets_filter_and_cached_runs(tmp_path, tiny_models):
    async def scenario():
        # 1. a real run fills the cache
        app = _app(tmp_path)
        async with app.run_test(size=(120, 36)) as pilot:
            await _run_typed(pilot, app, str(tiny_models["bert"]))
            await _wait(pilot, lambda: str(tiny_models["bert"]) in app.results)
        expected = app.results[str(tiny_models["bert"])]
        # 2. a new session lists it under cached runs and opens it without any job
        submitted: list = []
        app = IsotuiApp(cache_root=tmp_path / "cache", backend_factory=fake_backend(submitted))
        async with app.run_test(size=(120, 36)) as pilot:
            models = app.query_one("#models", OptionList)
            await _wait(pilot, lambda: models.option_count > 0)  # listed by a worker thread
            ids = [models.get_option_at_index(i).id for i in range(models.option_count)]
            assert ids[:2] == ["header:bundled", "model:minilm"]
            assert "preset:minilm_builtin" in ids and "preset:godey2024_fig1_text" in ids
            assert f"run:{expected.key}" in ids
            models.focus()
            models.highlighted = ids.index(f"run:{expected.key}")
            await pilot.press("enter")
            await pilot.pause()
            shown = app.results[str(tiny_models["bert"])]
            assert shown.from_cache and [r.avg_cos for r in shown.rows] == [r.avg_cos for r in expected.rows]
            assert app.query_one("#layers", DataTable).row_count == len(expected.rows)
            assert submitted == [] and app.query_one("#jobs", JobsTable).records == {}
            # the filter box narrows the list; no match says what enter does
            await pilot.press("slash")
            await pilot.press(*"fig1")
            ids = [models.get_option_at_index(i).id for i in range(models.option_count)]
            assert ids == ["header:presets", "preset:godey2024_fig1_text"]
            await pilot.press("ctrl+a", "ctrl+k", *"zzzq")
            assert models.option_count == 1 and "no match" in str(models.get_option_at_index(0).prompt)
            # a preset runs every model on its own data settings
            await pilot.press("ctrl+a", "ctrl+k", *"minilm_builtin", "down")
            await pilot.press("enter")
            await _wait(pilot, lambda: len(submitted) == 1)
            (spec,) = submitted
            assert (spec.model, spec.max_samples, spec.max_length) == ("minilm", 2000, 128)
            assert spec.data.scheme == "builtin"

    asyncio.run(scenario())


@pytest.mark.slow
def test_the_hf_cache_is_listed_second_and_a_model_of_it_still_restored(tmp_path, tiny_models, monkeypatch):
    """The models list shows at once what needs no scan (bundled, presets, cached runs) and then
    the Hugging Face cache, whose scan imports huggingface_hub's HTTP client (~0.2 s of the first
    frame). The last session's model, a model of the HF cache found only in the second listing,
    still gets the cursor; a cursor the user moved before the second listing stays there."""
    import os
    from pathlib import Path

    import isotui
    from isotui.settings import settings_path
    from isotui.tui import models_pane
    from isotui.tui.session import Session, save_session, session_path

    name = "someorg/tiny-bert"
    repo = Path(os.environ["HF_HUB_CACHE"]) / "models--someorg--tiny-bert"
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    for f in tiny_models["bert"].iterdir():
        (repo / "snapshots" / ("a" * 40) / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "samples.txt"
    data.write_text("\n".join(corpus(4)) + "\n", encoding="utf-8")
    key = isotui.run(name, f"text:{data}", max_samples=4, cache_dir=tmp_path / "cache", progress=False).key
    listings: list[list[str]] = []
    real = models_pane.gather_entries

    def spy(cache, hub=True):
        entries = real(cache, hub=hub)
        listings.append([e.option_id for e in entries])
        return entries

    monkeypatch.setattr(models_pane, "gather_entries", spy)

    async def scenario(move: bool) -> str:
        save_session(session_path(settings_path()), Session(comparison=[(name, key)], selected=name))
        listings.clear()
        app = IsotuiApp(cache_root=tmp_path / "cache", device_probe=lambda: "cpu")
        async with app.run_test(size=(120, 36)) as pilot:
            models = app.query_one("#models", OptionList)
            await _wait(pilot, lambda: models.option_count > 0)
            if move:
                ids = [models.get_option_at_index(i).id for i in range(models.option_count)]
                models.highlighted = ids.index("model:random:gpt2")
            await _wait(pilot, lambda: len(listings) == 2 and models.option_count > len(listings[0]) + 1)
            await pilot.pause()
            return models.get_option_at_index(models.highlighted).id

    assert asyncio.run(scenario(move=False)) == f"model:{name}"
    assert f"model:{name}" not in listings[0] and f"model:{name}" in listings[1]
    assert listings[0] == [i for i in listings[1] if i != f"model:{name}"]
    assert asyncio.run(scenario(move=True)) == "model:random:gpt2"  # the user's cursor stays


def test_a_listing_that_arrives_while_the_app_closes_is_dropped(tmp_path):
    """The models' worker can answer after the app began closing, when the pane is still attached
    but its list is already removed (Textual removes children first): a CI run failed on
    ``NoMatches('#models')`` in a Ray sweep's test. The answer is dropped, not raised."""
    from isotui.tui.models_pane import ModelsPane

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache", backend_factory=fake_backend([]))
        async with app.run_test(size=(100, 30)) as pilot:
            pane = app.query_one(ModelsPane)
            models = app.query_one("#models", OptionList)
            await _wait(pilot, lambda: models.option_count > 0)
            await models.remove()
            assert pane.is_attached
            pane._listed(pane.entries)  # raised NoMatches before the fix
            await pilot.pause()

    asyncio.run(scenario())


@pytest.mark.slow
def test_options_screen_checks_values_and_sets_the_next_jobs(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("\n".join(corpus(5)))

    async def scenario():
        submitted: list = []
        app = IsotuiApp(cache_root=tmp_path / "cache", backend_factory=fake_backend(submitted))
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("o")
            screen = app.screen
            assert isinstance(screen, OptionsScreen)
            screen.query_one("#opt-max_samples", Input).value = "-3"
            await pilot.press("ctrl+s")
            assert app.screen is screen
            error = screen.query_one("#options-error")
            assert "max samples must be a positive integer" in str(error.render())
            screen.query_one("#opt-max_samples", Input).value = "5"
            screen.query_one("#opt-data", Input).value = f"text:{tmp_path / 'missing.txt'}"
            await pilot.press("ctrl+s")
            assert "missing.txt does not exist" in str(error.render())
            screen.query_one("#opt-data", Input).value = f"text:{data}"
            screen.query_one("#opt-dtype", Select).value = "bfloat16"
            screen.query_one("#opt-special_tokens", Select).value = "include"
            screen.query_one("#opt-exact", Select).value = "on"
            await pilot.press("ctrl+s")
            assert app.screen is not screen
            await _run_typed(pilot, app, "some-model")
            await _wait(pilot, lambda: len(submitted) == 1)
            (spec,) = submitted
            assert spec.max_samples == 5 and spec.dtype == "bfloat16" and spec.special_tokens == "include"
            assert spec.exact is True
            assert spec.data.path == str(data)
            await pilot.press("o", "escape")  # backing out changes nothing
            assert app.spec_defaults["max_samples"] == "5"

    asyncio.run(scenario())


def test_help_screen_palette_and_screenshot(tmp_path, monkeypatch):
    settings = tmp_path / "isotui.toml"
    settings.write_text('[keys]\nscreenshot = "p"\n')
    monkeypatch.setenv("ISOTUI_CONFIG", str(settings))

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache", export_dir=tmp_path, device_probe=lambda: "test")
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            listed = {row[1]: row[0] for row in app.screen.rows() if row[1]}
            assert set(listed) == {b.id for b in IsotuiApp.BINDINGS}
            # every short header of the layer table is explained (issue 38: erank, norm, xctx)
            from isotui.render import COLUMNS

            explained = dict(app.screen.columns)
            assert {c.header for c in COLUMNS} <= set(explained)
            assert "entropy" in explained["erank"] and "different samples" in explained["xctx"]
            assert listed["screenshot"] == "p" and listed["run"] == "r"
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)
            titles = [c.title for c in app.get_system_commands(app.screen)]
            for b in IsotuiApp.BINDINGS:
                if b.action != "quit":
                    assert f"isotui: {b.description}" in titles
            await pilot.press("p")
            await pilot.pause()
            (svg,) = tmp_path.glob("isotui-*.svg")
            assert svg.read_text().lstrip().startswith("<svg") and "isotui" in svg.read_text()
            assert "test" in app.sub_title and str(tmp_path / "cache") in app.sub_title

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


@pytest.mark.slow
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


def test_header_names_gpus_from_nvidia_smi_without_torch(monkeypatch):
    """The header's GPU line comes from nvidia-smi's CSV (here a recorded answer), not torch."""
    import subprocess as sp

    from isotui.tui import sysinfo

    answer = "0, NVIDIA H100 80GB HBM3, 72515, 81559\n1, NVIDIA H100 80GB HBM3, 81000, 81559\n"
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return sp.CompletedProcess(cmd, 0, stdout=answer, stderr="")

    monkeypatch.setitem(sys.modules, "pynvml", None)  # no nvidia-ml-py: nvidia-smi answers
    monkeypatch.setattr(sysinfo.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(sysinfo.subprocess, "run", fake_run)
    gpus = sysinfo.query_gpus()
    assert [(g.index, g.free_mib, g.total_mib) for g in gpus] == [(0, 72515, 81559), (1, 81000, 81559)]
    line = sysinfo.describe_devices(gpus)
    assert line.startswith("cuda:0 NVIDIA H100 80GB HBM3 (70.8/79.6 GiB free)") and "cuda:1" in line
    assert "--query-gpu=index,name,memory.free,memory.total" in calls[0]
    monkeypatch.setattr(sysinfo.shutil, "which", lambda name: None)
    assert sysinfo.query_gpus() == [] and "cpu" in sysinfo.describe_devices([])


@pytest.mark.slow
def test_app_max_length_is_capped_at_the_model_limit_and_said_in_app_words(tmp_path, tiny_models):
    """The app's max length (default 128) is a ceiling: above the model's 128 positions it is
    capped with a notice, not refused; the messages name the options dialog's field, no flag."""
    from isotui.tui.lab import LabScreen

    async def scenario():
        app = _app(tmp_path, max_length=300)
        notes: list[str] = []
        app.notify = lambda message, **_kw: notes.append(message)
        bert = str(tiny_models["bert"])
        async with app.run_test(size=(120, 36)) as pilot:
            await _run_typed(pilot, app, bert)
            await _wait(pilot, lambda: bert in app.results, why=lambda: notes)
            assert app.results[bert].meta["max_length"] == 128
            said = "max length 300 is more than"
            assert any(said in n and "capped at its 128 positions" in n for n in notes)
            await pilot.press("A")
            await pilot.pause()
            assert isinstance(app.screen, LabScreen)
            await pilot.press("r")  # attention goes through the same ceiling
            await _wait(pilot, lambda: bert in app.lab_results["attention"], why=lambda: notes)
            assert app.lab_results["attention"][bert].meta["max_length"] == 128
            app.spec_defaults["max_length"] = "-1"
            await pilot.press("r")
            await pilot.pause()
            assert notes[-1] == "max length must be a positive integer (got -1)"
            assert not any("--" in n for n in notes), notes

    asyncio.run(scenario())


def test_progress_reports_are_coalesced(tmp_path):
    """A burst of progress reports while the UI is busy is drawn once, with the newest numbers;
    other events are never dropped."""
    from isotui.backend import JobProgress, JobQueued
    from isotui.spec import make_spec
    from isotui.tui.app import BackendMessage

    spec = make_spec("fake-a")

    def progress(job: int, done: int) -> JobProgress:
        return JobProgress(job, spec, Progress(done, 500, done * 10, 1.0))

    assert BackendMessage(progress(1, 1)).can_replace(BackendMessage(progress(1, 2)))
    assert not BackendMessage(progress(1, 1)).can_replace(BackendMessage(progress(2, 2)))
    assert not BackendMessage(JobQueued(1, spec)).can_replace(BackendMessage(JobQueued(1, spec)))

    async def scenario():
        submitted: list = []
        app = IsotuiApp(cache_root=tmp_path / "cache", backend_factory=fake_backend(submitted))
        async with app.run_test(size=(120, 36)) as pilot:
            jobs = app.query_one("#jobs", JobsTable)
            seen: list = []
            apply = jobs.apply
            jobs.apply = lambda ev: (seen.append(ev), apply(ev))
            app._post_event(JobQueued(7, spec))
            for done in range(1, 501):  # no await: the UI is busy with this burst
                app._post_event(progress(7, done))
            await pilot.pause()
            await pilot.pause()
            kinds = [type(ev).__name__ for ev in seen]
            assert kinds == ["JobQueued", "JobProgress"], kinds
            assert seen[-1].progress.samples_done == 500
            assert jobs.get_row_at(0)[3].endswith("100%")

    asyncio.run(scenario())


@pytest.mark.slow
def test_session_is_restored_can_be_skipped_and_a_damaged_one_is_one_notice(tmp_path, tiny_models):
    """The comparison set (reopened from the result cache, no job), the options and the lab's
    boxes come back; --fresh starts clean; a damaged session file is one notification."""
    import tomllib

    from isotui.cli import build_parser
    from isotui.settings import settings_path

    bert = str(tiny_models["bert"])
    session_file = settings_path().parent / "session.toml"
    drift_text = "hidden=32 heads=4 norms=0:10:3"

    async def first():
        app = _app(tmp_path)
        async with app.run_test(size=(120, 36)) as pilot:
            await _run_typed(pilot, app, bert)
            await _wait(pilot, lambda: bert in app.results)
            await pilot.press("o")
            app.screen.query_one("#opt-max_samples", Input).value = "7"
            await pilot.press("ctrl+s")
            await pilot.press("A", "3")
            await pilot.pause()
            app.screen.query_one("#drift-input", Input).value = drift_text
            await pilot.press("escape")
        return app.results[bert]

    result = asyncio.run(first())
    saved = tomllib.loads(session_file.read_text())
    assert saved["comparison"] == [{"model": bert, "key": result.key}]
    assert saved["options"]["max_samples"] == "7" and saved["lab"]["drift-input"] == drift_text

    async def second(fresh: bool, notes: list[str]):
        submitted: list = []
        app = IsotuiApp(cache_root=tmp_path / "cache", backend_factory=fake_backend(submitted), fresh=fresh)
        app.notify = lambda message, **_kw: notes.append(message)
        async with app.run_test(size=(120, 36)) as pilot:
            await _wait(pilot, lambda: app.entries)
            if not fresh and not notes:
                await _wait(pilot, lambda: bert in app.results)
                assert app.comparison == [bert] and app.selected == bert
                assert [r.avg_cos for r in app.results[bert].rows] == [r.avg_cos for r in result.rows]
                assert app.spec_defaults["max_samples"] == "7"
                await pilot.press("A", "3")
                await pilot.pause()
                assert app.screen.query_one("#drift-input", Input).value == drift_text
            assert submitted == []  # reopened from the cache: nothing computed
            return app

    notes: list[str] = []
    asyncio.run(second(False, notes))
    assert notes == []
    app = asyncio.run(second(True, notes))  # isotui --fresh
    assert app.comparison == [] and app.spec_defaults["max_samples"] == 2000
    assert build_parser().parse_args(["--fresh"]).fresh
    for damage in ("version = [\n", 'version = 1\n[[comparison]]\nmodel = 3\nkey = "k"\n'):
        session_file.write_text(damage)
        notes = []
        app = asyncio.run(second(False, notes))
        assert len(notes) == 1 and f"session file {session_file}" in notes[0], notes
        assert "starting a new session" in notes[0] and app.comparison == []


def test_compare_key_marks_the_list_and_says_what_it_did(tmp_path):
    from isotui.tui.model_list import COMPARED

    from .test_snapshots import fixture_result

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache", backend_factory=fake_backend([]))
        notes: list[str] = []
        app.notify = lambda message, **_kw: notes.append(message)
        async with app.run_test(size=(80, 24)) as pilot:
            models = app.query_one("#models", OptionList)
            await _wait(pilot, lambda: models.option_count > 0)

            def label(option_id: str) -> str:
                return str(models.get_option(option_id).prompt)

            app.add_result(fixture_result("minilm", 7, 384, 0.22))
            await pilot.pause()
            assert label("model:minilm").startswith(COMPARED)
            assert not label("model:random:gpt2").startswith(COMPARED)
            app.select("minilm")
            await pilot.press("a")
            assert app.comparison == [] and not label("model:minilm").startswith(COMPARED)
            assert notes[-1] == "minilm left the comparison (0 models compared)"
            await pilot.press("a")
            assert app.comparison == ["minilm"] and label("model:minilm").startswith(COMPARED)
            assert notes[-1].startswith("minilm added to the comparison (1 model compared")
            app.select("random:gpt2")
            await pilot.press("a")
            assert "run random:gpt2 first" in notes[-1] and app.comparison == ["minilm"]

    asyncio.run(scenario())


def test_exports_go_to_the_settings_export_dir_and_say_the_full_path(tmp_path, monkeypatch):
    from .test_snapshots import fixture_result

    settings = tmp_path / "conf" / "isotui.toml"
    settings.parent.mkdir()
    settings.write_text('export_dir = "exports"\n')  # relative to the settings file
    monkeypatch.setenv("ISOTUI_CONFIG", str(settings))
    monkeypatch.chdir(tmp_path)

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache", backend_factory=fake_backend([]))
        notes: list[str] = []
        app.notify = lambda message, **_kw: notes.append(message)
        async with app.run_test(size=(80, 24)) as pilot:
            app.add_result(fixture_result("minilm", 7, 384, 0.22))
            await pilot.press("e")
            await pilot.pause()
        (written,) = (tmp_path / "conf" / "exports").glob("isotui-*-comparison.csv")
        assert notes[-1] == f"wrote {written} (1 model)" and written.is_absolute()
        assert not list(tmp_path.glob("isotui-*.csv"))  # not the current folder

    asyncio.run(scenario())


def test_moving_through_models_redraws_only_what_changed(tmp_path, monkeypatch):
    """A key in the models list over models with no result redraws neither the drift pane nor
    the layer table (each was a plotext figure or a table rebuilt per key: the busy app's key
    latency, issue 12); a new result still redraws both."""
    import isotui.tui.drift_pane as drift_pane
    from isotui.tui.layer_table import LayerTable

    from .test_snapshots import fixture_result

    curves: list[object] = []
    draw = drift_pane.draw_drift_curves
    monkeypatch.setattr(
        drift_pane,
        "draw_drift_curves",
        lambda plot, result, *a: (curves.append(result), draw(plot, result, *a))[1],
    )

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache", backend_factory=fake_backend([]))
        async with app.run_test(size=(120, 36)) as pilot:
            models = app.query_one("#models", OptionList)
            await _wait(pilot, lambda: models.option_count > 1)
            table = app.query_one("#layers", LayerTable)
            tables: list[object] = []
            redraw = table.redraw
            table.redraw = lambda: (tables.append(table.result), redraw())
            models.focus()
            await pilot.pause()
            curves.clear()
            titles = set()
            for key in ["down", "up"] * 5:
                await pilot.press(key)
                await pilot.pause()
                titles.add(str(table.border_title))
            assert len(titles) == 2, titles  # the highlighted model is named: the keys did move
            assert curves == [] and tables == []
            result = fixture_result("minilm", 7, 384, 0.22)
            app.add_result(result)
            await pilot.pause()
            assert curves[-1] is result and tables[-1] is result

    asyncio.run(scenario())


def test_the_app_freezes_its_startup_objects_out_of_the_collector(tmp_path):
    """After the first frame the app's long-lived objects are frozen (gc.freeze): a full
    collection no longer walks them (it took 50-220 ms every few dozen keys)."""
    import gc

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache", backend_factory=fake_backend([]))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            await pilot.pause()
            assert gc.get_freeze_count() > 10_000

    gc.unfreeze()
    asyncio.run(scenario())


def test_a_device_map_job_holds_every_device_it_uses_and_the_pane_names_them(tmp_path):
    """A job split by --device-map over cuda:0 and the CPU (its --max-memory) runs in a lane of
    its own, yet a CPU job waits until it ends, while a job mapped to cuda:1 alone runs beside
    it; the jobs pane shows each job's devices."""

    async def scenario():
        submitted: list = []
        app = IsotuiApp(cache_root=tmp_path / "cache", backend_factory=fake_backend(submitted, 10**6))
        async with app.run_test(size=(140, 36)) as pilot:
            jobs = app.query_one("#jobs", JobsTable)
            app.submit("fake-split", {"device_map": "auto", "max_memory": "0=1GB,cpu=2GB"})
            await _wait(pilot, lambda: jobs.records.get(1) and jobs.records[1].state == "running")
            app.submit("fake-cpu", {"device": "cpu"})
            app.submit("fake-other-gpu", {"device_map": "auto", "max_memory": "1=1GB"})
            await _wait(pilot, lambda: jobs.records.get(3) and jobs.records[3].state == "running")
            await pilot.pause(0.5)
            assert jobs.records[2].state == "queued"  # the CPU is the split job's
            assert jobs.records[1].device == "cuda:0+cpu (map)" and jobs.records[3].device == "cuda:1 (map)"
            assert jobs.get_row_at(jobs.get_row_index("1"))[6] == "cuda:0+cpu (map)"
            app.backend.cancel(1)
            await _wait(pilot, lambda: jobs.records[2].state == "running")
            assert jobs.records[1].state == "cancelled" and jobs.records[2].device == "cpu"
            for job in (2, 3):
                app.backend.cancel(job)
            await _wait(pilot, lambda: app.backend.in_flight() == [])

    asyncio.run(scenario())


def _canvas(widget) -> list[str]:
    """What ``widget`` draws (its padding too), as lines of text."""
    from textual.geometry import Region

    width, height = widget.outer_size
    return ["".join(seg.text for seg in strip) for strip in widget.render_lines(Region(0, 0, width, height))]


def _colours(widget) -> set[tuple[int, int, int]]:
    """The colours of the braille cells (the curves) ``widget`` draws."""
    from textual.geometry import Region

    width, height = widget.size
    return {
        tuple(seg.style.color.get_truecolor())
        for strip in widget.render_lines(Region(0, 0, width, height))
        for seg in strip
        if seg.style and seg.style.color and any("\u2800" < ch <= "\u28ff" for ch in seg.text)
    }


def test_every_compared_curve_shows_with_its_legend_outside_the_plot(tmp_path):
    """At 80x24 with 4 compared models plotext's legend (one row per model, over the curves)
    covered the whole plot: the legend is beside the plot there and under it at 120x36, never
    on it; the drift plot's legend has no L/⅃ axis glyphs (issue 29)."""
    from .test_snapshots import fixture_result

    models = ("minilm", "random:gpt2", "bert-base-uncased", "EleutherAI/pythia-160m")

    async def scenario(size):
        app = IsotuiApp(cache_root=tmp_path / "cache", fresh=True, device_probe=lambda: "cpu")
        async with app.run_test(size=size) as pilot:
            for i, name in enumerate(models):
                app.add_result(fixture_result(name, 13 if i else 7, 768, 0.2 * (i + 1)))
            await pilot.press("n")
            await pilot.pause()
            plot = app.query_one("#plot")
            canvas = "\n".join(_canvas(plot))
            assert not any(shorten(m, 16)[:6] in canvas for m in models), canvas  # no legend on it
            assert set(app.model_colours()[:4]) <= _colours(plot)  # every curve is drawn
            legend = app.query_one("#plot-legend")
            assert not plot.region.overlaps(legend.region)
            written = "\n".join(_canvas(legend))
            shown = distinct_names(list(models), 16 if size[0] < 120 else 22)
            assert all(name in written for name in shown), written
            beside = legend.region.x >= plot.region.right
            assert beside == (size[0] < 120)  # 80 columns: beside; 120: under it
            if size[0] >= 120:
                drift = app.query_one("#drift-plot")
                assert not any(g in "\n".join(_canvas(drift)) for g in ("⅃", " L ")), _canvas(drift)
                said = "\n".join(_canvas(app.query_one("#drift-legend")))
                assert "drift (left)" in said and "avg_cos (right)" in said

    for size in ((80, 24), (120, 36)):
        asyncio.run(scenario(size))


def test_names_shown_together_are_told_apart():
    """Two untrained models read ``random:…size=128`` in the legend (issue 38): a name too long
    for its place drops what it shares with the others shown, a hub id keeps its last part, a
    name that fits stays whole, and names that would still read the same are numbered."""
    a, b = (f"random:gpt2:n_layer={n},n_head=2,n_embd=128,vocab_size=128" for n in (2, 4))
    assert distinct_names([a, b], 16) == ["…n_layer=2…", "…n_layer=4…"]
    assert shorten(a, 16) == shorten(b, 16)  # what the legend showed before
    names = distinct_names([a, b, "minilm", "EleutherAI/pythia-160m", "EleutherAI/pythia-70m"], 16)
    assert names == ["…n_layer=2…", "…n_layer=4…", "minilm", "pythia-160m", "pythia-70m"]
    assert distinct_names(["x" * 30 + "1", "x" * 30 + "2"], 10) == ["xxxx…xxxx1", "xxxx…xxxx2"]
    same = distinct_names(["random:gpt2:a=1", "random:gpt2:a=2"], 4)
    assert len(set(same)) == 2 and all(len(n) <= 8 for n in same)
    # too long once the shared parts are gone: whole parts are dropped from the end, so a value
    # is never cut (``…n_layer=1…84,n_head=6`` read as one layer)
    c, d = "random:gpt2:n_layer=4,n_embd=64,n_head=4", "random:gpt2:n_layer=12,n_embd=384,n_head=6"
    assert distinct_names([c, d], 22) == ["…n_layer=4,n_embd=64…", "…n_layer=12…"]


def test_at_80x24_jobs_fold_to_a_line_and_the_table_and_plot_keep_their_rows(tmp_path):
    """Three finished jobs and a running one: at 80x24 the jobs pane is one line that counts them
    (it took 6 rows, leaving the plot 2 data rows and the layer table 1); the plot keeps 5 data
    rows and the table 5 layers, as with no jobs. ``j`` unfolds it and folds it again; folded
    it takes no focus. At 120x36 it lists them, and the plot and table keep their rows too."""
    from .test_snapshots import UNTRAINED, add_jobs, fixture_result

    def plot_rows(app) -> int:  # the plot's data rows: between its frame's top and bottom
        lines = _canvas(app.query_one("#plot"))
        top = next(i for i, line in enumerate(lines) if "┌" in line)
        return next(i for i, line in enumerate(lines) if "└" in line) - top - 1

    def layer_rows(app) -> int:  # the layers drawn: lines of the table that start with a layer number
        return sum(line.split()[0].isdigit() for line in _canvas(app.query_one("#layers")) if line.split())

    async def scenario(size):
        app = IsotuiApp(cache_root=tmp_path / "cache", fresh=True, device_probe=lambda: "cpu")
        async with app.run_test(size=size) as pilot:
            for i, name in enumerate(("minilm", *UNTRAINED, "bert-base-uncased")):
                app.add_result(fixture_result(name, 7 + 2 * i, 384, 0.15 * (i + 1)))
            await pilot.pause()
            alone = (plot_rows(app), app.query_one("#layers").size.height)
            add_jobs(app, finished=3, running=1)
            await pilot.pause()
            jobs = app.query_one("#jobs", JobsTable)
            layers = app.query_one("#layers")
            assert plot_rows(app) >= 5 and layer_rows(app) >= 5
            if size == (80, 24):
                assert (plot_rows(app), layers.size.height) == alone
                assert jobs.outer_size.height == 1 and not jobs.can_focus
                assert str(jobs.border_title).startswith("jobs: 1 running, 3 done (j: show) · ")
                assert "40%, ETA 0:30" in str(jobs.border_title)
                await pilot.press("j")
                await pilot.pause()
                assert jobs.outer_size.height == 6 and jobs.can_focus  # the user's choice
                assert "j: fold" in str(jobs.border_title)
                await pilot.press("j")
                await pilot.pause()
                assert jobs.outer_size.height == 1 and (plot_rows(app), layers.size.height) == alone
            else:
                assert jobs.outer_size.height == 6 and jobs.row_count == 4
                names = [jobs.get_row_at(i)[1] for i in range(4)]
                assert len(set(names)) == 4, names  # the untrained models told apart here too

    for size in ((80, 24), (120, 36)):
        asyncio.run(scenario(size))


def test_the_folded_jobs_line_keeps_the_progress_of_a_long_name_on_screen(tmp_path):
    """At 80 columns the folded line cut ``…n_layer=12…384,n_head=6 40%, E…``: the running job's
    name gives way, its progress and ETA stay whole."""
    from types import SimpleNamespace

    from isotui.backend import JobFinished, JobProgress, JobQueued, JobStarted

    models = (
        "minilm",
        "random:gpt2:n_layer=4,n_embd=64,n_head=4",
        "random:gpt2:n_layer=12,n_embd=384,n_head=6",
    )

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache", fresh=True, device_probe=lambda: "cpu")
        async with app.run_test(size=(80, 24)) as pilot:
            jobs = app.query_one("#jobs", JobsTable)
            for i, model in enumerate(models, 1):
                spec = SimpleNamespace(model=model, device="cpu", kind=None)
                jobs.apply(JobQueued(i, spec))
                jobs.apply(JobStarted(i, spec, "cpu"))
                if i < len(models):
                    jobs.apply(
                        JobFinished(i, spec, SimpleNamespace(from_cache=False, meta={"device": "cpu"}))
                    )
                else:
                    jobs.apply(JobProgress(i, spec, Progress(800, 2000, 40_000, 20.0, phase="running")))
            await pilot.pause()
            title = str(jobs.border_title)
            assert title.endswith("40%, ETA 0:30") and "n_layer=12" in title, title
            assert len(title) <= jobs.size.width - 2, title

    asyncio.run(scenario())


def test_list_entries_wrap_between_name_parts_never_mid_word(tmp_path):
    """At 80x24 the models pane is 22 cells wide: a preset name wraps after one of its ``_``,
    not mid-word (``godey2024_fig2_charac`` / ``ters``, issue 29)."""
    from isotui.presets import presets

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache", fresh=True, device_probe=lambda: "cpu")
        async with app.run_test(size=(80, 24)) as pilot:
            models = app.query_one("#models", OptionList)
            await _wait(pilot, lambda: models.option_count > 1)
            await pilot.pause()
            lines = [line.strip(" ▁▇▂▃▄▅▆█▎▌") for line in _canvas(models)]  # less the scrollbar
            names = [p.path.stem for p in presets()][:4]  # those on screen
            long = [n for n in names if len(n) > models.scrollable_content_region.width]
            assert long  # the case in question: names wider than the pane
            for name in names:
                at = next(i for i, line in enumerate(lines) if line and name.startswith(line.rstrip("_")))
                drawn = lines[at] + (lines[at + 1] if not name.startswith(lines[at] + " ") else "")
                assert drawn.startswith(name), (name, lines[at : at + 2])
                if name in long:  # cut after a separator, the rest whole on the next line
                    assert lines[at].endswith("_") and name.startswith(lines[at]), lines[at : at + 2]

    asyncio.run(scenario())
