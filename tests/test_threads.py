"""--threads: torch's CPU threads for a run, a default that does not oversubscribe, never in the key."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from isotui.extract import threads as threads_mod
from isotui.spec import make_spec

from .conftest import corpus


def isotui(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return subprocess.run(
        [sys.executable, "-m", "isotui", *args],
        capture_output=True,
        text=True,
        env={**env, **(env_extra or {})},
        timeout=600,
    )


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(8)) + "\n", encoding="utf-8")
    return path


def test_default_is_the_usable_cores_on_an_idle_machine():
    assert threads_mod.default_threads(4, 3.9) == (4, None)
    assert threads_mod.default_threads(4, 4.0) == (4, None)
    assert threads_mod.default_threads(2, None) == (2, None)


@pytest.mark.parametrize(("cores", "load"), [(2, 2.7), (2, 3.5), (8, 9.0), (8, 30.0), (64, 70.0), (1, 5.0)])
def test_a_loaded_machine_gets_its_share_of_the_cores_and_a_note(cores, load):
    chosen, note = threads_mod.default_threads(cores, load)
    share = cores / load  # of a core, per runnable thread
    assert chosen == max(1, math.floor(cores * share))
    assert chosen <= cores
    assert note is not None and f"{load:.2f}" in note and f"{cores} usable cores" in note
    assert f"uses {chosen} thread" in note and "--threads" in note


def test_requested_threads_and_omp_num_threads_win(monkeypatch):
    monkeypatch.setattr(threads_mod, "load_average", lambda: 99.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_mod.choose_threads(5) == (5, None)
    assert threads_mod.choose_threads(None) == (3, None)
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads_mod, "usable_cores", lambda: 6)
    assert threads_mod.choose_threads(None) == (1, threads_mod.default_threads(6, 99.0)[1])
    monkeypatch.setattr(threads_mod, "load_average", lambda: 0.5)
    assert threads_mod.choose_threads(None) == (6, None)


def test_usable_cores_is_the_affinity_mask():
    assert threads_mod.usable_cores() == len(os.sched_getaffinity(0))


def test_threads_is_not_part_of_the_cache_key(tiny_models, data):
    """The thread count changes only the order of float sums inside a product, never which vectors
    are measured: one computation, one key, whatever --threads says."""
    from isotui.experiments.layer_pass import prepare

    model = str(tiny_models["bert"])
    keys = {prepare(make_spec(model, f"text:{data}", threads=t)).key for t in (None, 1, 3, "7")}
    assert len(keys) == 1


@pytest.mark.slow
def test_the_chosen_threads_reach_torch(tmp_path, tiny_models, data):
    """In a subprocess, so this test process keeps its own threads: the JSON's meta records
    torch.get_num_threads() as the run left it, and the table's notes say nothing about load."""
    model = str(tiny_models["bert"])
    for wanted in ("1", "3"):
        out = tmp_path / f"t{wanted}.json"
        proc = isotui(
            "run",
            "-m",
            model,
            "--data",
            f"text:{data}",
            "--threads",
            wanted,
            "--no-cache",
            "-q",
            "--json",
            str(out),
        )
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(out.read_text(encoding="utf-8"))
        meta = doc["results"][0]["meta"] if "results" in doc else doc["meta"]
        assert meta["threads"] == int(wanted)
        assert not any("load average" in n for n in meta["notes"])


@pytest.mark.slow
def test_a_loaded_machine_is_said_in_the_notes(tmp_path, tiny_models, data):
    """The default under load (faked in the subprocess: a load average of 50 on this process's
    cores) reaches torch and the table's notes say what was chosen and why."""
    model = str(tiny_models["bert"])
    out = tmp_path / "t.json"
    argv = ["run", "-m", model, "--data", f"text:{data}", "--no-cache", "-q", "--json", str(out)]
    code = (
        "import sys; from isotui.extract import threads as t; t.load_average = lambda: 50.0; "
        f"from isotui.cli import main; sys.exit(main({argv!r}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text(encoding="utf-8"))
    meta = doc["results"][0]["meta"] if "results" in doc else doc["meta"]
    cores = len(os.sched_getaffinity(0))
    expected = max(1, math.floor(cores * cores / 50.0))
    assert meta["threads"] == expected
    said = [n for n in meta["notes"] if "load average 50.00" in n]
    assert len(said) == 1 and f"torch uses {expected} thread" in said[0]


@pytest.mark.slow
@pytest.mark.parametrize("value", ["0", "x", "-2"])
def test_bad_threads_is_one_sentence_and_exit_2(value):
    proc = isotui("run", "--threads", value)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "threads must be a positive integer" in lines[0], proc.stderr
