"""The bad-input and fault catalogue, inputs and crashes (issue 11; files and the cache are in
test_catalogue_files.py).

Read it as a table: each ``Case`` is one input, grouped by cause, with the sentence the user must
see (a distinctive part of it), the exit code, and what is on disk afterwards. Every command runs
the real CLI in a subprocess: ``python -m isotui ...``. Exit codes: 0 ok, 1 internal error,
2 bad input, 130 interrupted, 141 stdout closed (128 + SIGPIPE).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import tracemalloc
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from isotui.store.cache import ResultCache

from .conftest import corpus

TINY = "random:bert:hidden_size=32,num_hidden_layers=1,num_attention_heads=4,intermediate_size=64"
TINY_B = TINY + ",intermediate_size=32"  # another tiny model (the last override wins)
TINY_VIT = (
    "random:vit:hidden_size=32,num_hidden_layers=1,num_attention_heads=4,intermediate_size=64,"
    "image_size=32,patch_size=8"
)
BAD = "random:bert:hidden_size=abc"
SMALL = ("--max-samples", "20", "-q")


def isotui(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "isotui", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=timeout,
    )


def cached_runs(tmp_path: Path) -> int:
    return len(ResultCache(tmp_path / "cache").entries())


def one_sentence(stderr: str) -> str:
    """The error lines, checked to be sentences and not a traceback."""
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    return stderr


@dataclass
class Case:
    """One catalogue row: ``args`` (``{tmp}`` is the test's folder), the expected sentence, the
    exit code and a check of what is on disk afterwards (``disk`` says it in words)."""

    args: tuple[str, ...]
    sentence: str
    code: int
    disk: str
    check: Callable[[Path], bool] = lambda tmp: True
    setup: Callable[[Path], None] = lambda tmp: None


def run_case(case: Case, tmp_path: Path) -> subprocess.CompletedProcess:
    case.setup(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in case.args]
    proc = isotui(*args, cwd=tmp_path)
    assert proc.returncode == case.code, proc.stderr
    assert case.sentence in " ".join(proc.stderr.split()), proc.stderr
    assert case.check(tmp_path), f"on disk, expected: {case.disk}"
    return proc


def csv_models(path: Path) -> set[str]:
    import csv

    with path.open(newline="") as f:
        return {row["model"] for row in csv.DictReader(f)}


# --- 3. one model's failure is its own ---------------------------------------------------------

MULTI = [
    pytest.param(
        Case(
            (
                "run",
                "-m",
                TINY,
                "-m",
                BAD,
                "-m",
                TINY_B,
                *SMALL,
                "--csv",
                "{tmp}/o.csv",
                "--json",
                "{tmp}/o.json",
            ),
            "1 of 3 models failed: random:bert:hidden_size=abc",
            2,
            "o.csv and o.json with the 1st and 3rd model; both cached",
            lambda t: (
                csv_models(t / "o.csv") == {TINY, TINY_B}
                and {r["model"] for r in json.loads((t / "o.json").read_text())["results"]} == {TINY, TINY_B}
                and cached_runs(t) == 2
            ),
        ),
        id="run",
    ),
    pytest.param(
        Case(
            ("experiment", "attention", "-m", TINY, "-m", BAD, "-m", TINY_B, *SMALL, "--csv", "{tmp}/a.csv"),
            "1 of 3 models failed",
            2,
            "a.csv with the 1st and 3rd model",
            lambda t: csv_models(t / "a.csv") == {TINY, TINY_B},
        ),
        id="attention",
    ),
    pytest.param(
        Case(
            ("experiment", "final-norm", "-m", BAD, "-m", "random:gpt2:n_embd=32,n_layer=1,n_head=4", *SMALL),
            "1 of 2 models failed",
            2,
            "nothing written (no --csv)",
        ),
        id="final-norm",
    ),
    pytest.param(
        Case(
            ("experiment", "gradients", "-m", TINY, "-m", BAD, *SMALL, "--json", "{tmp}/g.json"),
            "refuses the settings hidden_size=abc",
            2,
            "g.json with the first model",
            lambda t: [r["model"] for r in json.loads((t / "g.json").read_text())["results"]] == [TINY],
        ),
        id="gradients",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", MULTI)
def test_one_model_failing_leaves_the_others(case, tmp_path):
    one_sentence(run_case(case, tmp_path).stderr)


def test_an_internal_error_in_one_model_is_its_own(tmp_path, monkeypatch, capsys):
    """A bug in one model (not bad input): exit 1, the others still printed and exported."""
    from isotui.cli import main
    from isotui.experiments import layerwise

    real = layerwise.measure

    def measure(spec, *args, **kwargs):
        if spec.model == "boom":
            raise RuntimeError("a bug")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(layerwise, "measure", measure)
    code = main(["run", "-m", "boom", "-m", TINY, *SMALL, "--csv", str(tmp_path / "o.csv")])
    err = capsys.readouterr().err
    assert code == 1
    assert "internal error in boom: RuntimeError: a bug" in err and "1 of 2 models failed: boom" in err
    assert csv_models(tmp_path / "o.csv") == {TINY} and cached_runs(tmp_path) == 1


def test_a_failing_checkpoint_leaves_the_rest_of_the_series(tmp_path, capsys):
    from rich.console import Console

    from isotui.cli.common import exit_code, print_error
    from isotui.experiments.checkpoints import run_series
    from isotui.experiments.series import Checkpoint
    from isotui.results import ModelFailures, Outcome
    from isotui.spec import make_spec

    ckpts = [Checkpoint(TINY, "step0", 0), Checkpoint(BAD, "step1", 1), Checkpoint(TINY_B, "step2", 2)]
    err = Console(stderr=True)
    outcome = Outcome("checkpoints", [], [], {}, total=3, what="checkpoints")
    failures = ModelFailures(outcome, lambda _name, text: print_error(err, text))
    base = make_spec(TINY, max_samples=10)
    result = run_series(None, ckpts, base, ResultCache(tmp_path / "cache"), failures=failures)
    assert [c.label for c in result.checkpoints] == ["step0", "step2"]
    assert exit_code(outcome, err) == 2
    assert "checkpoint step1:" in capsys.readouterr().err
    with pytest.raises(Exception, match="checkpoint step1"):  # the app's way: the series stops
        run_series(None, ckpts, base, ResultCache(tmp_path / "cache"))


# --- 6. a text model without a usable tokenizer -----------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_folders(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """The tiny BERT without tokenizer files, and with a WordPiece vocabulary of the right size
    whose entries match no word (every word is [UNK])."""
    from transformers import BertTokenizer

    root = tmp_path_factory.mktemp("tok")
    bare = root / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_models["bert"] / name, bare / name)
    junk = root / "junk"
    shutil.copytree(bare, junk)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"zz{i}" for i in range(30517)]
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    BertTokenizer(str(root / "vocab.txt")).save_pretrained(junk)
    return {"bare": bare, "junk": junk}


TOKENIZER_CASES = [
    pytest.param(
        "bare",
        (),
        "has 30,522 token embeddings but its tokenizer knows only 5 tokens, so most words would be fed "
        "as unknown; pass the tokenizer it was trained with as --tokenizer NAME_OR_DIR",
        2,
        0,
        id="no-tokenizer-files",
    ),
    pytest.param(
        "junk",
        (),
        "turns 100% of the first samples' tokens into the unknown token [UNK]; pass the tokenizer it was "
        "trained with as --tokenizer NAME_OR_DIR",
        2,
        0,
        id="every-word-unknown",
    ),
    pytest.param("bare", ("--tokenizer", "minilm"), "", 0, 1, id="bare-with-tokenizer-flag"),
    pytest.param(
        "bare",
        ("--tokenizer", "{junk}"),
        "into the unknown token [UNK]; pass another one as --tokenizer NAME_OR_DIR",
        2,
        0,
        id="flag-naming-a-useless-tokenizer",
    ),
    pytest.param(
        "bare", ("--tokenizer", "./nowhere"), "tokenizer folder", 2, 0, id="flag-naming-a-missing-folder"
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("folder", "extra", "sentence", "code", "cached"), TOKENIZER_CASES)
def test_text_model_without_a_usable_tokenizer(
    tokenizer_folders, tmp_path, folder, extra, sentence, code, cached
):
    extra = tuple(a.replace("{junk}", str(tokenizer_folders["junk"])) for a in extra)
    proc = isotui("run", "-m", str(tokenizer_folders[folder]), *extra, *SMALL, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert sentence in " ".join(one_sentence(proc.stderr).split())
    assert cached_runs(tmp_path) == cached


@pytest.mark.slow
def test_untrained_model_with_a_large_vocabulary_keeps_its_stand_in_tokenizer(tmp_path):
    """200,000 embedding rows, MiniLM's 30,522 tokens: deliberate for an untrained model."""
    proc = isotui(
        "run", "-m", "random:gpt2:n_embd=32,n_layer=1,n_head=4,vocab_size=200000", *SMALL, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert cached_runs(tmp_path) == 1


def test_tokenizer_flag_is_a_stand_in_and_part_of_the_key_only_when_given(tokenizer_folders, tiny_models):
    from isotui.experiments.layer_pass import load_prepared, prepare
    from isotui.extract.inputs import takes_token_types
    from isotui.spec import make_spec

    own = prepare(make_spec(str(tiny_models["bert"]), max_samples=5))
    given = prepare(make_spec(str(tiny_models["bert"]), max_samples=5, tokenizer="minilm"))
    assert own.key != given.key
    assert own.key == prepare(make_spec(str(tiny_models["bert"]), max_samples=5, tokenizer=None)).key
    loaded, _ = load_prepared(prepare(make_spec(str(tokenizer_folders["bare"]), tokenizer="minilm")))
    assert loaded.own_tokenizer is False and len(loaded.tokenizer) == 30522
    assert takes_token_types(loaded, lambda name: True)  # BERT declares type_vocab_size: still fed


@pytest.mark.slow
def test_tokenizer_config_key_is_relative_to_the_config(tokenizer_folders, tmp_path):
    from isotui.models.naming import bundled_minilm_dir

    shutil.copytree(bundled_minilm_dir(), tmp_path / "tok")
    (tmp_path / "job.toml").write_text(f'model = "{tokenizer_folders["bare"]}"\ntokenizer = "./tok"\n')
    proc = isotui("run", "job.toml", *SMALL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"fed the tokenizer {tmp_path / 'tok'} (--tokenizer)" in proc.stdout.replace("\n", "")


# --- 7. quitting the app while a job runs -----------------------------------------------------

QUIT_DRIVER = textwrap.dedent(
    """
    import sys
    from isotui.tui.app import IsotuiApp, run_app

    async def quit_while_running(pilot):
        app = pilot.app
        app.submit("random:bert:num_hidden_layers=4", {"max_samples": 3000, "batch_size": 8})
        # the job handed to its lane, whose worker process the app has started: an event of the
        # app's own, not the worker's progress (a worker at nice 10 may get no CPU for minutes on
        # a busy machine); quitting then waits at most QUIT_WAIT_S for it, then kills it
        while len(app.backend.worker_pids()) < 2:  # the lookup worker, and the lane's
            await pilot.pause(0.1)
        await pilot.pause(0.5)
        await pilot.press(sys.argv[1])
        while app.is_running:
            await pilot.pause(0.1)
        print("NOTICES", [n.message for n in app._notifications], flush=True)

    run_app(IsotuiApp(), headless=True, size=(140, 40), auto_pilot=quit_while_running)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["q", "ctrl+q"])
def test_quitting_during_a_job_stops_it_and_exits_0(key, tmp_path):
    """Was: "terminate called without an active exception", exit 134 (the interpreter's teardown
    under a live torch thread); now: "stopping...", a bounded wait, exit 0. Whatever the load: it
    waits for the job's worker process to be started, not for the job to run (issue 30: at load 20
    the nice-10 worker never reached "running" within 600 s)."""
    proc = subprocess.run(
        [sys.executable, "-c", QUIT_DRIVER, key],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "terminate called" not in proc.stderr
    assert "stopping..." in proc.stdout


def test_ctrl_c_in_the_app_says_how_to_quit_without_raw_markup(tmp_path):
    import asyncio

    from isotui.tui.app import IsotuiApp

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache", export_dir=tmp_path)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.press("ctrl+c")
            await pilot.pause(0.2)
            return [n.message for n in app._notifications]

    messages = asyncio.run(scenario())
    assert "Press ctrl+q to quit the app" in messages
    assert not any("[b]" in m for m in messages)


# --- 9. one sentence, not an internal error ---------------------------------------------------


def bomb_png(folder: Path) -> None:
    """A 30,000 x 30,000 grey PNG of a few hundred bytes: PIL refuses it as a decompression bomb."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    folder.mkdir()
    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
    (folder / "bomb.png").write_bytes(png + chunk(b"IEND", b""))


def non_utf8_config(tmp: Path) -> None:
    (tmp / "job.toml").write_bytes(b'model = "minilm"\n# caf\xe9\n')


def a_file(tmp: Path) -> None:
    (tmp / "afile").write_text("x")


ONE_SENTENCE = [
    pytest.param(
        Case(
            ("experiment", "gradients", "-m", "random:t5:d_model=32", "--dry-run"),
            "--dry-run plans text models whose config gives hidden_size and num_hidden_layers",
            2,
            "nothing",
            lambda t: not (t / "cache").exists(),
        ),
        id="dry-run-encoder-decoder",
    ),
    pytest.param(
        Case(
            ("experiment", "attention", "-m", "random:timm:resnet18", "--dry-run"),
            "--dry-run plans transformers models; 'random:timm:resnet18' is a timm model",
            2,
            "nothing",
            lambda t: not (t / "cache").exists(),
        ),
        id="dry-run-timm",
    ),
    pytest.param(
        Case(
            ("run", "job.toml"),
            "is not UTF-8 text (byte 22); save it as UTF-8",
            2,
            "nothing",
            setup=non_utf8_config,
        ),
        id="non-utf8-config",
    ),
    pytest.param(
        Case(
            ("run", "-m", TINY_VIT, "--data", "images:{tmp}/imgs", *SMALL),
            "which is either damaged or a decompression bomb",
            2,
            "no cache entry",
            lambda t: cached_runs(t) == 0,
            setup=lambda t: bomb_png(t / "imgs"),
        ),
        id="decompression-bomb-png",
    ),
    pytest.param(
        Case(
            ("experiment", "drift-block", "--vocab", "100000000000", "--norms", "0,1", "-q"),
            "drift-block with --vocab 100000000000 --hidden 768",
            2,
            "no drift-block cache",
            lambda t: not (t / "cache" / "drift-block").exists(),
        ),
        id="drift-block-huge-vocab",
    ),
    pytest.param(
        Case(
            ("experiment", "drift-block", "--hidden", "10000000", "--heads", "1", "--norms", "0", "-q"),
            "GiB, and",
            2,
            "no drift-block cache",
            lambda t: not (t / "cache" / "drift-block").exists(),
        ),
        id="drift-block-huge-hidden",
    ),
    pytest.param(
        Case(
            ("train-tiny", "--out", "{tmp}/afile/run", "-q"),
            "cannot be created or read (Not a directory); give a folder you can write to",
            2,
            "afile untouched",
            lambda t: (t / "afile").read_text() == "x",
            setup=a_file,
        ),
        id="train-tiny-out-uncreatable",
    ),
    pytest.param(
        Case(
            ("run", "-m", TINY, "--device", "cuda:x", *SMALL),
            "device 'cuda:x' is not one of auto, cpu, cuda, cuda:N (N a GPU number) or mps",
            2,
            "no cache entry",
            lambda t: cached_runs(t) == 0,
        ),
        id="device-cuda-x",
    ),
    pytest.param(
        Case(
            ("experiment", "attention", "-m", TINY, "--device", "cuda:", *SMALL),
            "is not one of auto, cpu, cuda, cuda:N",
            2,
            "nothing",
        ),
        id="device-cuda-colon",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", ONE_SENTENCE)
def test_one_sentence_not_an_internal_error(case, tmp_path):
    one_sentence(run_case(case, tmp_path).stderr)


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="on a GPU server cuda:99 is checked by count"
)
def test_cuda_99_without_a_gpu(tmp_path):
    proc = isotui("run", "-m", TINY, "--device", "cuda:99", *SMALL, cwd=tmp_path)
    assert proc.returncode == 2 and "sees no CUDA GPU; use --device cpu" in one_sentence(proc.stderr)


def test_cuda_index_past_the_gpu_count(monkeypatch):
    """On a GPU server (simulated: torch says 2 GPUs): cuda:99 does not exist, cuda:1 does."""
    import torch

    from isotui.errors import IsotuiError
    from isotui.extract.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(
        IsotuiError, match=r"device 'cuda:99' does not exist: this machine has 2 CUDA GPU\(s\)"
    ):
        resolve_device("cuda:99")
    assert resolve_device("cuda:1") == "cuda:1"


def test_non_utf8_settings_file_lets_the_app_start(tmp_path):
    import asyncio

    from isotui.tui.app import IsotuiApp

    settings = tmp_path / "config.toml"
    settings.write_bytes(b'theme = "caf\xe9"\n')

    async def scenario():
        app = IsotuiApp(cache_root=tmp_path / "cache", settings_file=settings)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            return [n.message for n in app._notifications]

    messages = asyncio.run(scenario())
    assert any(f"settings file {settings} is not UTF-8 text" in m for m in messages), messages


@pytest.mark.slow
def test_stdout_closed_early_ends_quietly(tmp_path):
    """``isotui run ... | head``: the reader is gone before the table is written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "isotui", "run", "-m", TINY, *SMALL],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ),
    )
    proc.stdout.close()
    _, err = proc.communicate(timeout=600)
    assert proc.returncode in (0, 141), err
    assert err == b""
    assert cached_runs(tmp_path) == 1  # computed and cached before the write failed


# --- 10. memory blow-ups from bad sizes -------------------------------------------------------


def test_synthetic_source_is_lazy():
    from isotui.data.sources import fingerprint, load_samples, parse_data

    spec = parse_data("synthetic:images")
    tracemalloc.start()
    samples = load_samples(spec, 10_000_000)
    fp = fingerprint(samples, spec)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(samples) == 10_000_000 and samples[-1] == "synthetic:images#9999999"
    assert samples[3:5] == ["synthetic:images#3", "synthetic:images#4"]
    assert fp.startswith("sha256:") and peak < 1 << 20  # a list of 1e7 names would be ~700 MB


@pytest.mark.slow
def test_synthetic_source_beyond_its_cap_is_one_sentence(tmp_path):
    proc = isotui(
        "run", "-m", TINY_VIT, "--data", "synthetic:images", "--max-samples", "100000000", "-q", cwd=tmp_path
    )
    assert proc.returncode == 2
    assert (
        "--max-samples 100,000,000 is more than synthetic:images gives (at most 10,000,000"
        in one_sentence(proc.stderr)
    )


def test_batch_order_from_numpy_matches_the_sorted_reference():
    """Batches (longest first, equal keys together, then sample order), now ordered by numpy
    rather than a Python list of key tuples: the same batches as the plain sort."""
    import numpy as np

    from isotui.extract.planning import BatchPlan

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=500)
    for same in (None, rng.integers(0, 3, size=500) * 1000):
        got = list(BatchPlan(lengths, range(500), same_key=same, token_budget=120))
        order = sorted(range(500), key=lambda i: (-lengths[i], -int(same[i]) if same is not None else 0, i))
        want, pos = [], 0
        while pos < 500:
            batch = order[pos : pos + max(1, 120 // max(int(lengths[order[pos]]), 1))]
            if same is not None:
                batch = [i for i in batch if same[i] == same[batch[0]]]
            want.append(batch)
            pos += len(batch)
        assert got == want


@pytest.mark.slow
def test_a_huge_line_is_cut_while_reading(tmp_path):
    from isotui.data.sources import load_samples, parse_data

    (tmp_path / "long.txt").write_text("short line\n" + "word " * 400_000 + "\n", encoding="utf-8")
    samples = load_samples(parse_data(f"text:{tmp_path / 'long.txt'}"), max_length=100)
    assert [len(s) for s in samples] == [10, 6400]  # 64 characters per token of --max-length
    assert samples.notes == [
        "1 sample(s) longer than 6,400 characters (64 per token of the length limit) were cut while reading"
    ]
    proc = isotui("run", "-m", TINY, "--data", "text:long.txt", "--json", "o.json", "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    notes = json.loads((tmp_path / "o.json").read_text())["results"][0]["meta"]["notes"]
    assert any("were cut while reading" in n for n in notes)


# --- 11. a config file is data, not a command -------------------------------------------------


def config(text: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / "cfg").mkdir()
        (tmp / "cfg" / "job.toml").write_text(f'model = "{TINY}"\nmax_samples = 20\n{text}\n')
        (tmp / "victim.txt").write_text("precious")

    return setup


def victim_intact(tmp: Path) -> bool:
    return (tmp / "victim.txt").read_text() == "precious"


CONFIG_CASES = [
    pytest.param(
        Case(
            ("run", "cfg/job.toml", "-q"),
            "sets trust_remote_code = true, but a config file cannot run a model's own code; pass "
            "--trust-remote-code on the command line if you trust it",
            2,
            "no cache entry",
            lambda t: cached_runs(t) == 0,
            setup=config("trust_remote_code = true"),
        ),
        id="config-asks-for-remote-code",
    ),
    pytest.param(
        Case(
            ("run", "cfg/job.toml", "--trust-remote-code", "-q"),
            "",
            0,
            "the run cached",
            lambda t: cached_runs(t) == 1,
            setup=config("trust_remote_code = true"),
        ),
        id="config-asks-and-the-flag-grants",
    ),
    pytest.param(
        Case(
            ("run", "cfg/job.toml", "-q"),
            "is outside the config file's folder",
            2,
            "victim.txt untouched, nothing cached",
            lambda t: victim_intact(t) and cached_runs(t) == 0,
            setup=config('csv = "../victim.txt"'),
        ),
        id="config-csv-outside",
    ),
    pytest.param(
        Case(
            ("run", "cfg/job.toml", "-q"),
            "name it with --json on the command line instead",
            2,
            "victim.txt untouched",
            victim_intact,
            setup=lambda t: config("")(t) or config_append(t, f'json = "{t / "victim.txt"}"'),
        ),
        id="config-json-absolute-outside",
    ),
    pytest.param(
        Case(
            ("run", "cfg/job.toml", "--csv", "victim.txt", "-q"),
            "wrote",
            0,
            "victim.txt replaced: the command line named it",
            lambda t: not victim_intact(t),
            setup=config('csv = "../victim.txt"'),
        ),
        id="command-line-names-the-output",
    ),
    pytest.param(
        Case(
            ("run", "cfg/job.toml", "-q"),
            "wrote",
            0,
            "cfg/out/o.csv written",
            lambda t: (t / "cfg" / "out" / "o.csv").is_file(),
            setup=lambda t: config('csv = "out/o.csv"')(t) or (t / "cfg" / "out").mkdir(),
        ),
        id="config-csv-inside",
    ),
]


def config_append(tmp: Path, line: str) -> None:
    path = tmp / "cfg" / "job.toml"
    path.write_text(path.read_text() + line + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("case", CONFIG_CASES)
def test_config_file_cannot_run_code_or_write_outside(case, tmp_path):
    one_sentence(run_case(case, tmp_path).stderr)


@pytest.fixture
def custom_code_model(tmp_path) -> Path:
    """A model folder whose config asks for its own code; importing that code leaves a marker."""
    folder = tmp_path / "custom"
    folder.mkdir()
    cfg = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}
    cfg["auto_map"] = {"AutoConfig": "code.Config", "AutoModel": "code.Model"}
    (folder / "config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "RAN"
    (folder / "code.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return folder


@pytest.mark.slow
def test_remote_code_is_never_on_implicitly(custom_code_model, tmp_path):
    """Neither a bare command line nor a config file runs a model's own code."""
    proc = isotui("run", "-m", str(custom_code_model), *SMALL, cwd=tmp_path)
    assert proc.returncode == 2
    assert "pass --trust-remote-code if you trust it" in one_sentence(proc.stderr)
    assert not (tmp_path / "RAN").exists()


# --- 12. the --trust-remote-code advice only where it applies ----------------------------------


def model_folder(config_json: str | None) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / "m").mkdir()
        if config_json is not None:
            (tmp / "m" / "config.json").write_text(config_json)

    return setup


BERT_JSON = json.dumps(
    {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}
)
ADVICE = "pass --trust-remote-code"
LOAD_HINTS = [
    pytest.param(model_folder(BERT_JSON), "no file named model.safetensors", False, id="missing-weights"),
    pytest.param(model_folder("{not json"), "is not a valid JSON file", False, id="malformed-json"),
    pytest.param(
        model_folder(BERT_JSON.replace('"bert"', '"weirdformer"')),
        "weirdformer",
        True,
        id="unknown-model-type",
    ),
    pytest.param(
        model_folder(BERT_JSON[:-1] + ', "auto_map": {"AutoModel": "x.Model"}}'),
        "could not load",
        True,
        id="auto-map",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("setup", "sentence", "advised"), LOAD_HINTS)
def test_remote_code_advice_only_for_custom_code(setup, sentence, advised, tmp_path):
    setup(tmp_path)
    proc = isotui("run", "-m", "./m", *SMALL, cwd=tmp_path)
    err = " ".join(one_sentence(proc.stderr).split())
    assert proc.returncode == 2 and sentence in err
    assert (ADVICE in err) == advised


# --- what already holds (keep it) --------------------------------------------------------------


@pytest.mark.slow
def test_sigint_stops_a_run_with_130_and_one_sentence(tmp_path):
    """Ctrl-C (SIGINT) to a running ``isotui run`` ends it (no time asserted, only that it ends).

    Sent once ``-v`` says the forward is running, not at a fixed delay: on a loaded machine a
    child could still be importing torch and transformers, and a ^C there lands inside their
    import-time ``exec`` of generated code (``dataclasses``), where CPython 3.11 records a
    KeyboardInterrupt as unhandled even when isotui catches it: "isotui: cancelled", then an end
    by the signal itself (-2, which a shell reports as 130 too)."""
    data = tmp_path / "d.txt"
    data.write_text("\n".join(corpus(3000)) + "\n", encoding="utf-8")
    argv = ["-m", "isotui", "run", "-m", "random:bert:num_hidden_layers=4", "--data", f"text:{data}", "-v"]
    proc = subprocess.Popen(
        [sys.executable, *argv],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    lines: list[str] = []
    running = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if ": running:" in line:
                running.set()
        running.set()  # ended: the assertion below says so

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert running.wait(timeout=600), "never started the forward"
    assert proc.poll() is None, "ended before it was interrupted: " + "".join(lines)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=600)
    reader.join(timeout=60)
    err = "".join(lines)
    assert proc.returncode in (130, -signal.SIGINT), err
    assert "isotui: cancelled" in err and "Traceback" not in err
    assert cached_runs(tmp_path) == 0
