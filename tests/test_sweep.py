"""``isotui sweep``: two tiny models x three checkpoints x two shards, on local processes and on a
local Ray cluster, give the CSV of the plain runs one after the other; a task killed mid-run is
retried and nothing is lost or counted twice; a rerun answers from the cache.

The plain runs run in this process (``isotui run -m ...``, another cache folder); the sweep's tasks
are real ``isotui run --shard`` processes. The shards' float32 batch products round differently
from one pass (``test_shards.py`` checks the merge to 1e-12 with float64 products), so numbers
are compared to 1e-6 relative; counts and text exactly. One cell is checked against numpy's
average cosine over all pairs of that layer's vectors (``tests/reference.py``).
"""

from __future__ import annotations

import asyncio
import csv
import math
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from isotui.cli import main

from .conftest import corpus
from .reference import hidden_vectors
from .test_tui import _wait

N = 9  # samples: odd, so the two shards differ in size
MAX_LENGTH = 16
STEPS = ("step_0", "step_100", "step_200")
SWEEPS = Path(__file__).resolve().parents[1] / "docs" / "guide" / "sweeps.md"


@pytest.fixture(scope="module")
def series(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """Each tiny model's checkpoint series folder: step 0, then its embeddings shifted along one
    direction (a little more at each step)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    out = {}
    for arch in ("bert", "gpt2"):
        root = tmp_path_factory.mktemp("series") / arch
        tok = AutoTokenizer.from_pretrained(str(tiny_models[arch]))
        direction = torch.randn(32, generator=torch.Generator().manual_seed(5))
        for i, step in enumerate(STEPS):
            model = AutoModel.from_pretrained(str(tiny_models[arch]))
            with torch.no_grad():
                model.get_input_embeddings().weight += 0.05 * i * direction
            model.save_pretrained(root / step)
            tok.save_pretrained(root / step)
        out[arch] = root
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[list[str], Path]:
    lines = corpus(N)
    path = tmp_path_factory.mktemp("data") / "texts.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return lines, path


@pytest.fixture(scope="module")
def plain(series, data, tmp_path_factory) -> list[dict[str, str]]:
    """The six plain runs, one after the other, in this process: their CSV rows."""
    folder = tmp_path_factory.mktemp("plain")
    out = folder / "plain.csv"
    models = [a for arch in ("bert", "gpt2") for s in STEPS for a in ("-m", str(series[arch] / s))]
    argv = ["run", *models, "--data", f"text:{data[1]}", "--max-length", str(MAX_LENGTH), "--reservoir", "20"]
    assert main([*argv, "--cache-dir", str(folder / "cache"), "--csv", str(out), "-q"]) == 0
    return _rows(out)


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _config(folder: Path, series: dict[str, Path], data: Path, **sweep: object) -> Path:
    """A sweep config beside its output: the two series folders, their three checkpoints."""
    folder.mkdir(parents=True, exist_ok=True)
    table = "\n".join(f"{k} = {_toml(v)}" for k, v in sweep.items())
    text = f"""models = [{_toml(str(series["bert"]))}, {_toml(str(series["gpt2"]))}]
data = {_toml("text:" + str(data))}
max_length = {MAX_LENGTH}
reservoir = 20
cache_dir = "cache"
csv = "out.csv"

[sweep]
checkpoints = [{", ".join(_toml(s) for s in STEPS)}]
shards = 2
{table}
"""
    path = folder / "sweep.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _toml(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


def _assert_same_csv(plain: list[dict[str, str]], swept: list[dict[str, str]]) -> None:
    """Same rows and columns; text and counts exactly, numbers to 1e-6 relative (standard errors
    to 1e-4: the jackknife over held exact directions moves with the float32 rounding of another
    batching, about 1e-6 relative, which a standard error's own precision does not resolve)."""
    assert [list(r) for r in plain] == [list(r) for r in swept]
    for a, b in zip(plain, swept, strict=True):
        for k, x in a.items():
            y = b[k]
            if k in ("time_s", "tokens_per_s", "load_s", "forward_s", "tokenise_s", "metrics_s"):
                continue
            try:
                fx, fy = float(x), float(y)
            except ValueError:
                assert x == y, k
                continue
            if x.lstrip("-").isdigit() or math.isnan(fx):
                assert x == y, (k, x, y)
            else:
                rel = 1e-4 if k.endswith("_se") else 1e-6
                assert fy == pytest.approx(fx, rel=rel, abs=1e-9), (a["model"], a["layer"], k)


class KillOnce:
    """Kill (SIGKILL) the first task process of this test that has been running ``after`` s: an
    ``isotui run --shard`` process, or a Ray worker while it runs a task (its title is then
    ``ray::ray_task``), whose environment names this test's own folder ``marker``."""

    def __init__(self, marker: str, after: float = 1.0) -> None:
        self.marker, self.after, self.killed = marker.encode(), after, b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> KillOnce:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _task(self, entry: Path) -> bytes:
        """The process's command line when it is one of this test's tasks, else b""."""
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if b"--shard" not in cmdline.split(b"\0") and not cmdline.startswith(b"ray::ray_task"):
                return b""
            return cmdline if self.marker in (entry / "environ").read_bytes() else b""
        except OSError:
            return b""

    def _watch(self) -> None:
        seen: dict[int, float] = {}
        while not self._stop.is_set() and not self.killed:
            for entry in Path("/proc").iterdir():
                cmdline = self._task(entry) if entry.name.isdigit() else b""
                if not cmdline:
                    continue
                pid = int(entry.name)
                if time.monotonic() - seen.setdefault(pid, time.monotonic()) >= self.after:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    self.killed = cmdline
                    break
            time.sleep(0.1)


def _numpy_avg_cos(model: Path, lines: list[str], layer: int) -> float:
    layers, _ = hidden_vectors(str(model), lines, max_length=MAX_LENGTH)
    x = layers[layer]
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    g = u @ u.T
    n = len(x)
    return float((g.sum() - np.trace(g)) / (n * (n - 1)))


def _sweep_with_a_kill(config: Path, capsys) -> str:
    with KillOnce(os.environ["ISOTUI_CACHE_DIR"]) as killer:  # this test's own (conftest)
        code = main(["sweep", str(config), "-q"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert killer.killed, "no task process was seen to kill"
    assert "failed" not in err
    return err


@pytest.mark.slow
def test_local_sweep_equals_the_plain_runs_a_killed_task_is_retried_and_a_rerun_is_cached(
    series, data, plain, tmp_path, capsys
):
    config = _config(tmp_path / "local", series, data[1], retries=1, workers=2)
    err = _sweep_with_a_kill(config, capsys)
    assert "12 of 12 tasks to run" in err
    assert re.search(r"shard [01]/2: its process was killed by SIGKILL; retrying", err)
    swept = _rows(tmp_path / "local" / "out.csv")
    _assert_same_csv(plain, swept)
    from isotui.experiments.shards import partial_runs

    assert partial_runs(tmp_path / "local" / "cache") == []  # every run merged, no shard left over
    # one cell against numpy over all pairs: the gpt2 series' last checkpoint, layer 1
    model = series["gpt2"] / STEPS[-1]
    (row,) = [r for r in swept if r["model"] == str(model) and r["layer"] == "1"]
    assert float(row["avg_cos"]) == pytest.approx(_numpy_avg_cos(model, data[0], 1), rel=1e-5)
    # a rerun: every task answered from the cache, no process started
    (tmp_path / "local" / "out.csv").unlink()
    assert main(["sweep", str(config), "-q"]) == 0
    assert "all 12 tasks of the sweep are cached" in capsys.readouterr().err
    assert _rows(tmp_path / "local" / "out.csv") == swept


@pytest.mark.slow
def test_ray_sweep_equals_the_plain_runs_and_retries_a_killed_task(series, data, plain, tmp_path, capsys):
    pytest.importorskip("ray")
    config = _config(tmp_path / "ray", series, data[1], executor="ray", retries=2)
    err = _sweep_with_a_kill(config, capsys)
    assert "Token authentication" not in err  # Ray's own start-up notice is not the sweep's news
    _assert_same_csv(plain, _rows(tmp_path / "ray" / "out.csv"))


def test_rays_token_notice_stays_out_of_the_sweeps_output():
    """Ray says "Token authentication is enabled for this Ray cluster..." on each local start
    (issue 29): its logger is quieted before ``ray.init``; its errors still show."""
    setup = pytest.importorskip("ray._private.authentication.authentication_token_setup")  # Ray 2.5x
    import logging

    from isotui.sweep import quiet_ray_notices

    logger = logging.getLogger(setup.__name__)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.NOTSET)  # as a fresh process has it (a sweep run earlier quieted it)
    try:
        setup._warn_token_auth_enabled()  # Ray's own words, as ray.init says them
        assert any("Token authentication is enabled" in r.getMessage() for r in records)
        records.clear()
        quiet_ray_notices()
        setup._warn_token_auth_enabled()
        logger.error("a real problem")
        assert [r.getMessage() for r in records] == ["a real problem"]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.slow
def test_a_task_that_keeps_failing_is_said_and_the_others_finish(series, data, tmp_path, capsys):
    """One checkpoint folder without weights: its tasks fail (bad input, not retried), the other
    runs are measured and written; the exit status says it, the closing line names them."""
    import shutil

    broken = tmp_path / "s"
    shutil.copytree(series["bert"], broken)
    for f in (broken / STEPS[1]).glob("*.safetensors"):
        f.unlink()
    config = _config(tmp_path / "bad", {"bert": broken, "gpt2": series["gpt2"]}, data[1], workers=1)
    config.write_text(config.read_text().replace("shards = 2", "shards = 1"), encoding="utf-8")
    config.write_text(
        config.read_text().replace(f'"{series["gpt2"]}"', "").replace(", ]", "]"), encoding="utf-8"
    )
    code = main(["sweep", str(config), "-q"])
    err = capsys.readouterr().err
    assert code == 2
    assert "1 of 3 tasks failed: step_100" in err
    rows = _rows(tmp_path / "bad" / "out.csv")
    assert {Path(r["model"]).name for r in rows} == {"step_0", "step_200"}


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ("shards = 2\ncolour = 1", "[sweep] has no key 'colour'"),
        ("shards = 0", "[sweep] shards = 0"),
        ('executor = "slurm"', "[sweep] executor = 'slurm' is not one of local, ray"),
        ("retries = -1", "[sweep] retries = -1 must be 0 or more"),
        ('shards = "2"', "[sweep] shards must be a whole number"),
        ("checkpoints = []", "[sweep] checkpoints must be a non-empty list"),
        ("shared_cache = false", '[sweep] shared_cache is for executor = "ray"'),
        ('executor = "ray"\nshared_cache = "no"', "[sweep] shared_cache must be a boolean (true or false)"),
        (
            'executor = "ray"\nshared_cache = true\nworker_cache_dir = "/x"',
            "worker_cache_dir is for shared_cache = false",
        ),
    ],
)
def test_a_bad_sweep_table_is_one_sentence_naming_the_key(tmp_path, capsys, table, said):
    config = tmp_path / "sweep.toml"
    config.write_text(f'model = "minilm"\n\n[sweep]\n{table}\n', encoding="utf-8")
    assert main(["sweep", str(config)]) == 2
    err = capsys.readouterr().err
    assert said in err and f"config file {config}" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_ray_missing_is_one_sentence_with_the_install_command(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    config = tmp_path / "sweep.toml"
    config.write_text('model = "minilm"\n\n[sweep]\nexecutor = "ray"\n', encoding="utf-8")
    assert main(["sweep", str(config)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'isotui[ray]'" in err and len(err.strip().splitlines()) == 1


def test_a_run_of_a_sweep_config_ignores_its_sweep_table(tmp_path):
    from isotui.config import load_run_config

    config = tmp_path / "sweep.toml"
    config.write_text('model = "minilm"\n\n[sweep]\nshards = 4\n', encoding="utf-8")
    assert load_run_config(config)["sweep"] == {"shards": 4}


def test_docs_sweep_example_is_a_valid_sweep_config(tmp_path):
    """The sweeps page's config examples (its ``toml`` blocks) read as sweep configs: the first a
    whole one, the one for Ray without a shared file system its ``[sweep]`` table."""
    from isotui.config import load_run_config
    from isotui.sweep import read_sweep

    first, *more = re.findall(r"^```toml\n(.*?)^```", SWEEPS.read_text(encoding="utf-8"), re.S | re.M)
    config = tmp_path / "sweep.toml"
    config.write_text(first, encoding="utf-8")
    settings = load_run_config(config)
    sweep = read_sweep(config, settings["sweep"])
    assert sweep.shards > 1 and sweep.checkpoints and settings["models"]
    (driver,) = more
    config.write_text(driver, encoding="utf-8")
    sweep = read_sweep(config, load_run_config(config)["sweep"])
    assert sweep.executor == "ray" and not sweep.shares_cache() and sweep.worker_cache_dir


@pytest.mark.slow
def test_a_sweep_resumes_from_the_shards_already_cached(tiny_models, data, tmp_path, capsys):
    """Shard 0/2 cached by an earlier (interrupted) sweep: only shard 1/2 runs, and it merges."""
    folder = tmp_path / "resume"
    folder.mkdir()
    config = folder / "sweep.toml"
    config.write_text(
        f'model = "{tiny_models["bert"]}"\ndata = "text:{data[1]}"\nmax_length = {MAX_LENGTH}\n'
        'cache_dir = "cache"\ncsv = "out.csv"\n\n[sweep]\nshards = 2\n',
        encoding="utf-8",
    )
    assert main(["run", str(config), "--shard", "0/2", "-q"]) == 0
    capsys.readouterr()
    assert main(["sweep", str(config), "-q"]) == 0
    err = capsys.readouterr().err
    assert "1 of 2 tasks to run on local processes (1 cached)" in err
    (row, *_) = _rows(folder / "out.csv")
    assert int(row["n_samples"]) == N


# --- the app: a sweep is one job over its tasks ---------------------------------------------------------

ROW_NUMBERS = ("n_vectors", "avg_cos", "drift_norm", "mean_norm", "avg_cos_centered", "isoscore", "eff_rank")


def _sweep_row(app) -> list[str]:
    from isotui.tui.jobs import JobsTable

    table = app.query_one("#jobs", JobsTable)
    (rec,) = [r for r in table.records.values() if r.model.startswith("sweep: ")]
    return list(rec.cells())


def _app_config(folder: Path, models: list[Path], data: Path, sweep: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "app_sweep.toml"
    path.write_text(
        f"models = [{', '.join(_toml(str(m)) for m in models)}]\ndata = {_toml('text:' + str(data))}\n"
        f'max_length = {MAX_LENGTH}\nreservoir = 20\ncache_dir = "cache"\n\n[sweep]\nworkers = 1\n{sweep}\n',
        encoding="utf-8",
    )
    return path


@pytest.mark.slow
def test_a_sweep_from_the_app_is_one_job_counting_tasks_and_ends_with_the_plain_runs_numbers(
    series, data, plain, tmp_path
):
    """One checkpoint in two shards (2 tasks, workers = 1): one row in the jobs pane counting tasks,
    then the merged run in the app with the plain run's numbers (and numpy's average cosine)."""
    model = series["bert"] / STEPS[1]
    config = _app_config(tmp_path / "cfg", [model], data[1], "shards = 2")
    _sweep_in_app(tmp_path, config, model, plain, data, executor="local")
    # its shards merged into the app's cache: the runs are listed there, nothing left over
    from isotui.experiments.shards import partial_runs

    assert partial_runs(tmp_path / "appcache") == []
    assert _cached(model, data[1], tmp_path / "appcache")


def _sweep_in_app(tmp_path: Path, config: Path, model: Path, plain, data, *, executor: str) -> None:
    """Run the sweep ``config`` from the app until its job ends: done, its row counting the two
    tasks and naming ``executor``, and the merged run with the plain run's numbers (and numpy's
    average cosine at layer 1)."""
    from isotui.tui.app import IsotuiApp

    seen: list[str] = []

    async def go() -> None:
        app = IsotuiApp(cache_root=tmp_path / "appcache", export_dir=tmp_path, fresh=True)
        async with app.run_test(size=(140, 40)) as pilot:
            app.run_config(config)
            await _wait(pilot, lambda: str(model) in app.results or _last_state(app, seen) == "failed")
            assert _last_state(app, seen) == "done", seen
            result = app.results[str(model)]
        assert any(re.search(r"\b[01]/2 tasks$", cells[3]) for cells in _seen_cells), seen
        assert _seen_cells[-1][6] == executor  # the device column names the executor
        rows = {r["layer"]: r for r in plain if r["model"] == str(model)}
        assert len(result.rows) == len(rows)
        for row in result.rows:
            for k in ROW_NUMBERS:
                want = float(rows[str(row.layer)][k])
                assert getattr(row, k) == pytest.approx(want, rel=1e-6, abs=1e-9), (row.layer, k)
        (one,) = [r for r in result.rows if r.layer == 1]
        assert one.avg_cos == pytest.approx(_numpy_avg_cos(model, data[0], 1), rel=1e-5)

    _seen_cells.clear()
    asyncio.run(go())


_seen_cells: list[list[str]] = []


def _last_state(app, seen: list[str]) -> str:
    """The sweep row's state now (each distinct row remembered in ``_seen_cells``)."""
    try:
        cells = _sweep_row(app)
    except ValueError:
        return ""
    if not _seen_cells or _seen_cells[-1] != cells:
        _seen_cells.append(cells)
        seen.append(" | ".join(cells))
    return cells[2]


@pytest.mark.slow
def test_a_failed_task_of_an_app_sweep_is_one_sentence_and_the_other_run_is_added(series, data, tmp_path):
    """A checkpoint folder without weights: its task fails (a notification, one sentence), the
    other checkpoint's run still joins the app; the row ends done, the closing notice names it."""
    import shutil

    from isotui.tui.app import IsotuiApp

    broken = tmp_path / "s"
    shutil.copytree(series["bert"], broken)
    for f in (broken / STEPS[1]).glob("*.safetensors"):
        f.unlink()
    config = _app_config(tmp_path / "cfg", [broken], data[1], f'checkpoints = ["{STEPS[0]}", "{STEPS[1]}"]')
    notes: list[str] = []

    async def go() -> None:
        app = IsotuiApp(cache_root=tmp_path / "appcache", export_dir=tmp_path, fresh=True)
        async with app.run_test(size=(140, 40)) as pilot:
            app.notify = lambda message, **_kw: notes.append(message)  # type: ignore[method-assign]
            app.run_config(config)
            await _wait(pilot, lambda: _last_state(app, []) in ("done", "failed"))
            assert _last_state(app, []) == "done"
            assert list(app.results) == [str(broken / STEPS[0])]

    _seen_cells.clear()
    asyncio.run(go())
    (failed,) = [n for n in notes if "task step_100 failed" in n]
    assert failed.count(". ") == 0 and "\n" not in failed and "Traceback" not in failed, failed
    closing = "sweep app_sweep: 1 run added to the comparison; 1 failed: step_100"
    assert any(n.startswith(closing) for n in notes), notes


def _task_pids(marker: str) -> list[int]:
    """The processes whose command line names ``marker`` (this test's config file), the sweep's
    own left out: a child it forks (to run a task, or any other command) has the sweep's command
    line until it execs, and counting it as the first task sent ^C before any task had started
    (a CI run: "3 not started")."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            line = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
            if marker.encode() in line and b"\x00sweep\x00" not in line:
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_cancelling_an_app_sweep_stops_its_tasks_and_adds_nothing(series, data, tmp_path):
    """x on a running sweep: the running task's process is terminated, the next never starts,
    the row ends cancelled and no run is cached or added."""
    from isotui.tui.app import IsotuiApp

    models = [series["bert"] / STEPS[0], series["gpt2"] / STEPS[0]]
    config = _app_config(tmp_path / "cfg", models, data[1], "")
    seen_pids: list[int] = []

    async def go() -> None:
        app = IsotuiApp(cache_root=tmp_path / "appcache", export_dir=tmp_path, fresh=True)
        async with app.run_test(size=(140, 40)) as pilot:
            app.run_config(config)

            def running() -> bool:
                seen_pids.extend(_task_pids(str(config)))
                return bool(seen_pids)

            await _wait(pilot, running)
            await pilot.press("x")
            await _wait(pilot, lambda: _last_state(app, []) in ("cancelled", "done", "failed"))
            assert _last_state(app, []) == "cancelled"
            assert app.results == {}

    _seen_cells.clear()
    asyncio.run(go())
    assert len(set(seen_pids)) == 1
    assert _task_pids(str(config)) == []  # terminated, and the second task never started
    assert not any(_cached(m, data[1], tmp_path / "appcache") for m in models)


def _cached(model: Path, data: Path, root: Path) -> bool:
    """Whether the cache at ``root`` holds the plain run of ``model`` on the test's settings."""
    from isotui.experiments import layer_pass
    from isotui.spec import make_spec
    from isotui.store.cache import ResultCache

    cache = ResultCache(root)
    spec = make_spec(str(model), data=f"text:{data}", max_length=MAX_LENGTH, reservoir=20)
    return layer_pass.lookup(layer_pass.prepare(spec, cache), cache) is not None


@pytest.mark.slow
def test_a_ray_sweep_from_the_app_shows_its_tasks_and_ends_with_the_plain_runs_numbers(
    series, data, plain, tmp_path
):
    """``executor = "ray"`` from the app: the sweep job (in the backend's worker process) starts a
    local Ray cluster there, the jobs pane counts its two tasks and names the executor, and the
    merged run joins the app with the plain run's numbers."""
    pytest.importorskip("ray")
    model = series["gpt2"] / STEPS[2]
    config = _app_config(tmp_path / "cfg", [model], data[1], 'shards = 2\nexecutor = "ray"')
    config.write_text(config.read_text().replace("workers = 1\n", ""), encoding="utf-8")  # local's key
    _sweep_in_app(tmp_path, config, model, plain, data, executor="ray")


# --- where a sweep's tasks run: GPUs placed as users expect (issue 24) -------------------------------


def test_local_gpu_groups_are_disjoint_and_sized_as_asked():
    from isotui.errors import IsotuiError
    from isotui.sweep import gpu_groups

    eight = [str(i) for i in range(8)]
    assert gpu_groups(eight, None) == eight  # default: one GPU per task
    assert gpu_groups(eight, 2) == ["0,1", "2,3", "4,5", "6,7"]
    assert gpu_groups(eight, 3) == ["0,1,2", "3,4,5"]  # 6 and 7 stay idle: no task gets a partial set
    assert gpu_groups(["4", "6"], 1) == ["4", "6"]  # CUDA_VISIBLE_DEVICES as the user set it
    assert gpu_groups(eight, 0) == [""]  # on the CPU: every GPU hidden from the tasks
    assert gpu_groups([], None) == [None]  # a CPU-only machine: the environment as it is
    with pytest.raises(IsotuiError, match=r"gpus_per_task = 16, but this machine has 8 GPUs visible"):
        gpu_groups(eight, 16)
    with pytest.raises(IsotuiError, match="no GPU visible"):
        gpu_groups([], 1)


def test_local_tasks_get_their_own_gpus_while_they_run(monkeypatch, tmp_path):
    """Four faked GPUs, two per task, six tasks: every task's CUDA_VISIBLE_DEVICES is a pair, and
    no two tasks that run at the same time share a GPU."""
    from isotui import sweep

    monkeypatch.setattr(sweep, "local_devices", lambda: ["0", "1", "2", "3"])
    held: set[str] = set()
    seen: list[str] = []
    clash: list[str] = []
    lock = threading.Lock()

    def fake_task(argv, env=None, should_stop=sweep.never):
        gpus = env["CUDA_VISIBLE_DEVICES"].split(",")
        with lock:
            seen.append(env["CUDA_VISIBLE_DEVICES"])
            clash.extend(g for g in gpus if g in held)
            held.update(gpus)
        time.sleep(0.05)
        with lock:
            held.difference_update(gpus)
        return 0, ""

    monkeypatch.setattr(sweep, "run_task", fake_task)
    jobs = [(sweep.Task(f"m{i}", 0, 1), [str(i)]) for i in range(6)]
    for workers in (None, 4):  # 4 workers on 2 pairs (issue 36): two of them queue, never share
        seen.clear()
        said: list[str] = []
        settings = sweep.SweepSettings(gpus_per_task=2, workers=workers)
        results = sweep.run_local(jobs, settings, lambda _r: None, said.append)
        assert all(r.ok for r in results) and len(seen) == 6
        assert set(seen) <= {"0,1", "2,3"} and not clash
        assert (workers is not None) == any("2 tasks run at once" in t for t in said), said


def test_ray_tasks_take_a_gpu_each_where_the_cluster_has_them():
    from isotui.errors import IsotuiError
    from isotui.sweep import ray_gpus_per_task

    assert ray_gpus_per_task(None, {"CPU": 16.0, "GPU": 8.0}) == 1.0  # before: 0, every task on cuda:0
    assert ray_gpus_per_task(None, {"CPU": 2.0}) == 0.0
    assert ray_gpus_per_task(0.5, {"GPU": 1.0}) == 0.5
    assert ray_gpus_per_task(2, {"GPU": 8.0}) == 2
    with pytest.raises(IsotuiError, match="the Ray cluster has 0 GPUs: no task could ever start"):
        ray_gpus_per_task(1, {"CPU": 2.0})


def test_a_fraction_of_a_gpu_is_for_ray_only(tmp_path):
    from isotui.errors import IsotuiError
    from isotui.sweep import read_sweep

    with pytest.raises(IsotuiError, match=r"gpus_per_task = 0.5: a local task gets whole GPUs"):
        read_sweep(tmp_path / "s.toml", {"gpus_per_task": 0.5})
    assert read_sweep(tmp_path / "s.toml", {"executor": "ray", "gpus_per_task": 0.5}).gpus_per_task == 0.5
    assert read_sweep(tmp_path / "s.toml", {}).gpus_per_task is None
