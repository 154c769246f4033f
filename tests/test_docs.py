"""Every command of the documentation (README.md and the site's pages under docs/) that needs no
network runs, on small sizes, through the real CLI.

The fenced ``sh`` blocks are parsed (continuation lines joined, ``a | b`` alternatives split,
comments dropped). Each block is one test: its commands that need no network run one after the
other in one Python process (``isotui.cli.main``, the ``isotui`` command's entry point; one import
of torch per block, not per command) with a temporary cache and working folder, their sample
counts cut to a few, and each must exit 0. Commands that cannot run offline are listed as skipped
with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SMALL = "6"
TINY_TRAINING = ["--steps", "2", "--save-every", "1", "--hidden", "32", "--layers", "1", "--heads", "2"]
TINY_TRAINING += ["--seq-len", "16", "--batch-size", "4", "--threads", "1"]
LOCAL_PREFIXES = ("runs/", "./", "/")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(\.\.\.)?$")
SERIES = "runs/tiny"  # the checkpoint folder the docs' `isotui train-tiny --out runs/tiny` makes

# One process runs a block's commands: the exit code of each, and markers to find its output.
DRIVER = """
import json, sys, traceback
from isotui.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    for stream in (sys.stdout, sys.stderr):
        print("\\n=== isotui " + " ".join(argv), file=stream, flush=True)
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    codes.append(code)
print("\\nEXIT CODES " + json.dumps(codes), flush=True)
"""


def page_blocks(page: Path) -> list[list[list[str]]]:
    """The commands of each ``sh`` block of one page, as argvs, in the page's order."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M):
        commands = []
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            argv: list[str] = []
            for word in [*words, "|"]:
                if word == "|":
                    if argv:
                        commands.append(argv)
                    argv = []
                else:
                    argv.append(word)
        blocks.append(commands)
    return blocks


def doc_commands() -> list[list[str]]:
    return [argv for page in PAGES for block in page_blocks(page) for argv in block]


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
    """Why a documented command cannot run in an offline test, or None when it can."""
    if argv[0] in ("make", "pip"):
        return f"`{argv[0]}` installs software: needs a package index"
    if argv[0] != "isotui":
        return f"`{argv[0]}` is not isotui (the docs' build runs in `make test`)"
    if len(argv) == 1 or argv[1] == "serve":
        return "opens the terminal app, which waits for keys (tests/test_app*.py drive it)"
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
    # a checkpoint the docs name (runs/tiny/step_000400, runs/tiny-gpt2/step_000060): the small
    # training's last one
    last = f"step_{int(TINY_TRAINING[TINY_TRAINING.index('--steps') + 1]):06d}"
    argv = [re.sub(r"(runs/tiny[\w-]*/)step_\d{6}$", rf"\g<1>{last}", a) for a in argv]
    if argv[1] in ("run", "experiment", "figure") and argv[1:3] != ["figure", "--list"]:
        if "--max-samples" in argv:
            argv[argv.index("--max-samples") + 1] = SMALL
        else:
            argv += ["--max-samples", SMALL]
    return argv


def _trains(argv: list[str]) -> bool:
    return argv[1] == "train-tiny"


def _cases():
    ran: dict[tuple[str, ...], str] = {}  # a command the docs repeat runs once, in its first block
    for page in PAGES:
        for i, block in enumerate(page_blocks(page)):
            name = f"{page.relative_to(ROOT)}:{i + 1}"
            runnable = [argv for argv in block if skip_reason(argv) is None and tuple(argv) not in ran]
            for argv in block:
                if argv not in runnable:
                    # listed as skipped, each with its reason
                    reason = skip_reason(argv) or f"the same command runs in {ran[tuple(argv)]}"
                    yield pytest.param(
                        name,
                        [argv],
                        id=f"{name} {shlex.join(argv)}"[:90],
                        marks=pytest.mark.skip(reason=reason),
                    )
            ran.update({tuple(argv): name for argv in runnable})
            if runnable:
                # a block that trains makes its series first, as a reader running it would need
                runnable.sort(key=lambda a: not _trains(a))
                yield pytest.param(name, runnable, id=name, marks=pytest.mark.slow)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the blocks this worker runs: a later block may answer from it (only faster)."""
    return tmp_path_factory.mktemp("docs-cache")


@pytest.fixture(scope="module")
def series(tmp_path_factory, cache):
    """The checkpoint series the docs train with `isotui train-tiny --out runs/tiny`, made once."""
    root = tmp_path_factory.mktemp("docs-series")
    (train,) = {tuple(a) for a in doc_commands() if _trains(a) and SERIES in a}
    _run_block([small(list(train))], root, cache)
    return root / SERIES


def _run_block(commands: list[list[str]], cwd: Path, cache: Path) -> None:
    env = {**os.environ, "ISOTUI_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    argvs = [a[1:] for a in commands]
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(argvs)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    found = re.search(r"^EXIT CODES (.*)$", proc.stdout, re.M)
    ended = f"the block's process ended early ({proc.returncode})"
    assert found, f"{ended}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    codes = json.loads(found.group(1))
    outs = [re.split(r"^=== isotui .*$", s, flags=re.M)[1:] for s in (proc.stdout, proc.stderr)]
    failed = [
        f"{shlex.join(['isotui', *argv])} -> exit {code}\n{out[-1500:]}\n{err[-1500:]}"
        for argv, code, out, err in zip(argvs, codes, *outs, strict=True)
        if code != 0
    ]
    assert not failed, "\n\n".join(failed)


def test_docs_have_offline_commands():
    runnable = [a for a in doc_commands() if skip_reason(a) is None]
    assert len(runnable) >= 8
    # a block trains the series that other blocks read
    assert any(_trains(a) for a in runnable)
    assert any(SERIES in " ".join(a) for a in runnable if not _trains(a))


@pytest.mark.parametrize(("block", "commands"), list(_cases()))
def test_docs_commands_run(block, commands, cache, tmp_path, request):
    smalls = [small(a) for a in commands]
    if any(SERIES in a for argv in smalls for a in argv) and not any(_trains(a) for a in smalls):
        (tmp_path / "runs").symlink_to(request.getfixturevalue("series").parent)
    _run_block(smalls, tmp_path, cache)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_run_installs_only_what_running_needs(tmp_path):
    """`make run` installs isotui alone (no test extras); `make test` still adds them, as CI on a
    clean clone needs, and builds the docs strictly; TORCH_INDEX puts the CPU torch wheel first."""

    def plan(*args: str) -> str:
        proc = subprocess.run(
            ["make", "-n", "-C", str(ROOT), *args, f"VENV={tmp_path / 'venv'}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    run = plan("run")
    assert "pip install -e .\n" in run and "[test]" not in run and "--index-url" not in run
    test = plan("test")
    assert "pip install -e '.[test]'" in test
    assert "mkdocs build --strict" in test and "mkdocs build --strict" in plan("docs")
    oldest = plan("test-oldest", f"OLDEST={tmp_path / 'oldest'}")  # CI's second run: the declared floors
    assert "pip install -r ci/oldest.txt\n" in oldest and "-m pytest" in oldest
    cpu = plan("run", "TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    torch_line = cpu.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    assert torch_line < cpu.index("pip install -e .")


def _all_pages() -> str:
    return "\n".join(page.read_text(encoding="utf-8") for page in PAGES)


def test_every_command_and_experiment_of_the_help_is_documented():
    """`isotui --help` names no command, and `isotui experiment` no experiment, that the docs lack."""
    import argparse

    from isotui.cli import build_parser
    from isotui.experiments.registry import EXPERIMENTS

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    text = _all_pages()
    assert len(sub.choices) >= 9 and len(EXPERIMENTS) >= 6
    missing = [f"isotui {name}" for name in sub.choices if f"isotui {name}" not in text]
    missing += [
        f"isotui experiment {n}"
        for n, e in EXPERIMENTS.items()  # on a page, or (a contributor's) in its module's docstring
        if f"isotui experiment {n}" not in text + (sys.modules[e.request_type.__module__].__doc__ or "")
    ]
    assert not missing, f"not in the docs: {missing}"


def _key_ids(table_header: str) -> set[str]:
    """The ids column of the key table that follows ``table_header`` on the app's page."""
    text = (ROOT / "docs" / "app.md").read_text(encoding="utf-8")
    start = text.index("| key | id |", text.index(table_header))
    rows = text[start:].split("\n\n")[0].splitlines()[2:]
    return {i for row in rows for i in re.findall(r"`(\w+)`", row.strip("|").split("|")[1])}


def test_the_apps_key_tables_are_its_bindings():
    """docs/app.md's key tables list the ids the app's help screen and `[keys]` settings use."""
    from isotui.tui.app import IsotuiApp
    from isotui.tui.lab import lab_keys
    from isotui.tui.lab_tabs import lab_tabs

    app_ids = {b.id for b in IsotuiApp.BINDINGS if b.id}
    assert _key_ids("## Keys\n") == app_ids
    lab_ids = {b.id for b in lab_keys(lab_tabs()) if b.id}  # the lab's keys, composed from its tabs
    documented = _key_ids("### In the attention lab\n")
    # the tabs' row names its first and last id (`lab_heads` … `lab_ckpt`)
    assert documented <= lab_ids and len(documented) >= len(lab_ids) - 2
