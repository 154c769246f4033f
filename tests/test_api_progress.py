"""The Python API shows progress where a person is watching (issue 29 item 8): a terminal gets
tqdm's bar on stderr (the API imports no rich: issue 25), a notebook tqdm's widget, files and
pipes nothing; ``progress=False`` silences."""

from __future__ import annotations

import builtins
import io
import sys

import pytest

import isotui
import isotui.api

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
    """Run a tiny model through the API with stderr replaced; returns (stderr text, the names
    tqdm's bar was opened for)."""
    data = tmp_path / "samples.txt"
    data.write_text("\n".join(corpus(6)) + "\n", encoding="utf-8")
    asked: list[str] = []
    real = isotui.api.tqdm_bar

    def spy(name):
        asked.append(name)
        return real(name)

    monkeypatch.setattr(isotui.api, "tqdm_bar", spy)
    monkeypatch.setenv("COLUMNS", "200")

    def run(tty: bool, **kw) -> tuple[str, list[str]]:
        stream = Stream(tty)
        monkeypatch.setattr(sys, "stderr", stream)
        asked.clear()
        isotui.run(str(tiny_models["gpt2"]), f"text:{data}", max_samples=6, batch_size=1, cache=False, **kw)
        monkeypatch.setattr(sys, "stderr", sys.__stderr__)
        return stream.getvalue(), list(asked)

    return run


def test_a_terminal_gets_a_bar_by_default(job, tiny_models):
    pytest.importorskip("tqdm")
    drawn, asked = job(tty=True)
    assert asked == [str(tiny_models["gpt2"])]
    assert "sample" in drawn or "layer" in drawn  # tqdm's unit, samples or finalised layers


def test_files_and_pipes_get_nothing_and_progress_false_silences(job):
    pytest.importorskip("tqdm")
    assert job(tty=False) == ("", [])
    assert job(tty=True, progress=False) == ("", [])
    drawn, asked = job(tty=False, progress=True)  # asked for: shown anyway
    assert len(asked) == 1 and drawn


def test_a_notebook_gets_tqdms_bar(job, monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(builtins, "get_ipython", ZMQInteractiveShell, raising=False)
    assert isotui.api.watching() == "notebook"
    drawn, asked = job(tty=False)
    assert len(asked) == 1
    assert "6/6" in drawn and "sample" in drawn  # tqdm's counter and unit
    assert job(tty=False, progress=False) == ("", [])


def test_the_bar_says_what_the_job_does_from_its_first_line_to_its_last(job):
    """No counter before a sample runs (it drew ``0it [00:00, ?it/s]`` and ``0/6 ?sample/s``
    while loading), one set of words per line (tqdm's own rate and ETA beside isotui's, counted
    from the start, disagreed), and the layer bar never carries the samples' words (issue 38)."""
    pytest.importorskip("tqdm")
    drawn, _ = job(tty=True)
    lines = [line.strip() for line in drawn.replace("\n", "\r").split("\r") if line.strip()]
    assert lines, drawn
    assert not any(word in drawn for word in ("it/s", "0it", "?sample", "?layer", "| ,")), drawn
    first_count = next(i for i, line in enumerate(lines) if "%|" in line)
    assert first_count > 0 and all("%|" not in line for line in lines[:first_count])
    assert "resolving" in lines[0] or "loading" in lines[0]
    counted = lines[first_count:]
    samples = [line for line in counted if "samples" in line]
    layers = [line for line in counted if "computing metrics" in line]
    assert samples and layers and any("100%" in line and "6/6 samples" in line for line in samples)
    assert all("samples" not in line and "tok/s" not in line for line in layers)
    assert all(line.count("ETA") <= 1 for line in lines)
