"""The fault catalogue (issue 35): what is refused, and what is not. Two outputs naming one file
(``--save-sample`` too) are refused before any work; shards of two different runs are never
refused as each other's (the options that differ are named in the command line's terms); a shard
that cannot merge ends non-zero and never promises a merge; a figure checks all three of its files
before it writes one, and never replaces a sidecar that was changed after isotui wrote it.

Each case runs the real ``isotui`` in a subprocess (the helpers of ``test_catalogue_outputs``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from isotui.experiments.shards import SCHEMA, option_differences, partial_runs

from .test_catalogue_files import rewrite_entry
from .test_catalogue_outputs import FIGURE, SMALL, TINY, cached_runs, cli, one_sentence

# --- 1. --save-sample and another output naming one file ----------------------------------------


def _link_to_f(tmp: Path) -> None:
    (tmp / "L").symlink_to("F")


def _users_f(tmp: Path) -> None:
    (tmp / "F").write_text("mine\n")


CLOBBER = [  # (what is there first, the outputs, what is said)
    pytest.param(None, ("--save-sample", "F", "--csv", "F"), "--csv and --save-sample both name F", id="csv"),
    pytest.param(
        None, ("--json", "F", "--save-sample", "./F"), "--json and --save-sample both name ./F", id="json"
    ),
    pytest.param(
        _link_to_f, ("--save-sample", "F", "--csv", "L"), "--csv and --save-sample both name F", id="link"
    ),
    pytest.param(
        _users_f,
        ("--wide-csv", "F", "--save-sample", "F"),
        "--wide-csv and --save-sample both name F",
        id="theirs",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("before", "outputs", "said"), CLOBBER)
def test_save_sample_and_another_output_naming_one_file_are_refused_before_the_run(
    tmp_path, before, outputs, said
):
    if before is not None:
        before(tmp_path)
    proc = cli("run", "-m", TINY, *SMALL, *outputs, cwd=tmp_path)
    one_sentence(proc, said)
    assert "one would replace the other" in proc.stderr
    assert cached_runs(tmp_path) == 0  # nothing ran
    f = tmp_path / "F"
    assert (f.read_text() == "mine\n") if before is _users_f else not f.exists()
    assert (tmp_path / "L").is_symlink() or before is not _link_to_f


# --- 2. shards: two runs are two runs; a shard that cannot merge says so, exit 2 ------------------


def _shard(tmp: Path, shard: str, *extra: str):
    return cli("run", "-m", TINY, *SMALL, "--shard", shard, *extra, cwd=tmp)


def test_options_that_differ_are_said_as_flags():
    here = {"schema": 5, "max_length": 32, "seed": 0, "dtype": "float32"}
    theirs = {"max_length": 64, "seed": 0, "dtype": "float32", "modules": ["encoder.*", "pooler"]}
    assert option_differences(here, theirs, "in the cached shards") == [
        "--max-length 32 here, 64 in the cached shards",
        "--modules not given here, encoder.*,pooler in the cached shards",
    ]  # the schema is compared only when both sides recorded it
    assert option_differences({"schema": 5, "metrics": {"m": 1}}, {"schema": 4}, "there") == [
        "the layer metrics' schema 5 here, 4 there",
        "the plug-in metrics m v1 here, not given there",
    ]


@pytest.mark.slow
def test_two_runs_whose_shards_start_in_either_order_are_two_runs(tmp_path):
    """Run A (--max-length 64) starts with shard 0/2, run B (--max-length 32) with shard 1/2: B's
    shard was refused as the one A lacks. Each is its own run: said, not refused; both merge."""
    a, b = ("--max-length", "64"), ("--max-length", "32")
    assert _shard(tmp_path, "0/2", *a).returncode == 0
    first_b = _shard(tmp_path, "1/2", *b)
    assert first_b.returncode == 0, first_b.stderr
    said = " ".join(first_b.stderr.split())
    assert "error:" not in said and "(--max-length 32 here, 64 in the cached shards)" in said
    assert "it is a shard of its own run" in said and "another schema" not in said
    assert len(partial_runs(tmp_path / "cache")) == 2  # under two keys
    for shard, options in (("1/2", a), ("0/2", b)):
        proc = _shard(tmp_path, shard, *options)
        assert proc.returncode == 0, proc.stderr
        assert "merged from 2 shards" in proc.stdout
    assert cached_runs(tmp_path) == 2 and partial_runs(tmp_path / "cache") == []


@pytest.mark.slow
def test_a_shard_beside_a_newer_isotuis_shard_is_refused_and_keeps_it(tmp_path):
    """Shard 0/2 cached by a newer isotui (its shard schema): shard 1/2 was run, then said 'the last
    shard to finish merges them' with exit 0, and no merge could ever happen."""
    assert _shard(tmp_path, "0/2").returncode == 0
    (state,) = (tmp_path / "cache" / "shards").glob("*-0-of-2.safetensors")
    rewrite_entry(state, lambda header, _arrays: header.__setitem__("schema", SCHEMA + 1))
    kept = state.read_bytes()
    for shard in ("1/2", "0/2"):  # the other shard, and the same one again
        proc = _shard(tmp_path, shard)
        one_sentence(
            proc, f"shard 0/2 of this run is in the cache from a newer isotui (shard schema {SCHEMA + 1}"
        )
        assert "merges them" not in proc.stderr and "isotui cache rm" in proc.stderr
        assert state.read_bytes() == kept  # another version's work is not replaced
        assert sorted(p.name for p in state.parent.glob("*.safetensors")) == [state.name]


@pytest.mark.slow
def test_all_shards_cached_but_unmergeable_is_exit_2_not_a_promise(tmp_path):
    """Shard 0/2's bytes damaged (checksum): shard 1/2 found all K cached and no merge, and still
    said the last shard would merge them, exit 0. Now: exit 2, saying which shard to run again;
    running it merges."""
    assert _shard(tmp_path, "0/2").returncode == 0
    (state,) = (tmp_path / "cache" / "shards").glob("*-0-of-2.safetensors")
    data = bytearray(state.read_bytes())
    data[-1] ^= 1  # an array's last byte
    state.write_bytes(bytes(data))
    proc = _shard(tmp_path, "1/2")
    one_sentence(proc, "is damaged (checksum mismatch); run shard 0/2 again")
    assert "merges them" not in proc.stderr
    again = _shard(tmp_path, "0/2")
    assert again.returncode == 0, again.stderr
    assert "merged from 2 shards" in again.stdout and cached_runs(tmp_path) == 1


# --- 3. a figure's three files: all checked before one is written; sidecars changed since --------


def _draw(tmp: Path, *extra: str):
    return cli(*FIGURE, "--out", "f.pdf", *extra, cwd=tmp)


def _files(tmp: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(tmp.iterdir()) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["f.json", "f.csv"])
@pytest.mark.parametrize("extra", [(), ("--force",)], ids=["", "force"])
def test_a_sidecar_that_is_a_folder_is_refused_before_anything_is_written(tmp_path, folder, extra):
    assert _draw(tmp_path, "--dims", "8").returncode == 0  # an earlier figure: its files must stay
    (tmp_path / folder).unlink()
    (tmp_path / folder).mkdir()
    before = _files(tmp_path)
    proc = _draw(tmp_path, *extra)
    one_sentence(proc, f"and {folder} cannot be written (it is a directory, not a file): move it")
    assert _files(tmp_path) == before and (tmp_path / folder).is_dir()


@pytest.mark.slow
def test_a_sidecar_linked_to_the_figure_is_refused(tmp_path):
    (tmp_path / "f.csv").symlink_to("f.pdf")
    proc = _draw(tmp_path, "--force")
    one_sentence(proc, "--out and the CSV beside it both name f.csv")
    assert not (tmp_path / "f.pdf").exists() and (tmp_path / "f.csv").is_symlink()


def _append_line(path: Path) -> None:
    with path.open("a", newline="") as f:
        f.write("my note,,\r\n")


def _add_key(path: Path) -> None:
    payload = json.loads(path.read_text())
    path.write_text(json.dumps({**payload, "note": "drawn for the rebuttal"}, indent=2))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "change"), [("f.csv", _append_line), ("f.json", _add_key)])
def test_a_sidecar_changed_after_isotui_wrote_it_is_not_replaced_silently(tmp_path, name, change):
    """A line a researcher appended to an earlier figure's CSV was overwritten by the next draw.
    Now the JSON records the SHA-256 of both sidecars; one that differs is theirs: refused (all
    three files kept) unless --force."""
    assert _draw(tmp_path, "--dims", "8").returncode == 0
    change(tmp_path / name)
    before = _files(tmp_path)
    proc = _draw(tmp_path)
    one_sentence(proc, f"and {name} was changed after an earlier figure wrote it")
    assert "give --force to replace it" in proc.stderr
    assert _files(tmp_path) == before
    forced = _draw(tmp_path, "--force")
    assert forced.returncode == 0, forced.stderr
    assert json.loads((tmp_path / "f.json").read_text())["command"].endswith("--out f.pdf --force")
    assert b"my note" not in (tmp_path / "f.csv").read_bytes()


@pytest.mark.slow
def test_sidecars_of_an_isotui_before_digests_are_still_an_earlier_figures(tmp_path):
    """A JSON written before the digests were recorded names the figure and its CSV: redrawn as
    before, without --force (what it held cannot be checked)."""
    assert _draw(tmp_path, "--dims", "8").returncode == 0
    path = tmp_path / "f.json"
    payload = json.loads(path.read_text())
    del payload["sha256"]
    path.write_text(json.dumps(payload, indent=2))
    proc = _draw(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(path.read_text())["sha256"]["csv"]
    assert os.path.getsize(tmp_path / "f.pdf") > 0
