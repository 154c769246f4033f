"""Every command of README.md that needs no network runs, on small sizes, through the real CLI.

The fenced ``sh`` blocks are parsed (continuation lines joined, ``a | b`` alternatives split,
comments dropped); each command that needs no network runs in a subprocess with a temporary
cache and working folder, its sample count cut to a few, and must exit 0. Commands that cannot
run offline are listed as skipped with the reason.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every command of README through the CLI, in subprocesses

README = Path(__file__).resolve().parents[1] / "README.md"
SMALL = "6"
TINY_TRAINING = ["--steps", "2", "--save-every", "1", "--hidden", "32", "--layers", "1", "--heads", "2"]
TINY_TRAINING += ["--seq-len", "16", "--batch-size", "4", "--threads", "1"]
LOCAL_PREFIXES = ("runs/", "./", "/")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(\.\.\.)?$")


def readme_commands() -> list[list[str]]:
    """Each command of README's ``sh`` blocks as an argv, in README order."""
    text = README.read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            argv: list[str] = []
            for word in [*words, "|"]:
                if word == "|":
                    if argv:
                        out.append(argv)
                    argv = []
                else:
                    argv.append(word)
    return out


def _values(argv: list[str], *flags: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in flags]


def _hub(model: str) -> bool:
    """A name that only the hub can resolve (not bundled, random:TYPE, or a local folder)."""
    if model == "minilm" or model.startswith(LOCAL_PREFIXES):
        return False
    if model.startswith("random:"):
        return "/" in model.split(":")[1]
    return True


def skip_reason(argv: list[str]) -> str | None:
    """Why a README command cannot run in an offline test, or None when it can."""
    if argv[0] != "isotui":
        return f"`{argv[0]}` installs software: needs a package index"
    if any(PLACEHOLDER.match(a) for a in argv) or any(a.startswith("my_") for a in argv):
        return "a placeholder for the reader to fill in"
    if any(d.startswith("hf:") for d in _values(argv, "--data")):
        return "hf: data comes from the Hugging Face hub"
    models = _values(argv, "-m", "--model") + [
        c for v in _values(argv, "-c", "--checkpoints") for c in v.split(",") if not c.startswith("step")
    ]
    if any(_hub(m) for m in models):
        return "a model from the Hugging Face hub"
    if argv[1:3] == ["experiment", "drift-block"] and not models:
        return "drift-block's default model is BERT-base from the hub"
    if argv[1] == "run" and len(argv) > 2 and not argv[2].startswith("-"):
        from isotui.config import load_run_config
        from isotui.presets import find_preset

        preset = find_preset(argv[2])
        if preset and any(_hub(m) for m in load_run_config(preset).get("models", [])):
            return f"preset {argv[2]} runs models from the Hugging Face hub"
    return None


def small(argv: list[str]) -> list[str]:
    """The command on small sizes: a few samples, a few training steps."""
    argv = list(argv)
    if argv[1] == "train-tiny":
        return argv + TINY_TRAINING
    # a checkpoint README names (runs/tiny/step_000400): the small training's last one
    last = f"step_{int(TINY_TRAINING[TINY_TRAINING.index('--steps') + 1]):06d}"
    argv = [re.sub(r"(runs/tiny/)step_\d{6}$", rf"\g<1>{last}", a) for a in argv]
    if argv[1] in ("run", "experiment", "figure") and argv[1:3] != ["figure", "--list"]:
        if "--max-samples" in argv:
            argv[argv.index("--max-samples") + 1] = SMALL
        else:
            argv += ["--max-samples", SMALL]
    return argv


def _cases():
    commands = readme_commands()
    # checkpoint series need train-tiny's folder: make it first
    commands.sort(key=lambda a: a[1] != "train-tiny" if len(a) > 1 else True)
    for argv in commands:
        reason = skip_reason(argv)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        yield pytest.param(argv, id=" ".join(argv)[:80], marks=marks)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


def test_readme_has_offline_commands():
    runnable = [a for a in readme_commands() if skip_reason(a) is None]
    assert len(runnable) >= 8


@pytest.mark.parametrize("argv", list(_cases()))
def test_readme_command_runs(argv, workdir):
    env = {**os.environ, "ISOTUI_CACHE_DIR": str(workdir / "cache"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "isotui", *small(argv)[1:]],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{shlex.join(small(argv))}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_run_installs_only_what_running_needs(tmp_path):
    """`make run` installs isotui alone (no test extras); `make test` still adds them, as CI on a
    clean clone needs; TORCH_INDEX puts the CPU torch wheel first."""
    root = README.parent

    def plan(*args: str) -> str:
        proc = subprocess.run(
            ["make", "-n", "-C", str(root), *args, f"VENV={tmp_path / 'venv'}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    run = plan("run")
    assert "pip install -e .\n" in run and "[test]" not in run and "--index-url" not in run
    assert "pip install -e '.[test]'" in plan("test")
    oldest = plan("test-oldest", f"OLDEST={tmp_path / 'oldest'}")  # CI's second run: the declared floors
    assert "pip install -r ci/oldest.txt\n" in oldest and "-m pytest" in oldest
    cpu = plan("run", "TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    torch_line = cpu.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    assert torch_line < cpu.index("pip install -e .")
