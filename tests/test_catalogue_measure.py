"""The fault catalogue, round 4 (issue 35): what a measurement itself must refuse, keep or say.

Read it as a table, grouped by case: the input, the sentence the user must see (a distinctive part
of it), and what must hold afterwards (the other layers' or models' numbers, checked against a
plain numpy computation over the same vectors; the cache). Most cases call the Python API in
process (an ``IsotuiError`` is the API's one sentence); those that run the CLI in a subprocess are
marked slow.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import isotui
from isotui.errors import IsotuiError
from isotui.store.cache import ResultCache

from .conftest import corpus
from .reference import hidden_vectors

TINY = "random:bert:hidden_size=32,num_hidden_layers=1,num_attention_heads=4,intermediate_size=64"
TINY_16 = "random:bert:hidden_size=16,num_hidden_layers=1,num_attention_heads=4,intermediate_size=32"
MAX_LENGTH = 24
N = 6


@pytest.fixture
def texts(tmp_path) -> tuple[list[str], str]:
    lines = corpus(N)
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return lines, f"text:{path}"


@pytest.fixture
def bert(tiny_models):
    """The tiny BERT of conftest (hidden 32, 2 blocks) and its tokenizer, loaded as objects."""
    from transformers import AutoModel, AutoTokenizer

    folder = tiny_models["bert"]
    return AutoModel.from_pretrained(str(folder)).eval(), AutoTokenizer.from_pretrained(str(folder))


def one(result: isotui.Result | isotui.Results) -> isotui.Result:
    """The one model's result of an ``isotui.run`` of one model."""
    assert isinstance(result, isotui.Result)
    return result


def cached(root: Path) -> int:
    return len(ResultCache(root).entries()) if root.exists() else 0


def numpy_avg_cos(x: np.ndarray) -> float:
    """Mean cosine over all distinct pairs, by its definition (O(n^2))."""
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    g = u @ u.T
    n = len(u)
    return float((g.sum() - np.trace(g)) / (n * (n - 1)))


# --- 1. a model object whose hidden states have other positions than its input ------------------


def _modules():
    import torch

    class Prompted(torch.nn.Module):
        """Prompt tuning as PEFT does it: VIRTUAL learned vectors before the text's embeddings,
        the hidden states of every position returned (so VIRTUAL more positions than tokens)."""

        VIRTUAL = 5

        def __init__(self, bert) -> None:
            super().__init__()
            self.bert = bert
            self.virtual = torch.nn.Parameter(torch.randn(self.VIRTUAL, bert.config.hidden_size))

        def forward(self, input_ids, attention_mask):
            embedded = self.bert.embeddings.word_embeddings(input_ids)
            b = len(input_ids)
            embedded = torch.cat([self.virtual.expand(b, -1, -1), embedded], 1)
            mask = torch.cat([attention_mask.new_ones(b, self.VIRTUAL), attention_mask], 1)
            out = self.bert(inputs_embeds=embedded, attention_mask=mask, output_hidden_states=True)
            return out.hidden_states

    class Three(torch.nn.Module):
        """Three positions of 32, whatever the input."""

        def __init__(self, bert) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return (h[:, :3],)

    class Ids(torch.nn.Module):
        """Hands back its input_ids (as (batch, position, 1)), which are not vectors."""

        def __init__(self, bert) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return (input_ids[..., None], self.bert(input_ids=input_ids).last_hidden_state)

    class OneSample(torch.nn.Module):
        """The first sample's hidden states only, whatever the batch."""

        def __init__(self, bert) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return (self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:1],)

    return {"prompted": Prompted, "three": Three, "ids": Ids, "one-sample": OneSample}


POSITIONS = [  # (module, the sentence's parts)
    pytest.param(
        "prompted",
        ("hidden state 0 has shape (", "positions are not the input's", "base model"),
        id="prompt-tuned",
    ),
    pytest.param(
        "three",
        ("hidden state 0 has shape (", ", 3, 32) for input_ids of shape (", "3 positions"),
        id="3-positions",
    ),
    pytest.param("ids", ("hidden state 0 is an int64 tensor", "not token ids"), id="input-ids"),
    pytest.param(
        "one-sample", ("hidden state 0 has shape (1, ", "its first axis must be the batch"), id="one-sample"
    ),
]


@pytest.mark.parametrize(("kind", "parts"), POSITIONS)
def test_hidden_states_of_other_positions_than_the_input_are_refused(bert, texts, tmp_path, kind, parts):
    """Was: 587 vectors measured for 232 tokens (a prompt-tuned model), 3 positions of 32
    measured, input_ids measured as vectors. Now one sentence naming the model, the hidden state
    and the shapes; the cache keeps what it had."""
    model, tok = bert
    _, data = texts
    root = tmp_path / "cache"
    isotui.run(model, tokenizer=tok, data=data, max_length=MAX_LENGTH, cache_dir=root, progress=False)
    module = _modules()[kind](model)
    with pytest.raises(IsotuiError) as caught:
        isotui.run(
            module, tokenizer=tok, data=data, max_length=MAX_LENGTH, cache_dir=root, progress=False, name=kind
        )
    said = str(caught.value)
    assert said.startswith(f"model {kind!r} (") and "\n" not in said, said
    for part in parts:
        assert part in said, said
    assert cached(root) == 1  # the good run's entry, and nothing of the refused one
    again = one(
        isotui.run(model, tokenizer=tok, data=data, max_length=MAX_LENGTH, cache_dir=root, progress=False)
    )
    assert again.result.from_cache


def test_a_modules_site_of_other_positions_is_refused_naming_the_module(bert, texts):
    """--modules (modules=) reads inner modules' outputs: the prompt-tuned model's blocks see the
    virtual tokens too, and are refused naming the module."""
    model, tok = bert
    _, data = texts
    module = _modules()["prompted"](model)
    with pytest.raises(
        IsotuiError, match=r"--modules: module bert\.encoder\.layer\.0's tensor has shape"
    ) as caught:
        isotui.run(
            module,
            tokenizer=tok,
            data=data,
            max_length=MAX_LENGTH,
            modules=["bert.encoder.layer.0"],
            cache=False,
            progress=False,
        )
    assert "positions are not the input's" in str(caught.value)


# --- 2. OMP_NUM_THREADS above the ceiling of --threads ----------------------------------------------


def test_omp_num_threads_is_capped_as_threads_is(monkeypatch):
    from isotui.extract import threads

    limit = threads.max_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(limit))
    assert threads.choose_threads(None) == (limit, None)  # the ceiling itself, as --threads
    monkeypatch.setenv("OMP_NUM_THREADS", "100000")
    chosen, note = threads.choose_threads(None)
    assert chosen == limit
    assert note is not None and "OMP_NUM_THREADS=100,000 is more than this machine can use" in note
    assert f"torch uses {limit:,} threads" in note
    assert threads.choose_threads(3) == (3, None)  # --threads still wins


def test_omp_num_threads_of_100000_gives_torch_the_ceiling(bert, texts, monkeypatch):
    """Was: torch.set_num_threads(100000) (SIGSEGV under a pid limit). The run gives torch the
    ceiling, says so in its notes, and the process gets its own thread count back. The spy never
    passes torch more than the ceiling: a build without it fails here without starting 100,000
    threads (which crashed this test process and starved the machine)."""
    import torch

    from isotui.extract.threads import max_threads

    model, tok = bert
    _, data = texts
    given: list[int] = []
    set_threads = torch.set_num_threads

    def spy(n: int) -> None:
        given.append(n)
        set_threads(min(n, max_threads()))

    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", spy)
    monkeypatch.setenv("OMP_NUM_THREADS", "100000")
    r = one(isotui.run(model, tokenizer=tok, data=data, max_length=MAX_LENGTH, cache=False, progress=False))
    assert given and given[0] == max_threads() and max(given) == max_threads()
    assert r.result.meta["threads"] == max_threads()
    assert any("OMP_NUM_THREADS=100,000" in n for n in r.result.meta["notes"])
    assert torch.get_num_threads() == before


@pytest.mark.slow
def test_the_command_line_caps_omp_num_threads(tmp_path):
    """One past the ceiling, not 100,000 (as test_catalogue_limits' --threads cases): a build
    without the cap fails here without starting 100,000 threads on the machine."""
    limit = 4 * (os.cpu_count() or 1)
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "isotui",
            "run",
            "-m",
            TINY,
            "--max-samples",
            "4",
            "--no-cache",
            "-q",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(limit + 1)},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    meta = json.loads(out.read_text(encoding="utf-8"))["results"][0]["meta"]
    assert meta["threads"] == limit
    said = f"OMP_NUM_THREADS={limit + 1:,} is more than this machine can use: torch uses {limit:,} threads"
    assert any(said in n for n in meta["notes"]), meta["notes"]


# --- 3. NaN or inf in a layer's hidden states ---------------------------------------------------------


def _poison(module) -> None:
    """A forward hook on ``module`` (a BERT block) writing NaN into dimension 0 and inf into
    dimension 1 of every position of its output, in place."""

    def hook(_m, _args, out):
        h = out[0] if isinstance(out, tuple) else out
        h[..., 0] = math.nan
        h[..., 1] = math.inf

    module.register_forward_hook(hook)


def test_a_layer_of_nan_or_inf_is_named_and_the_other_layers_are_measured(tiny_models, bert, texts, tmp_path):
    """Was: LinAlgError: Eigenvalues did not converge (an internal error). Decision: the layer's
    row is kept, every metric NaN, and one note names the layer with its counts; the other layers
    equal numpy over the same vectors; the cache gives the same back."""
    model, tok = bert
    lines, data = texts
    _poison(model.encoder.layer[-1])  # the last hidden state, layer 2, alone
    root = tmp_path / "cache"
    r = one(
        isotui.run(model, tokenizer=tok, data=data, max_length=MAX_LENGTH, cache_dir=root, progress=False)
    )
    vectors, _ = hidden_vectors(tiny_models["bert"], lines, max_length=MAX_LENGTH)  # the model unhooked
    assert [row["n_vectors"] for row in r.rows] == [len(x) for x in vectors]
    for row, x in zip(r.rows[:2], vectors[:2], strict=True):
        assert row["avg_cos"] == pytest.approx(numpy_avg_cos(x), rel=1e-6)
        assert row["drift_norm"] == pytest.approx(float(np.linalg.norm(x.mean(0))), rel=1e-6)
        assert row["mean_norm"] == pytest.approx(float(np.linalg.norm(x, axis=1).mean()), rel=1e-6)
    last = r.rows[2]
    for metric in ("avg_cos", "drift_norm", "mean_norm", "avg_cos_centered", "isoscore", "eff_rank", "iw"):
        assert math.isnan(last[metric]), metric
    n = len(vectors[2])
    said = f"layer 2 held {2 * n:,} NaN or inf values in {n:,} of its {n:,} vectors: its metrics are NaN"
    assert sum(said in note for note in r.result.meta["notes"]) == 1, r.result.meta["notes"]
    assert not any("held at once" in note for note in r.result.meta["notes"])  # read block by block
    again = one(
        isotui.run(model, tokenizer=tok, data=data, max_length=MAX_LENGTH, cache_dir=root, progress=False)
    )
    assert again.result.from_cache and said in " ".join(again.result.meta["notes"])
    assert math.isnan(again.rows[2]["avg_cos"]) and again.rows[1]["avg_cos"] == r.rows[1]["avg_cos"]


def test_a_module_of_nan_or_inf_is_named_by_its_module(bert, texts):
    """--modules: the note names the module, and the other module's row is measured."""
    model, tok = bert
    _, data = texts
    _poison(model.encoder.layer[1])
    r = one(
        isotui.run(
            model,
            tokenizer=tok,
            data=data,
            max_length=MAX_LENGTH,
            modules=["encoder.layer.0", "encoder.layer.1"],
            cache=False,
            progress=False,
        )
    )
    assert [row["module"] for row in r.rows] == ["encoder.layer.0", "encoder.layer.1"]
    assert math.isfinite(r.rows[0]["avg_cos"]) and math.isnan(r.rows[1]["avg_cos"])
    assert any(note.startswith("module encoder.layer.1 held ") for note in r.result.meta["notes"])


# --- 4. tokenizer= that is not a tokenizer -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "shown"), [(123, "an int (123)"), (4.5, "a float (4.5)"), (object, "a type")]
)
def test_a_tokenizer_that_is_not_one_is_one_sentence(bert, value, shown):
    """Was: internal error TypeError: object of type 'int' has no len()."""
    model, _ = bert
    with pytest.raises(IsotuiError) as caught:
        isotui.run(model, tokenizer=value, max_samples=4, cache=False, progress=False)
    said = str(caught.value)
    assert said.startswith("tokenizer= takes a Hugging Face tokenizer") and f"not {shown}" in said, said


def test_a_tokenizer_keyword_with_a_model_name_is_checked_too():
    with pytest.raises(
        IsotuiError, match=r"^tokenizer= with a model name takes the name of a tokenizer .* not an int"
    ):
        isotui.run(TINY, tokenizer=123, max_samples=4, cache=False, progress=False)


def test_a_processor_that_cannot_be_called_is_one_sentence(bert):
    model, _ = bert
    with pytest.raises(IsotuiError, match=r"^processor= takes a callable .* not an int \(5\)"):
        isotui.run(
            model.encoder, processor=5, data="synthetic:images", max_samples=2, cache=False, progress=False
        )


# --- 5 and 6. plug-ins: an infinity kept, sys.exit caught ------------------------------------------------


class Infinite:
    """Columns that are +inf and -inf on every layer, and the vectors it saw."""

    name = "infinite"
    version = "1"
    columns: tuple[str, ...] = ("up", "down", "seen")

    def empty(self, dim, device):
        import torch

        return {"n": torch.zeros((), dtype=torch.float64, device=device)}

    def batch(self, x):
        import torch

        return {"n": torch.tensor(float(len(x)), dtype=torch.float64, device=x.device)}

    def merge(self, a, b):
        return {"n": a["n"] + b["n"]}

    def finalize(self, state):
        return (math.inf, -math.inf, float(state["n"]))


class Quitter(Infinite):
    """Calls sys.exit(3) on a layer of dimension 16."""

    name = "quitter"
    columns = ("quit_seen",)

    def batch(self, x):
        if x.shape[1] == 16:
            sys.exit(3)
        return super().batch(x)

    def finalize(self, state):
        return (float(state["n"]),)


@pytest.fixture
def plugged(request):
    """The plug-in class the test names registered for the test, unregistered after."""
    metric = request.param()
    isotui.register_metric(metric)
    yield metric
    isotui.unregister_metric(metric.name)


@pytest.mark.parametrize("plugged", [Infinite], indirect=True)
def test_a_plug_ins_infinity_stays_infinite_in_the_table_csv_json_and_cache(
    plugged, tiny_models, texts, tmp_path, capsys
):
    """Was: inf came back as NaN (the plug-in's finalize made it NaN; the JSON wrote null)."""
    from isotui.cli import main

    lines, data = texts
    folder = str(tiny_models["bert"])
    root = tmp_path / "cache"
    argv = [
        "run",
        "-m",
        folder,
        "--data",
        data,
        "--max-length",
        str(MAX_LENGTH),
        "--cache-dir",
        str(root),
        "-q",
    ]
    counts = [len(x) for x in hidden_vectors(tiny_models["bert"], lines, max_length=MAX_LENGTH)[0]]
    for round_ in ("computed", "from the cache"):
        out_csv, out_json = tmp_path / f"{round_}.csv", tmp_path / f"{round_}.json"
        assert main([*argv, "--csv", str(out_csv), "--json", str(out_json)]) == 0, round_
        table = capsys.readouterr().out
        assert "inf" in table.split() and "-inf" in table.split(), table
        with out_csv.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        assert [float(r["up"]) for r in rows] == [math.inf] * len(counts)
        assert [float(r["down"]) for r in rows] == [-math.inf] * len(counts)
        assert [float(r["seen"]) for r in rows] == counts
        text = out_json.read_text(encoding="utf-8")
        assert "Infinity" not in text and "NaN" not in text  # strict JSON: 1e999 is a number
        doc = json.loads(text)["results"][0]
        assert [r["up"] for r in doc["rows"]] == [math.inf] * len(counts)
        assert [r["down"] for r in doc["rows"]] == [-math.inf] * len(counts)
    assert cached(root) == 1
    r = one(isotui.run(folder, data=data, max_length=MAX_LENGTH, cache_dir=root, progress=False))
    assert r.result.from_cache and r.rows[0]["up"] == math.inf and r.rows[0]["down"] == -math.inf


@pytest.mark.parametrize("plugged", [Quitter], indirect=True)
def test_a_plug_in_calling_sys_exit_fails_its_model_only(plugged, texts, tmp_path, capsys):
    """Was: isotui ended without a word and without the other model's result."""
    from isotui.cli import main

    _, data = texts
    root, out = tmp_path / "cache", tmp_path / "both.csv"
    argv = [
        "run",
        "-m",
        TINY_16,
        "-m",
        TINY,
        "--data",
        data,
        "--cache-dir",
        str(root),
        "-q",
        "--csv",
        str(out),
    ]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err and "internal error" not in err, err
    assert (
        "metric plug-in 'quitter' failed in batch() on a layer of dimension 16: it called sys.exit(3)" in err
    )
    assert "1 of 2 models failed" in err
    with out.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert {r["model"] for r in rows} == {TINY} and all(float(r["quit_seen"]) > 0 for r in rows)
    assert cached(root) == 1
    with pytest.raises(IsotuiError, match=r"'quitter' failed in batch\(\) .* it called sys\.exit\(3\)"):
        isotui.run(TINY_16, data=data, cache=False, progress=False)


def test_a_plug_in_calling_sys_exit_when_imported_is_one_sentence(tmp_path, monkeypatch, texts):
    from .test_plugins import install

    _, data = texts
    install(tmp_path, monkeypatch, "import sys\nsys.exit('no GPU here')\n", "Metric", name="exits")
    with pytest.raises(
        IsotuiError, match=r"plug-in 'exits' .* failed to load: it called sys\.exit\('no GPU here'\)"
    ):
        isotui.run(TINY, data=data, max_samples=4, cache=False, progress=False)


# --- 7. a model on the meta device ------------------------------------------------------------------


def test_a_meta_device_model_is_one_sentence_with_and_without_the_cache(bert, tmp_path):
    """Was: ``Tensor.item() cannot be called on meta tensors`` with cache=False, and 'pass
    cache=False' with the cache. Now the same sentence both ways, and nothing cached."""
    import torch
    from transformers import BertModel

    model, tok = bert
    with torch.device("meta"):
        empty = BertModel(model.config)
    said = []
    for cache in (False, True):
        with pytest.raises(IsotuiError) as caught:
            isotui.run(
                empty, tokenizer=tok, max_samples=4, cache=cache, cache_dir=tmp_path / "cache", progress=False
            )
        said.append(str(caught.value))
    assert said[0] == said[1]
    assert "on the meta device" in said[0] and "nothing to run" in said[0] and "load its weights" in said[0]
    assert cached(tmp_path / "cache") == 0


def test_a_model_offloaded_by_accelerate_runs_without_the_cache(tiny_models, bert, texts):
    """Offloaded weights wait on the meta device and accelerate's hooks bring them at each forward:
    cache=False measures it (its inputs on the hooks' device, not the meta device), to numpy's
    numbers over the model's own vectors; with the cache, the sentence says to pass cache=False."""
    import torch
    from accelerate import cpu_offload

    model, tok = bert
    lines, data = texts
    cpu_offload(model, execution_device=torch.device("cpu"))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    r = one(isotui.run(model, tokenizer=tok, data=data, max_length=MAX_LENGTH, cache=False, progress=False))
    vectors, _ = hidden_vectors(tiny_models["bert"], lines, max_length=MAX_LENGTH)
    assert [row["n_vectors"] for row in r.rows] == [len(x) for x in vectors]
    for row, x in zip(r.rows, vectors, strict=True):
        assert row["avg_cos"] == pytest.approx(numpy_avg_cos(x), rel=1e-6)
    with pytest.raises(IsotuiError, match=r"offloaded by accelerate.*pass cache=False"):
        isotui.run(model, tokenizer=tok, data=data, max_length=MAX_LENGTH, progress=False)
