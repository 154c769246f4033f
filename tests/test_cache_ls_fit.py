"""``isotui cache ls`` at 80 and 100 columns (issue 38 item 3): nothing cut off, no setting
broken mid-word, and a ``--modules`` run (or a plug-in's) never looks like a plain one;
``--wide`` shows every column."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

import pytest
from rich.console import Console

from isotui import cache_listing, cli
from isotui.cli import main

MODEL = "random:bert:hidden_size=32,num_hidden_layers=1,num_attention_heads=4,intermediate_size=64"
GLOB = "encoder.layer.*.output.dense"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cache"))
    base = ["run", "-m", MODEL, "--max-samples", "20", "-q", "--cache-dir", root]
    assert main(base) == 0
    assert main([*base, "--modules", GLOB]) == 0
    return root


def _listing(monkeypatch, capsys, root: str, width: int, *flags: str) -> str:
    buffer = io.StringIO()
    monkeypatch.setattr(cli, "stdout_console", lambda: Console(file=buffer, width=width, color_system=None))
    capsys.readouterr()
    assert main(["cache", "ls", "--cache-dir", root, *flags]) == 0
    return buffer.getvalue()


def _rows(text: str) -> list[list[str]]:
    """Each entry's cells, its lines joined (a folded cell's pieces in order)."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip("│").split("│")]
        if re.fullmatch(r"[0-9a-f]{12}", cells[0]):
            rows.append(cells)
        else:
            rows[-1] = [a + ("\n" + b if b else "") for a, b in zip(rows[-1], cells, strict=True)]
    return rows


@pytest.mark.parametrize("width", [80, 100])
def test_cache_ls_fits_and_tells_a_modules_run_from_a_plain_one(cache, monkeypatch, capsys, width):
    out = _listing(monkeypatch, capsys, cache, width)
    assert max(map(len, out.splitlines())) <= width, out
    header = next(line for line in out.splitlines() if line.startswith("┃"))
    headers = [h.strip() for h in header.strip("┃").split("┃")]
    assert headers[:4] == ["key", "model", "data", "sites"], headers
    rows = _rows(out)
    assert len(rows) == 2
    sites = {r[headers.index("sites")].replace("\n", "") for r in rows}
    assert sites == {"blocks", GLOB}
    assert all(r[1].replace("\n", "") == MODEL for r in rows)  # the name whole, in pieces in order
    # what both runs share is said once, above the table (wrapped at the width between words)
    shared = " ".join(out[out.index("every run:") : out.index("cached runs in")].split())
    for said in ("samples 20", "max len 512", "special exclude", "exact no", "seed 0", "reservoir 4,096"):
        assert said in shared, shared
    assert "settings" not in headers  # every other setting is shared
    assert "cache ls --wide" in out  # created and size left out, and how to see them


def test_cache_ls_wide_shows_every_column(cache, monkeypatch, capsys):
    out = _listing(monkeypatch, capsys, cache, 100, "--wide")
    header = next(line for line in out.splitlines() if line.startswith("┃"))
    headers = [h.strip() for h in header.strip("┃").split("┃")]
    want = [
        "samples",
        "sites",
        "max len",
        "dtype",
        "special",
        "seed",
        "reservoir",
        "exact",
        "created",
        "size",
    ]
    assert all(h in headers for h in want), headers
    rows = _rows(out)
    assert {r[headers.index("exact")] for r in rows} == {"no"}
    assert "every run" not in out and "--wide)" not in out


def _entry(key: str, model: str) -> SimpleNamespace:
    return SimpleNamespace(
        key=key, model=model, data="builtin", n_samples=20, created="2026-01-02T03:04:05", size_bytes=9000
    )


@pytest.mark.parametrize("width", [80, 100])
def test_a_plugin_run_has_its_plugins_in_view(width):
    plain = {
        "modules": "blocks",
        "metrics": "",
        "max_length": "512",
        "dtype": "float32",
        "special_tokens": "exclude",
        "seed": "0",
        "reservoir": "4,096",
        "exact": "no",
    }
    params = [plain, {**plain, "metrics": "lid 1.0"}]
    entries = [_entry("a" * 64, MODEL), _entry("b" * 64, MODEL)]
    above, table, _below, _ = cache_listing.cache_table(entries, params, width, False, "cached runs")
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None).print(table)
    out = buffer.getvalue()
    assert max(map(len, out.splitlines())) <= width
    assert "lid 1.0" in out and "lid" not in " ".join(above)  # the one difference: in the table
    assert "sites" not in out  # no run named modules: no sites column
