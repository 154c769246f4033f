"""Progress that tells the truth: phases, finalisation per layer, an ETA that covers it, and a
time breakdown in the table, the JSON and --verbose (issue 12)."""

from __future__ import annotations

import json

import pytest

from isotui.cli import main
from isotui.cli.common import progress_status
from isotui.experiments import layerwise
from isotui.extract.progress import PHASES, Progress
from isotui.spec import make_spec
from isotui.store.cache import ResultCache

from .conftest import corpus


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(8)) + "\n", encoding="utf-8")
    return f"text:{path}"


def test_a_run_posts_every_phase_in_order(tiny_models, data, tmp_path):
    events: list[Progress] = []
    spec = make_spec(str(tiny_models["bert"]), data, batch_size=2)
    result = layerwise.measure(spec, ResultCache(tmp_path / "c"), on_progress=events.append)
    phases = list(dict.fromkeys(e.phase for e in events))
    assert phases == list(PHASES)
    loading = next(e for e in events if e.phase == "loading")
    weights = tiny_models["bert"] / "model.safetensors"
    assert loading.detail == f"{weights.stat().st_size / 1e6:.1f} MB"
    running = [e for e in events if e.phase == "running" and e.samples_done]
    assert [e.samples_done for e in running] == [2, 4, 6, 8]
    assert all(e.finalize_left_s and e.eta_s >= e.finalize_left_s for e in running)  # ETA covers it
    assert running[-1].eta_s == running[-1].finalize_left_s  # all forwarded: only finalisation left
    final = [e for e in events if e.phase == "finalising"]
    n_layers = len(result.rows)
    assert [e.layers_done for e in final] == list(range(n_layers))
    assert all(e.layers_total == n_layers and e.stage == "finalize" for e in final)
    assert all(e.eta_s is not None for e in final)
    for e in events:  # never `0/None samples`, never a blank status
        text = progress_status(e)
        assert text and "None" not in text


def test_time_breakdown_in_table_json_and_verbose(tiny_models, data, tmp_path, capsys):
    out_json = tmp_path / "r.json"
    args = ["run", "-m", str(tiny_models["gpt2"]), "--data", data, "--json", str(out_json), "-q", "-v"]
    assert main(args) == 0
    captured = capsys.readouterr()
    timings = json.loads(out_json.read_text())["results"][0]["meta"]["timings"]
    # the JSON holds what is stored with the result; the cache write is timed by this run only
    parts = ("load_s", "tokenise_s", "forward_s", "metrics_s", "finalise_s")
    assert set(timings) == set(parts) and all(timings[k] >= 0 for k in parts)
    total = sum(timings[k] for k in parts)
    assert f"({total:.1f} s)" in captured.out  # the title: the whole run, not a part of it
    assert "finalise" in captured.out and "per-batch metrics" in captured.out
    note = " ".join(captured.out.split())  # the table's note, wrapped to the terminal
    assert "cache write" in note and "; total " in note
    for phase in ("loading", "tokenising", "running", "finalising", "writing"):
        assert f": {phase}" in captured.err
    assert "cache write" in captured.err and "; total " in captured.err
    assert main(args) == 0  # from the cache: says so, and when computed
    captured = capsys.readouterr()
    assert "from the cache" in captured.err and "time when computed" in captured.out


def test_status_words_for_each_phase():
    assert progress_status(Progress(0, 0, 0, 0.0, phase="loading", detail="90.9 MB")) == (
        "loading the model (90.9 MB)"
    )
    status = progress_status(
        Progress(3, 8, 0, 1.0, phase="finalising", layers_done=2, layers_total=7, finalize_left_s=50)
    )
    assert status == "computing metrics: layer 3/7  ETA 0:50"
    running = progress_status(Progress(2, 8, 1000, 2.0, phase="running", finalize_left_s=4.0))
    assert running == "2/8 samples  1,000 tokens  500 tok/s  ETA 0:10"
