"""Shared fixtures: tiny random-init models saved to disk and loaded back by path, offline."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

import isotui
from isotui.paths import builtin_corpus_path

_HF_HOME = pytest.StashKey[str]()  # this test process's Hugging Face folder


def pytest_configure(config: pytest.Config) -> None:
    """Hugging Face's own caches (datasets', its modules') in a folder of this test process, not
    the user's ~/.cache/huggingface: each pytest-xdist worker gets its own, and a dataset two
    workers load at once is never half-written for the other. Set before any test module imports
    ``datasets``, which reads them once. (The hub cache is each test's own: ``_isolated``.)"""
    folder = tempfile.mkdtemp(prefix="isotui-tests-hf-")
    config.stash[_HF_HOME] = folder
    os.environ["HF_HOME"] = folder
    os.environ["HF_DATASETS_CACHE"] = os.path.join(folder, "datasets")
    os.environ["HF_MODULES_CACHE"] = os.path.join(folder, "modules")
    # torch's intra-op threads fixed at one, here (``choose_threads`` reads the variable at every
    # run, and module-scoped fixtures run before any function-scoped one) and in the CLI's
    # subprocesses. By default a run takes its share of the cores from the load average of the
    # moment, and a 2-core CI machine running two workers swings between 1 and 2 threads; the
    # thread count changes the order of float32 sums in the forward, so two runs a test compares
    # to 1e-12 differed by 4.5e-11 (CI of stop 34, ``test_shards``). The default itself is
    # ``test_threads``'s, which unsets this.
    os.environ["OMP_NUM_THREADS"] = "1"
    # A background job of a shell without job control (`make test &` in a script, nohup) starts
    # with SIGINT ignored, and every process a test starts inherits that: the tests that press ^C
    # on a child then wait for an end that never comes. Their ^C is the point: take it back.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_HF_HOME, None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped where torch sees no CUDA GPU (torch is imported only when
    such a test was collected)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is false here")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def _cuda_present() -> bool:
    """Whether this machine has a CUDA GPU, asked once before any test hides it (CUDA reads
    CUDA_VISIBLE_DEVICES when it starts in a process, so it starts here, with the real one)."""
    if not any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg")):
        return False  # no NVIDIA driver (nor WSL's): no need to import torch to know
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture(autouse=True)
def _cpu_unless_gpu(request, monkeypatch, _cuda_present):
    """A test not marked ``gpu`` runs as on a machine without CUDA, on a GPU server too: there
    ``--device auto`` (every test that names no device) would pick cuda, whose float32 forward
    differs from the CPU's in the last bits, and the suite checks numbers against plain CPU
    references to 1e-6 and reads the CPU's plans and notes (issue 26: about 35 failures on an
    H100). Hidden in this process (torch.cuda.is_available() is false while the test runs) and in
    the CLI's subprocesses (CUDA_VISIBLE_DEVICES empty). The GPU paths are the ``gpu`` tests'."""
    if not _cuda_present or request.node.get_closest_marker("gpu"):
        return
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def app_tabs_only(monkeypatch):
    """The registry less the experiments whose lab tab is not one of the app's own modules
    (``isotui.tui.*``): the lab that the key lists and screenshots pin, whatever tabs others add."""
    from isotui.experiments import registry

    own = [e for e in registry.REGISTRY if e.lab_tab is None or e.lab_tab.startswith("isotui.tui.")]
    monkeypatch.setattr(registry, "REGISTRY", tuple(own))


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No network, and a private result cache and config folder for every test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ISOTUI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no user settings or themes
    monkeypatch.delenv("ISOTUI_CONFIG", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))  # not the developer's own models
    monkeypatch.setenv("COLORTERM", "truecolor")  # the default theme, whatever terminal runs the tests
    yield
    if gc.get_freeze_count():  # an app froze the test process's objects (isotui.tui.app.settle_memory)
        gc.unfreeze()


PACKAGE_DIR = os.path.dirname(os.path.realpath(isotui.__file__)) + os.sep  # the isotui imported


def in_package(path: str) -> bool:
    """Whether a frame's file is isotui's own code: under the package's own folder, not any path
    that merely contains "isotui/" (a clone in a folder named isotui has its .venv, and so
    transformers' code, under ``isotui/``: issue 35's sync test charged transformers' reads to it)."""
    return os.path.realpath(path).startswith(PACKAGE_DIR)


def same(a: object, b: object) -> bool:
    """``a == b`` where NaN equals NaN, through dataclasses, dicts, lists and tuples: Python 3.13's
    dataclass ``__eq__`` compares field by field, so a row holding NaN no longer equals its own
    round trip (3.12 compared tuples, where the shared ``math.nan`` object equals itself)."""
    import dataclasses
    import math

    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        return type(a) is type(b) and same(dataclasses.asdict(a), dataclasses.asdict(b))  # type: ignore[arg-type]
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def corpus(n: int) -> list[str]:
    lines = builtin_corpus_path().read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line.strip()][:n]


def _bpe_tokenizer(folder: Path, vocab_size: int = 600):
    """A real byte-level BPE tokenizer (GPT-2 style: no special tokens added), trained offline."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus(2000), vocab_size=vocab_size, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        model_max_length=128,
    )
    tok.save_pretrained(folder)
    return tok


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny untrained BERT, GPT-2 and GPT-NeoX, each saved with its tokenizer into a folder."""
    import torch
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertModel,
        GPT2Config,
        GPT2Model,
        GPTNeoXConfig,
        GPTNeoXModel,
    )

    from isotui.models.naming import bundled_minilm_dir

    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    out = {}
    bert = root / "bert"
    BertModel(
        BertConfig(
            vocab_size=30522,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=128,
        )
    ).save_pretrained(bert)
    AutoTokenizer.from_pretrained(str(bundled_minilm_dir())).save_pretrained(bert)
    out["bert"] = bert
    gpt2 = root / "gpt2"
    _bpe_tokenizer(gpt2)
    GPT2Model(GPT2Config(vocab_size=600, n_embd=32, n_layer=2, n_head=4, n_positions=128)).save_pretrained(
        gpt2
    )
    out["gpt2"] = gpt2
    neox = root / "gpt_neox"
    _bpe_tokenizer(neox)
    GPTNeoXModel(
        GPTNeoXConfig(
            vocab_size=600,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=128,
            rotary_pct=0.25,
        )
    ).save_pretrained(neox)
    out["gpt_neox"] = neox
    return out
