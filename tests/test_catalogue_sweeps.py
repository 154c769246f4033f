"""The fault catalogue, sweeps and shards (issue 30): a sweep stops on ^C, refuses what would
hang before any task starts, and a damaged shard never blocks its run.

Read it as a table, as ``test_catalogue_inputs.py``: each ``Case`` is one input with the sentence
the user must see (a distinctive part of it), the exit code and what is on disk afterwards. Every
command runs the real CLI in a subprocess (``python -m isotui ...``); the ^C case sends a real
SIGINT to a real sweep.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import corpus
from .test_catalogue_inputs import TINY, Case, isotui, one_sentence, run_case
from .test_sweep import _task_pids

pytestmark = pytest.mark.slow  # every case runs `isotui sweep` and its task processes

MAX_LENGTH = 16


def _sweep_config(tmp: Path, models: str, sweep: str, samples: int = 10) -> None:
    (tmp / "sweep.toml").write_text(
        f'models = {models}\ndata = "builtin"\nmax_samples = {samples}\nmax_length = {MAX_LENGTH}\n'
        f'cache_dir = "cache"\ncsv = "out.csv"\n\n[sweep]\n{sweep}\n',
        encoding="utf-8",
    )


def _no_task_ran(tmp: Path) -> bool:
    """Nothing cached, no shard, no table: no task started."""
    cache = tmp / "cache"
    return not any(cache.glob("*/*.safetensors")) and not (tmp / "out.csv").exists()


def _sweep_case(models: str, sweep: str, sentence: str, absent: tuple[str, ...] = ()) -> Case:
    case = Case(
        ("sweep", "{tmp}/sweep.toml", "-q"),
        sentence,
        2,
        "no task ran: nothing cached, no out.csv",
        _no_task_ran,
        setup=lambda t: _sweep_config(t, models, sweep),
    )
    case.absent = absent  # type: ignore[attr-defined]
    return case


# --- 4. sweeps that hung instead of saying one sentence ---------------------------------------------

SWEEPS = [
    pytest.param(
        _sweep_case(f'["{TINY}"]', "shards = 1000000", "[sweep] shards = 1000000 is more than 10,000"),
        id="a-million-shards",
    ),
    pytest.param(  # the check each task made, now made once before any starts
        _sweep_case(
            f'["{TINY}"]', "shards = 11", "[sweep] shards = 11: the data has 10 samples, fewer than 11"
        ),
        id="more-shards-than-samples",
    ),
    pytest.param(
        _sweep_case(
            f'["{TINY}", "{TINY},intermediate_size=32"]',
            "shards = 6000",
            "2 runs x [sweep] shards = 6000 are 12,000 tasks, more than a sweep runs (10,000)",
        ),
        id="too-many-tasks",
    ),
    pytest.param(  # was: "all 2 tasks are cached", "run the sweep again to retry them"
        _sweep_case(
            '["./nope"]',
            "shards = 2",
            "2 of 2 tasks failed: nope",
            absent=("cached", "run the sweep again"),
        ),
        id="every-task-fails-before-starting",
    ),
]


@pytest.mark.parametrize("case", SWEEPS)
def test_a_sweep_that_cannot_run_says_so_before_any_task(case, tmp_path):
    err = " ".join(one_sentence(run_case(case, tmp_path).stderr).split())
    assert not any(word in err for word in case.absent), err


def test_a_sweeps_outputs_naming_one_file_are_refused_before_any_task(tmp_path):
    """Was: every task ran, then the final table refused --json naming the config's csv file."""
    _sweep_config(tmp_path, f'["{TINY}"]', "shards = 2")
    proc = isotui("sweep", str(tmp_path / "sweep.toml"), "--json", "./out.csv", "-q", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    err = " ".join(one_sentence(proc.stderr).split())
    assert "--csv and --json both name ./out.csv: one would replace the other" in err, err
    assert _no_task_ran(tmp_path)


def test_a_ray_address_that_does_not_answer_is_one_sentence_at_once(tmp_path):
    """Was: Ray's connection warnings for minutes, never a sentence. Port 1 on this machine's own
    loopback: refused at once (the subprocess's timeout bounds a regression)."""
    pytest.importorskip("ray")
    _sweep_config(tmp_path, f'["{TINY}"]', 'executor = "ray"\naddress = "127.0.0.1:1"')
    proc = isotui("sweep", str(tmp_path / "sweep.toml"), "-q", cwd=tmp_path, timeout=600)
    assert proc.returncode == 2, proc.stderr
    err = " ".join(one_sentence(proc.stderr).split())
    assert 'address = "127.0.0.1:1": cannot connect to a Ray cluster there' in err, err
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert _no_task_ran(tmp_path)


# --- 5. shards: a limit on K, more shards than samples, a damaged shard ------------------------------

SHARDS = [
    pytest.param(
        Case(
            ("run", "-m", TINY, "--max-samples", "3", "--shard", "0/99999999999999999999", "-q"),
            "shard 0/99999999999999999999: K must be at most 10,000",
            2,
            "nothing cached",
            lambda t: not (t / "cache").exists(),
        ),
        id="huge-K",
    ),
    pytest.param(  # docs/guide/sweeps.md: more shards than samples is refused (that split could never merge)
        Case(
            ("run", "-m", TINY, "--max-samples", "3", "--shard", "1/10", "-q"),
            "shard 1/10: the data has 3 samples, fewer than 10 shards",
            2,
            "no shard cached",
            lambda t: not any((t / "cache").glob("*/*.safetensors")),
        ),
        id="more-shards-than-samples",
    ),
]


@pytest.mark.parametrize("case", SHARDS)
def test_a_shard_that_cannot_run_is_one_sentence(case, tmp_path):
    one_sentence(run_case(case, tmp_path).stderr)


def _damage_an_array(path: Path) -> None:
    """Cut one array of a cached shard to half its length, with a valid checksum again."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from isotui.store.cache import _digest

    with safe_open(str(path), framework="numpy") as f:
        header = json.loads(f.metadata()["isotui"])
    arrays = load_file(str(path))
    arrays["model.1.sum_u"] = arrays["model.1.sum_u"][:16].copy()
    header["digest"] = _digest(arrays, header["result"])
    save_file(arrays, str(path), metadata={"isotui": json.dumps(header)})


def test_a_damaged_shard_is_said_dropped_and_run_again(tmp_path):
    """Shard 0/2 cached, then one of its arrays cut short (the checksum valid): shard 1/2 says the
    entry is damaged and removes it (was: an internal error on every try, never recomputed); shard
    0/2 then runs again and merges, with the numbers of the plain run."""
    args = ("run", "-m", TINY, "--max-samples", "20", "-q", "--cache-dir", str(tmp_path / "c"))
    assert isotui(*args, "--shard", "0/2", cwd=tmp_path).returncode == 0
    (entry,) = (tmp_path / "c" / "shards").glob("*-0-of-2.safetensors")
    _damage_an_array(entry)
    proc = isotui(*args, "--shard", "1/2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    err = " ".join(one_sentence(proc.stderr).split())
    assert f"cache entry shards/{entry.name} is damaged (the layer state's sum_u has shape (16,)" in err
    assert "removed it: shard 0/2 of this run runs again" in err
    assert not entry.exists()
    merged = isotui(*args, "--shard", "0/2", "--csv", str(tmp_path / "merged.csv"), cwd=tmp_path)
    assert merged.returncode == 0 and "merging the 2 shards" in merged.stderr, merged.stderr
    plain = ("run", "-m", TINY, "--max-samples", "20", "-q", "--cache-dir", str(tmp_path / "p"))
    assert isotui(*plain, "--csv", str(tmp_path / "plain.csv"), cwd=tmp_path).returncode == 0
    import csv

    def rows(name: str) -> list[dict[str, str]]:
        with (tmp_path / name).open(newline="") as f:
            return list(csv.DictReader(f))

    for a, b in zip(rows("plain.csv"), rows("merged.csv"), strict=True):
        assert a["n_vectors"] == b["n_vectors"]
        assert float(b["avg_cos"]) == pytest.approx(float(a["avg_cos"]), rel=1e-6)


def test_a_shard_whose_own_cached_entry_is_damaged_runs_again_and_merges(tmp_path):
    """Both shards cached (each by its own task, into caches that are then put together), shard 0's
    own entry damaged: running shard 0/2 again finds it damaged at the merge, measures it again
    and merges, instead of failing on every try."""
    common = ("run", "-m", TINY, "--max-samples", "20", "-q")
    for i in (0, 1):
        proc = isotui(*common, "--cache-dir", str(tmp_path / f"c{i}"), "--shard", f"{i}/2", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    (tmp_path / "c" / "shards").mkdir(parents=True)
    for i in (0, 1):
        (entry,) = (tmp_path / f"c{i}" / "shards").glob(f"*-{i}-of-2.safetensors")
        shutil.copy(entry, tmp_path / "c" / "shards" / entry.name)
    (own,) = (tmp_path / "c" / "shards").glob("*-0-of-2.safetensors")
    _damage_an_array(own)
    proc = isotui(*common, "--cache-dir", str(tmp_path / "c"), "--shard", "0/2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    err = " ".join(one_sentence(proc.stderr).split())
    assert f"cache entry shards/{own.name} is damaged" in err and "merging the 2 shards" in err, err
    from isotui.experiments.shards import partial_runs
    from isotui.store.cache import ResultCache

    assert partial_runs(tmp_path / "c") == [] and len(ResultCache(tmp_path / "c").entries()) == 1


# --- 1. ^C stops a local sweep: nothing more starts, the running task ends, exit 130 -------------------


@pytest.mark.parametrize("group", [True, False], ids=["terminal-ctrl-c", "sigint-to-the-sweep"])
def test_ctrl_c_stops_a_local_sweep_at_once_and_says_what_ran(tiny_models, tmp_path, group):
    """^C while the first of three tasks runs (workers = 1): the running task's process ends and is
    not retried, the two queued ones never start, and the sweep exits 130 saying which is which.
    ``terminal-ctrl-c``: the signal goes to the whole process group, as a terminal sends it (the
    task gets it too); ``sigint-to-the-sweep``: only the sweep gets it, and ends its task itself.
    Was: the task retried, every queued task run, exit 130 only at the end (42-135 s)."""
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(corpus(9)) + "\n", encoding="utf-8")
    config = tmp_path / "sweep.toml"
    config.write_text(
        f'model = "{tiny_models["bert"]}"\ndata = "text:{data}"\nmax_length = {MAX_LENGTH}\n'
        'cache_dir = "cache"\ncsv = "out.csv"\n\n[sweep]\nshards = 3\nworkers = 1\nretries = 2\n',
        encoding="utf-8",
    )
    sweep = subprocess.Popen(
        [sys.executable, "-m", "isotui", "sweep", str(config), "-q"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        seen: set[int] = set()
        deadline = time.monotonic() + 300
        while not seen:  # the first task's process (its command line names the config)
            assert sweep.poll() is None and time.monotonic() < deadline, "no task started"
            seen.update(p for p in _task_pids(str(config)) if p != sweep.pid)
            time.sleep(0.05)
        time.sleep(0.5)
        if group:
            os.killpg(sweep.pid, signal.SIGINT)
        else:
            os.kill(sweep.pid, signal.SIGINT)
        while sweep.poll() is None:  # every task process seen until the sweep ends
            seen.update(p for p in _task_pids(str(config)) if p != sweep.pid)
            assert time.monotonic() < deadline, "the sweep did not end after ^C"
            time.sleep(0.05)
        err = sweep.stderr.read() if sweep.stderr else ""
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
            sweep.wait()
    assert sweep.returncode == 130, err
    assert len(seen) == 1, f"task processes started after ^C: {len(seen) - 1}\n{err}"
    assert _task_pids(str(config)) == []  # and the one that ran is gone
    said = " ".join(err.split())
    assert "retrying" not in said and "Traceback" not in said and "internal error" not in said, err
    assert "sweep stopped by ^C: 0 of 3 tasks done" in said, err
    assert "1 stopped while running (bert shard 0/3)" in said, err
    assert "2 not started (bert shard 1/3, bert shard 2/3)" in said, err
    assert not (tmp_path / "out.csv").exists()  # no table of a sweep that did not finish
    from isotui.experiments.shards import partial_runs

    assert partial_runs(tmp_path / "cache") == []  # nothing of the stopped tasks kept
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
