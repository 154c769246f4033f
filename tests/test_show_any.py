"""``isotui show KEY`` reopens a cached result of any registered experiment, not only a layer
run: the tables the experiment printed, and the same --csv and --json files."""

from __future__ import annotations

import pytest

from .conftest import corpus


@pytest.mark.parametrize("name", ["final-norm", "attention"])
def test_show_gives_an_experiments_tables_csv_and_json(name, tmp_path, tiny_models, capsys, monkeypatch):
    from isotui.cli import main

    monkeypatch.setenv("COLUMNS", "160")
    data = tmp_path / "samples.txt"
    data.write_text("\n".join(corpus(6)) + "\n", encoding="utf-8")
    root = tmp_path / "c"
    model = str(tiny_models["bert"])
    command = ["experiment", name, "-m", model, "--data", f"text:{data}", "--cache-dir", str(root)]
    assert main(command) == 0
    capsys.readouterr()
    assert main([*command, "--csv", str(tmp_path / "a.csv"), "--json", str(tmp_path / "a.json")]) == 0
    printed = capsys.readouterr().out  # its second run: from the cache
    assert "(cache)" in printed
    (entry,) = (root / name).glob("*.safetensors")
    again = ["--csv", str(tmp_path / "b.csv"), "--json", str(tmp_path / "b.json")]
    assert main(["show", entry.stem[:8], "--cache-dir", str(root), *again]) == 0
    shown = capsys.readouterr().out
    assert shown.strip() and shown == printed
    for suffix in ("csv", "json"):
        assert (tmp_path / f"b.{suffix}").read_text() == (tmp_path / f"a.{suffix}").read_text(), suffix


def test_show_of_a_key_in_no_folder_is_still_one_sentence(tmp_path, capsys):
    from isotui.cli import main

    (tmp_path / "attention").mkdir(parents=True)
    assert main(["show", "abcdef12", "--cache-dir", str(tmp_path)]) == 2
    assert "matches no cached run" in capsys.readouterr().err
