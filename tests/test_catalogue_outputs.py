"""The fault catalogue, round 3 (issue 30): the files a command writes. Nothing the user named
is damaged (a symlink stays a link, a FIFO a FIFO, a file of theirs beside a figure is not
replaced silently), two outputs never share a file, a flag is never ignored silently, and ^C
keeps what finished.

Each case runs the real ``isotui`` in a subprocess; special files are made under the test's folder.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import isotui
from isotui.store.cache import ResultCache

from .conftest import corpus

TINY = "random:bert:hidden_size=32,num_hidden_layers=1,num_attention_heads=4,intermediate_size=64"
SMALL = ("--max-samples", "20", "-q")
FIGURE = ("figure", "godey2024-fig17")  # drawn from a formula: no model to run


def cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "isotui", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=timeout,
    )


def one_sentence(proc: subprocess.CompletedProcess, part: str) -> str:
    err = proc.stderr
    assert "Traceback" not in err and "internal error" not in err, err
    assert proc.returncode == 2, (proc.returncode, err)
    assert len([line for line in err.splitlines() if "error:" in line]) == 1, err
    assert part in " ".join(err.split()), err
    return err


def cached_runs(tmp: Path) -> int:
    return len(ResultCache(tmp / "cache").entries())


# --- 1. isotui figure --out: a symlink, a FIFO, the user's files beside it ----------------------


@pytest.mark.slow
def test_figure_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    (tmp_path / "real.pdf").write_text("old")
    (tmp_path / "link.pdf").symlink_to("real.pdf")
    proc = cli(*FIGURE, "--out", "link.pdf", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "link.pdf").is_symlink() and os.readlink(tmp_path / "link.pdf") == "real.pdf"
    assert (tmp_path / "real.pdf").read_bytes().startswith(b"%PDF")


@pytest.mark.slow
def test_figure_into_a_fifo_is_written_through_and_the_fifo_stays(tmp_path):
    fifo = tmp_path / "pipe.pdf"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    proc = cli(*FIGURE, "--out", "pipe.pdf", cwd=tmp_path)
    reader.join(60)
    assert proc.returncode == 0, proc.stderr
    assert got and got[0].startswith(b"%PDF") and got[0].rstrip().endswith(b"%%EOF")
    assert fifo.is_fifo()


SIDECARS = [  # (files beside results.pdf before, extra flags, refused, what must survive)
    pytest.param({"results.csv": "mine"}, (), True, "results.csv", id="users-csv"),
    pytest.param({"results.json": '{"mine": 1}'}, (), True, "results.json", id="users-json"),
    pytest.param({"results.csv": "mine"}, ("--force",), False, None, id="users-csv-with-force"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("before", "extra", "refused", "kept"), SIDECARS)
def test_figure_never_replaces_the_users_files_beside_it_silently(tmp_path, before, extra, refused, kept):
    for name, text in before.items():
        (tmp_path / name).write_text(text)
    proc = cli(*FIGURE, "--out", "results.pdf", *extra, cwd=tmp_path)
    if refused:
        one_sentence(proc, f"and {kept} is a file of yours, not an earlier figure's")
        assert "give --force to replace it" in proc.stderr
        assert (tmp_path / kept).read_text() == before[kept] and not (tmp_path / "results.pdf").exists()
    else:
        assert proc.returncode == 0, proc.stderr
        assert next(csv.reader((tmp_path / "results.csv").open())) == ["d", "cos", "density"]


@pytest.mark.slow
def test_figure_redrawn_over_its_own_files_needs_no_force(tmp_path):
    assert cli(*FIGURE, "--out", "f.png", cwd=tmp_path).returncode == 0
    assert json.loads((tmp_path / "f.json").read_text())["file"] == "f.png"
    again = cli(*FIGURE, "--out", "f.png", "--dims", "8,16", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "f.json").read_text())["command"].endswith("--dims 8,16")


# --- 2. two outputs, one file; a flag ignored silently -------------------------------------------

ONE_FILE = [
    pytest.param(
        ("run", "-m", TINY, *SMALL, "--csv", "o.x", "--json", "o.x"),
        "--csv and --json both name o.x",
        id="run",
    ),
    pytest.param(
        ("run", "-m", TINY, *SMALL, "--csv", "o.x", "--json", "./o.x"),
        "--csv and --json both name ./o.x",
        id="same-file-spelt-twice",
    ),
    pytest.param(
        ("experiment", "attention", "-m", TINY, *SMALL, "--csv", "a", "--json", "a"),
        "--csv and --json both name a",
        id="experiment",
    ),
    pytest.param(
        ("run", "-m", TINY, *SMALL, "--csv", "o.csv", "--wide-csv", "o.csv"),
        "--csv and --wide-csv both name o.csv",
        id="wide-csv",
    ),
    pytest.param(
        ("run", "-m", TINY, "--dry-run", "--csv", "o.csv"),
        "--dry-run prints the memory plan and writes no --csv",
        id="dry-run-csv",
    ),
    pytest.param(
        ("experiment", "attention", "-m", TINY, "--dry-run", "--csv", "o.csv"),
        "writes no --csv (--csv o.csv)",
        id="dry-run-experiment",
    ),
    pytest.param(
        ("run", "-m", TINY, *SMALL, "--max-memory", "cpu=1GiB,cpu=2GiB"),
        "max-memory names cpu twice",
        id="max-memory-twice",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "said"), ONE_FILE)
def test_outputs_sharing_a_file_or_ignored_are_refused_before_the_run(tmp_path, args, said):
    one_sentence(cli(*args, cwd=tmp_path), said)
    assert cached_runs(tmp_path) == 0 and not list(tmp_path.glob("o*")) and not (tmp_path / "a").exists()


@pytest.mark.slow
def test_the_same_stream_twice_is_fine(tmp_path):
    proc = cli("run", "-m", TINY, *SMALL, "--csv", "/dev/null", "--json", "/dev/null", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


# --- 3. a FIFO with no reader: said, then waited for ---------------------------------------------


@pytest.mark.slow
def test_a_fifo_without_a_reader_says_it_waits(tmp_path):
    fifo = tmp_path / "p.csv"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-m", "isotui", "run", "-m", TINY, *SMALL, "--csv", "p.csv"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    assert proc.stderr is not None
    rows: list[dict[str, str]] = []
    reader = threading.Thread(target=lambda: rows.extend(csv.DictReader(fifo.open())), daemon=True)
    late = threading.Timer(300, reader.start)  # a bound: a silent wait still ends, and fails below
    late.start()
    line = proc.stderr.readline()  # blocks until isotui says something: the wait, said first
    late.cancel()
    if reader.ident is None:  # not started by the bound
        reader.start()
    reader.join(600)
    assert "isotui: waiting for a reader of p.csv, a FIFO" in line, line
    _, rest = proc.communicate(timeout=600)
    assert proc.returncode == 0, rest
    assert {r["model"] for r in rows} == {TINY} and "wrote p.csv" in rest


# --- 4. ^C during the 2nd of two models keeps the 1st's CSV and JSON -----------------------------


OUTPUTS = ("--csv", "o.csv", "--json", "o.json")


@pytest.mark.slow
def test_ctrl_c_during_the_second_model_writes_the_first(tmp_path):
    (tmp_path / "d.txt").write_text("\n".join(corpus(3000)) + "\n", encoding="utf-8")
    slow = "random:bert:num_hidden_layers=4"
    proc = subprocess.Popen(
        [sys.executable, "-m", "isotui", "run", "-m", TINY, "-m", slow, "--data", "text:d.txt", *OUTPUTS],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    while cached_runs(tmp_path) < 1:  # the first model is done (and cached)
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.2)
    time.sleep(2)  # into the second: 3,000 samples of a 4-layer BERT take far longer
    assert proc.poll() is None, "ended before it was interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err
    assert "writing the 1 result(s) that finished" in err and "isotui: cancelled" in err
    with (tmp_path / "o.csv").open() as f:
        assert {row["model"] for row in csv.DictReader(f)} == {TINY}
    assert [r["model"] for r in json.loads((tmp_path / "o.json").read_text())["results"]] == [TINY]


# --- 5. the Python API: every error an IsotuiError ----------------------------------------------

API = [
    pytest.param(lambda: isotui.run(123), "model must be a model name", id="run(123)"),
    pytest.param(lambda: isotui.run([TINY, 7]), "or a list of names", id="a list with a number"),
    pytest.param(lambda: isotui.run(TINY, nope=1), "isotui.run has no option 'nope'", id="unknown keyword"),
    pytest.param(
        lambda: isotui.experiment(["attention"]), "no experiment ['attention']", id="experiment(list)"
    ),
    pytest.param(lambda: isotui.experiment("attention", model=3), "model must be a model name", id="model=3"),
]


@pytest.mark.parametrize(("call", "said"), API)
def test_api_misuse_is_an_isotui_error_not_a_type_error(call, said):
    with pytest.raises(isotui.IsotuiError) as caught:
        call()
    assert said in str(caught.value)


def test_api_run_takes_every_flag_of_isotui_run(tmp_path):
    r = isotui.run(TINY, max_samples=5, threads=1, stream=True)
    assert r.result.meta["n_samples"] == 5
