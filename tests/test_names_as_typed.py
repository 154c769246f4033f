"""Names as typed through rich (issue 29 item 3): ``:llama:`` is no emoji and ``[bold]`` no markup
in table titles, columns, notes, the progress bar, ``cache ls`` and errors; and ``cache ls`` shows
every setting of a run's key (item 6)."""

from __future__ import annotations

import io
import re
import shutil

import pytest
from rich.console import Console

from isotui.cli import main
from isotui.cli.common import progress_printer

from .conftest import corpus

LLAMA = (
    "random:llama:num_hidden_layers=1,hidden_size=16,intermediate_size=32,"
    "num_attention_heads=2,num_key_value_heads=2"
)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(6)) + "\n", encoding="utf-8")
    return f"text:{path}"


@pytest.fixture
def odd_model(tiny_models, tmp_path):
    """A model folder whose name holds an emoji code and markup: ``x:llama:[bold]y``."""
    folder = tmp_path / "x:llama:[bold]y"
    shutil.copytree(tiny_models["bert"], folder)
    return str(folder)


def _unwrapped(text: str) -> str:
    """The printed text with table borders, padding and line ends taken out (a long title or
    cell wraps), so a name reads as one string."""
    return "".join(ch for line in text.splitlines() for ch in line if ch not in "│┃ ")


def _column(table: str, header: str) -> str:
    """The text of one column of a printed table, its cells' lines joined in order."""
    lines = table.splitlines()
    names = [c.strip() for c in next(line for line in lines if f" {header} " in line).split("┃")]
    cells = [line.split("│") for line in lines if line.startswith("│")]
    return "".join(c[names.index(header)].strip() for c in cells)


def test_titles_columns_and_cache_ls_print_names_as_typed(odd_model, data, tmp_path, capsys):
    root = str(tmp_path / "c")
    args = ["run", "-m", LLAMA, "-m", odd_model, "--data", data, "--max-samples", "4", "-q"]
    assert main([*args, "--cache-dir", root, "--wide"]) == 0
    out = _unwrapped(capsys.readouterr().out)
    assert "🦙" not in out
    assert out.count(LLAMA.replace(" ", "")) == 1  # the model's own table title
    assert out.count(odd_model.replace(" ", "")) == 1
    assert "llama:[bold]y" in out  # the wide table's column (the name's end)
    assert main(["cache", "ls", "--cache-dir", root]) == 0
    listed = capsys.readouterr().out
    assert "🦙" not in listed
    models = _column(listed, "model")  # a long name folds within its cell: its pieces, in order
    assert LLAMA in models and odd_model in models


def test_api_tables_print_names_as_typed_on_any_console(odd_model, data, tmp_path):
    """A notebook prints Result.tables with its own console (emoji on): still as typed."""
    import isotui

    result = isotui.run(odd_model, data, max_samples=4, cache_dir=str(tmp_path / "c"), progress=False)
    console = Console(file=io.StringIO(), width=300, record=True)  # rich's defaults: emoji and markup on
    result.show(console)
    text = console.export_text()
    assert f"{odd_model}  " in text and "🦙" not in text


def test_a_failed_models_sentence_keeps_its_name(tmp_path, capsys):
    name = "random:llama:nosuchsetting=1[bold]"
    assert main(["run", "-m", name, "-q", "--cache-dir", str(tmp_path / "c")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "🦙" not in err and name in err


def test_the_progress_bar_shows_the_name_as_typed():
    from isotui.extract.progress import Progress as Event
    from isotui.terminal import console

    buffer = io.StringIO()
    err = console(file=buffer, force_terminal=True, width=300, color_system=None)
    with progress_printer(err, "random:llama:[bold]x", quiet=False) as bar:
        bar(Event(1, 4, 10, 5.0, phase="running"))
        bar(Event(1, 4, 10, 5.0, message="backed off to 2 samples per batch [red]"))
        err.file.flush()
        drawn = buffer.getvalue()
    assert "random:llama:[bold]x" in drawn and "🦙" not in drawn
    assert "random:llama:[bold]x: backed off to 2 samples per batch [red]" in drawn


def test_cache_ls_tells_apart_runs_that_differ_only_in_their_options(tiny_models, data, tmp_path, capsys):
    root = str(tmp_path / "c")
    model = str(tiny_models["bert"])
    base = ["run", "-m", model, "--data", data, "--max-samples", "4", "-q", "--cache-dir", root]
    for extra in ([], ["--exact"], ["--reservoir", "7"], ["--tokenizer", "minilm"]):
        assert main([*base, *extra]) == 0
    capsys.readouterr()
    assert main(["cache", "ls", "--cache-dir", root]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "reservoir" in line)
    assert "exact" in header and "tokenizer" in header
    rows = [line for line in out.splitlines() if re.match(r"│ [0-9a-f]{12} │", line)]  # an entry's first line
    assert len(rows) == 4 and len(set(rows)) == 4
    cells = [[c.strip() for c in row.split("│")] for row in rows]
    columns = [c.strip() for c in header.split("┃")]
    shown = [columns.index(c) for c in ("exact", "reservoir", "tokenizer")]
    got = {tuple(r[i] for i in shown) for r in cells}
    assert got == {("no", "4,096", ""), ("yes", "4,096", ""), ("no", "7", ""), ("no", "4,096", "minilm")}
