"""The Python API shows progress where a person is watching (issue 29 item 8): a terminal gets the
CLI's bar on stderr, a notebook tqdm's bar, files and pipes nothing; ``progress=False`` silences."""

from __future__ import annotations

import builtins
import io
import sys

import pytest

import isotui
import isotui.cli_experiments as cli_experiments

from .conftest import corpus


class Stream(io.StringIO):
    """A stand-in for sys.stderr: a terminal or a file."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class ZMQInteractiveShell:
    """What ``get_ipython()`` returns in a Jupyter kernel (rich and tqdm read its class name)."""

    def __init__(self) -> None:
        self.config = {"IPKernelApp": {}}


@pytest.fixture
def job(tiny_models, tmp_path, monkeypatch):
    """Run a tiny model through the API with stderr replaced; returns (stderr text, the quiet
    flags the CLI's bar was asked with)."""
    data = tmp_path / "samples.txt"
    data.write_text("\n".join(corpus(6)) + "\n", encoding="utf-8")
    asked: list[bool] = []
    real = cli_experiments.progress_printer

    def spy(err, name, *, quiet, verbose=False):
        asked.append(quiet)
        return real(err, name, quiet=quiet, verbose=verbose)

    monkeypatch.setattr(cli_experiments, "progress_printer", spy)
    monkeypatch.setenv("COLUMNS", "200")

    def run(tty: bool, **kw) -> tuple[str, list[bool]]:
        stream = Stream(tty)
        monkeypatch.setattr(sys, "stderr", stream)
        asked.clear()
        isotui.run(str(tiny_models["gpt2"]), f"text:{data}", max_samples=6, batch_size=1, cache=False, **kw)
        monkeypatch.setattr(sys, "stderr", sys.__stderr__)
        return stream.getvalue(), list(asked)

    return run


def test_a_terminal_gets_the_clis_bar_by_default(job):
    drawn, asked = job(tty=True)
    assert asked == [False]
    # rich's bar with the CLI's status words; a quick job may be drawn only at its last refresh
    # (finalising), so any of the words the CLI's bar says in its phases will do
    assert "━" in drawn and any(w in drawn for w in ("tok/s", "samples", "computing metrics"))


def test_files_and_pipes_get_nothing_and_progress_false_silences(job):
    assert job(tty=False) == ("", [True])
    assert job(tty=True, progress=False) == ("", [True])
    _, asked = job(tty=False, progress=True)  # asked for: shown anyway
    assert asked == [False]


def test_a_notebook_gets_tqdms_bar(job, monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(builtins, "get_ipython", ZMQInteractiveShell, raising=False)
    assert isotui.api.watching() == "notebook"
    drawn, asked = job(tty=False)
    assert asked == []  # not the CLI's rich bar
    assert "6/6" in drawn and "sample" in drawn  # tqdm's counter and unit
    assert job(tty=False, progress=False) == ("", [True])
