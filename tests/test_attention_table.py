"""The attention table fits the terminal (columns hidden by priority) and each column has one
number format (issue 12)."""

from __future__ import annotations

import re

import pytest
from rich.cells import cell_len
from rich.console import Console

from isotui.experiments.attention import measure_attention
from isotui.render_attention import attention_table, column_formatter
from isotui.spec import make_spec

from .conftest import corpus


@pytest.fixture(scope="module")
def results(tiny_models, tmp_path_factory):
    path = tmp_path_factory.mktemp("attn") / "samples.txt"
    path.write_text("\n".join(corpus(6)) + "\n", encoding="utf-8")
    return {
        name: measure_attention(make_spec(str(tiny_models[name]), f"text:{path}"), None)
        for name in ("gpt_neox", "bert")  # rotary (the pre-rope column) and not
    }


def _render(table, width: int) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(table)
    return console.export_text()


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("width", [80, 100, 120, 140, 200])
def test_table_fits_the_terminal_without_cut_cells(results, width, per_head):
    for result in results.values():
        table = attention_table(result, width, per_head=per_head)
        text = _render(table, width)
        body = text[: text.index("Q̄, K̄: mean query")]
        assert "…" not in body  # no cell squeezed to `0.…`
        assert max(cell_len(line) for line in body.splitlines()) <= width
        if width == 80:
            assert "narrow terminal" in text and "cos(Q̄,K̄)" in body and "entropy" in body
        if width == 200:
            assert "narrow terminal" not in text


@pytest.mark.parametrize("per_head", [False, True])
def test_one_format_per_column(results, per_head):
    for result in results.values():
        table = attention_table(result, 200, per_head=per_head)
        for column in table.columns:
            cells = [str(c) for c in column._cells if str(c) != "-"]
            if column.header == "layer":
                continue
            assert not any(re.match(r"^-0\\.0*$", c) for part in cells for c in part.split(" ")), cells
            if column.header in ("head", "heads"):
                assert all(c.isdigit() for c in cells), cells
                continue
            styles = {"e" in c for c in cells}
            assert len(styles) <= 1, (column.header, cells)  # never 5.28e-05 next to 0.0001
            decimals = {len(x.split(".")[1].split("e")[0]) for c in cells for x in re.split(r"\\.\\.|±", c)}
            assert len(decimals) == 1, (column.header, cells)


def test_formatter_kinds():
    prob = column_formatter("prob", [5.28e-05, 0.0001, 0.2])
    assert [prob(v) for v in (5.28e-05, 0.0001, 0.2)] == ["5.28e-05", "1.00e-04", "2.00e-01"]
    plain = column_formatter("prob", [0.01, 0.2])
    assert [plain(v) for v in (0.01, 0.2)] == ["0.0100", "0.2000"]
    cos = column_formatter("cos", [-0.0001, 0.5])
    assert cos(-0.0001) == "0.000" and cos(-0.5) == "-0.500"
    count = column_formatter("count", [12])
    assert count(12) == "12"
    big = column_formatter("magnitude", [3.0, 25000.0])
    assert big(3.0) == "3.00e+00" and big(25000.0) == "2.50e+04"


def test_title_wraps_at_the_terminal_and_range_is_explained(results):
    """In a 100-column terminal the title wrapped at the table's own width (about 55 columns);
    the ``range`` column was never explained (issue 29)."""
    from isotui.render import Table

    for name, result in results.items():
        model, data = result.model, result.meta["data"]
        result.model, result.meta["data"] = f"tiny-{name}", "text:samples.txt"  # no temporary paths
        try:
            table = attention_table(result, 60)  # a table narrower than the terminal
        finally:
            result.model, result.meta["data"] = model, data
        assert isinstance(table, Table)
        title = " ".join(str(table.title).split())  # a Text: the words as printed
        text = _render(table, 100)
        first = text.splitlines()[0].strip()
        table_width = max(cell_len(line) for line in text.splitlines() if "│" in line or "┃" in line)
        assert len(title) > table_width  # the case in question: a title wider than the table
        assert " ".join(first.split()) == title, (first, title)  # on one line, as the terminal allows
        said = " ".join(text.split())
        assert "range: the lowest and highest cos(Q̄,K̄) among the layer's heads" in said
