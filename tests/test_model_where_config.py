"""``isotui run NAME`` with a model's name where a config is expected (issue 38 item 6): the
sentence says it is a model and how to run it (``-m NAME``); a preset or config still wins."""

from __future__ import annotations

import pytest

from isotui.cli import main


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("minilm", "'minilm' is a bundled model"),
        ("random:gpt2:n_layer=1", "names a model"),
        ("sentence-transformers/all-MiniLM-L6-v2", "looks like a Hugging Face model id"),
    ],
)
def test_a_model_name_where_a_config_is_expected_suggests_dash_m(name, says, capsys):
    assert main(["run", name]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"no config file or preset named {name!r}" in err
    assert says in err and f"isotui run -m {name}" in err


def test_a_model_folder_where_a_config_is_expected_suggests_dash_m(tmp_path, capsys):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}", encoding="utf-8")
    assert main(["run", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "is a model's folder, not a config file" in err and f"isotui run -m {folder}" in err


def test_an_unknown_name_is_not_called_a_model(capsys):
    assert main(["run", "nosuchpreset"]) == 2
    err = capsys.readouterr().err
    assert "no config file or preset named 'nosuchpreset'" in err and "-m" not in err
