"""The suite's own set-up (issue 25): the markers are registered and strict, a `gpu` test is
skipped where torch sees no CUDA GPU, and `make test` runs the suite under pytest-xdist."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from . import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_slow_and_gpu_are_registered_and_unknown_markers_are_errors(pytestconfig):
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert {"slow", "gpu"} <= registered
    assert "--strict-markers" in pytestconfig.getini("addopts")


class _Item:
    """What the collection hook reads of a test item: its markers."""

    def __init__(self, *marks: str) -> None:
        self.marks = list(marks)
        self.added: list[pytest.MarkDecorator] = []

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None

    def add_marker(self, mark: pytest.MarkDecorator) -> None:
        self.added.append(mark)


@pytest.mark.parametrize("cuda", [False, True])
def test_a_gpu_test_is_skipped_only_where_torch_sees_no_gpu(monkeypatch, cuda):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    gpu, cpu, slow = _Item("gpu"), _Item(), _Item("slow")
    conftest.pytest_collection_modifyitems(None, [gpu, cpu, slow])
    assert cpu.added == [] and slow.added == []
    if cuda:
        assert gpu.added == []
    else:
        (skip,) = gpu.added
        assert skip.name == "skip" and "CUDA" in skip.kwargs["reason"]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_test_and_the_oldest_set_run_under_xdist_and_test_fast_leaves_out_slow(tmp_path):
    def plan(*args: str) -> list[str]:
        proc = subprocess.run(
            [
                "make",
                "-n",
                "-C",
                str(ROOT),
                *args,
                f"VENV={tmp_path / 'venv'}",
                f"OLDEST={tmp_path / 'old'}",
                f"NEWEST={tmp_path / 'new'}",
                "NEWEST_PYTHON=python3",  # make -n still checks the interpreter exists
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return [line for line in proc.stdout.splitlines() if "-m pytest" in line]

    for target in ("test", "test-oldest", "test-fast", "test-newest"):
        (line,) = plan(target)
        assert " -n 2 --dist loadfile" in line, line
        assert ('-m "not slow"' in line) == (target in ("test-fast", "test-newest")), line
    (line,) = plan("test", "WORKERS=auto")
    assert " -n auto " in line


def test_hugging_face_caches_are_this_test_processs_own_not_the_users():
    """Each pytest process (each xdist worker) has its own datasets cache (a fresh temporary
    folder): a test's dataset lands neither in ~/.cache/huggingface nor in another worker's."""
    datasets = pytest.importorskip("datasets")
    folder = Path(os.environ["HF_HOME"])
    assert folder.is_dir() and not folder.is_relative_to(Path.home())
    assert Path(datasets.config.HF_DATASETS_CACHE) == folder / "datasets"


def test_a_child_of_a_test_takes_ctrl_c_even_when_the_suite_was_started_ignoring_it():
    """The tests that send SIGINT to a process they started need it to arrive, however pytest
    was started (a shell's background job ignores SIGINT, and children inherit an ignored one)."""
    probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_a_first_install_without_a_gpu_says_how_to_take_the_cpu_torch(tmp_path):
    """Issue 38 item 7: `make run` on a machine with no nvidia-smi and no TORCH_INDEX says, before
    pip downloads PyPI's CUDA torch, how to take the CPU wheel; not with TORCH_INDEX, and not once
    the venv has a torch (the machine's python here: it has one)."""
    import venv

    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # no torch in it
    path = os.pathsep.join(
        p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()
    )

    def note(*args: str) -> str:
        proc = subprocess.run(
            ["make", "-s", "-C", str(ROOT), "torch-note", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PATH": path},
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    said = note(f"VENV={bare}")
    assert "no NVIDIA GPU here" in said and "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in said
    assert note(f"VENV={bare}", "TORCH_INDEX=https://download.pytorch.org/whl/cpu") == ""
    assert note(f"VENV={Path(sys.executable).parent.parent}") == ""
