"""The fault catalogue, round 3 (issue 30): limits on every size, files the process cannot read,
the Python API's errors, and app processes that must end.

Read it as a table: each case is one input, the sentence the user must see (a distinctive part of
it), the exit code, and what must hold afterwards. The CLI cases run the real ``isotui`` in a
subprocess. Exit codes: 0 ok, 1 internal error, 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

import isotui
from isotui.store.cache import ResultCache

TINY = "random:bert:hidden_size=32,num_hidden_layers=1,num_attention_heads=4,intermediate_size=64"
SMALL = ("--max-samples", "20", "-q")


def cli(*args: str, cwd: Path, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "isotui", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=timeout,
        **kw,
    )


def one_sentence(proc: subprocess.CompletedProcess, part: str, code: int = 2) -> str:
    """Exit ``code`` with ``part`` in one 'isotui: error:' line, no traceback, no internal error."""
    err = proc.stderr
    assert "Traceback" not in err and "internal error" not in err, err
    assert proc.returncode == code, (proc.returncode, err)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert part in " ".join(err.split()), err
    return err


def cached_runs(root: Path) -> int:
    return len(ResultCache(root).entries())


# --- 1. --threads has a ceiling (was: 100,000 threads filled the pid table, then SIGSEGV) --------


def test_threads_ceiling_is_four_per_cpu():
    from isotui.extract.threads import max_threads

    assert max_threads() == 4 * (os.cpu_count() or 1)


def too_many() -> int:
    return 4 * (os.cpu_count() or 1) + 1


def a_config(tmp: Path) -> None:
    (tmp / "job.toml").write_text(f'model = "{TINY}"\nthreads = {too_many()}\n')


# One past the ceiling, not 100,000: run against a build without the ceiling, these cases must
# fail without starting 100,000 threads on the machine (that starved every process on it).
THREADS = [  # (args, the sentence's part, a setup)
    pytest.param(("run", "-m", TINY, "--threads", "{too_many}", *SMALL), "threads", None, id="run-flag"),
    pytest.param(
        ("experiment", "attention", "-m", TINY, "--threads", "{too_many}", *SMALL),
        "threads",
        None,
        id="attention",
    ),
    pytest.param(("run", "job.toml", "-q"), "config file job.toml: threads", a_config, id="config-key"),
    pytest.param(
        ("train-tiny", "--out", "run", "--threads", "{too_many}", "-q"),
        "--threads",
        None,
        id="train-tiny",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "said", "setup"), THREADS)
def test_threads_beyond_the_ceiling_are_one_sentence_before_any_work(tmp_path, args, said, setup):
    if setup is not None:
        setup(tmp_path)
    proc = cli(*(a.replace("{too_many}", str(too_many())) for a in args), cwd=tmp_path)
    err = one_sentence(proc, said)
    assert "is more than this machine can use: at most" in err and "per logical CPU" in err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()  # nothing started


def test_threads_keyword_of_the_api_is_checked_too():
    with pytest.raises(isotui.IsotuiError, match="is more than this machine can use"):
        isotui.run(TINY, threads=too_many())
    from isotui.spec import make_spec

    with pytest.raises(isotui.IsotuiError, match="at most"):
        make_spec(TINY, threads=too_many())
    assert make_spec(TINY, threads=too_many() - 1).threads == too_many() - 1  # the ceiling itself runs


# --- 2. model files the process cannot read (was: internal PermissionError, exit 1) ---------------

PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


def _without_root_reading() -> None:
    """In the child, before exec: drop the capabilities that let root read any file, so that
    mode 000 means unreadable for it too (the OS refuses the open, as for any other user)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def as_a_user(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI as a process that honours file modes: itself when not root, else root without
    the file-reading capabilities (skipped where they cannot be dropped)."""
    if os.geteuid() != 0:
        return cli(*args, cwd=cwd)
    probe = subprocess.run(["true"], preexec_fn=_without_root_reading, capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here; as root, mode 000 stays readable")
    return cli(*args, cwd=cwd, preexec_fn=_without_root_reading)


@pytest.fixture(scope="module")
def model_folder(tiny_models, tmp_path_factory) -> Path:
    import shutil

    folder = tmp_path_factory.mktemp("perm") / "m"
    shutil.copytree(tiny_models["bert"], folder)
    return folder


UNREADABLE = ["model.safetensors", "config.json", "tokenizer.json", "."]


@pytest.mark.slow
@pytest.mark.parametrize("name", UNREADABLE, ids=["weights", "config", "tokenizer", "the folder"])
def test_an_unreadable_model_file_is_one_sentence_naming_it(model_folder, tmp_path, name):
    path = model_folder / name
    before = path.stat().st_mode
    path.chmod(0)
    try:
        proc = as_a_user("run", "-m", str(model_folder), *SMALL, cwd=tmp_path)
    finally:
        path.chmod(before)
    shown = model_folder / "config.json" if name == "." else path.resolve()
    err = one_sentence(proc, f"cannot read the model file {shown} (Permission denied)")
    assert f"check that you may read every file in {model_folder}" in " ".join(err.split())
    assert cached_runs(tmp_path / "cache") == 0


# --- 3. a figure's pixel size (was: --dpi 100000, an internal MemoryError) -----------------------


def largest_dpi(width_in: float, height_in: float, pixels: int) -> int:
    """The largest dpi whose PNG has at most ``pixels`` pixels, by counting up (no formula)."""
    dpi = 1
    while math.ceil(width_in * (dpi + 1)) * math.ceil(height_in * (dpi + 1)) <= pixels:
        dpi += 1
    return dpi


@pytest.mark.slow
@pytest.mark.parametrize("width,inches", [("single", (3.3, 2.4)), ("double", (6.9, 2.6))])
def test_a_png_beyond_the_pixel_limit_says_the_largest_dpi(tmp_path, width, inches):
    from isotui.paper_figures import MAX_PIXELS, check_pixels

    assert MAX_PIXELS == 2**28
    best = largest_dpi(*inches, MAX_PIXELS)
    proc = cli(
        "figure", "godey2024-fig17", "--out", "f.png", "--dpi", "100000", "--width", width, cwd=tmp_path
    )
    one_sentence(proc, f"the largest --dpi that fits this {inches[0]} x {inches[1]} in figure is {best:,}")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no figure, CSV or JSON
    check_pixels(*inches, best, "png")  # the dpi said is drawn
    with pytest.raises(isotui.IsotuiError, match="more than isotui draws"):
        check_pixels(*inches, best + 1, "png")


@pytest.mark.slow
def test_a_vector_figure_is_not_sized_by_dpi(tmp_path):
    proc = cli("figure", "godey2024-fig17", "--out", "f.pdf", "--dpi", "100000", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "f.pdf").read_bytes().startswith(b"%PDF")


# --- 4. isotui serve: an app whose browser left must end (was: blocked for good, SIGTERM ignored) --

FAKE_APP = textwrap.dedent(
    """
    import os, signal, sys
    if sys.argv[1] == "deaf":  # reads no quit, and with "stubborn" ignores SIGTERM too
        if sys.argv[2] == "stubborn":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        out = sys.stdout.buffer
        out.write(b"__GANGLION__\\n"); out.flush()
        open(sys.argv[3], "w").close()  # past its prelude, SIGTERM ignored if it is to be
        signal.pause()
    out = sys.stdout.buffer
    out.write(b"__GANGLION__\\n"); out.flush()
    chunk = b"x" * 60000
    for _ in range(20):  # 1.2 MB of screen: far more than a pipe holds
        out.write(b"D" + len(chunk).to_bytes(4, "big") + chunk); out.flush()
    seen = b""
    while b"quit" not in seen:  # what a Textual app does: end on the server's quit
        more = os.read(0, 1024)
        if not more:
            sys.exit(3)
        seen += more
    """
)


def serve_app(*how: str):
    """A served app process (textual-serve's protocol) whose browser has gone: every write to it
    raises, as aiohttp's writes to a closed websocket do."""
    pytest.importorskip("textual_serve")
    from textual_serve.download_manager import DownloadManager

    from isotui.tui.serve_service import AppProcess

    async def gone(_data) -> None:
        raise ConnectionResetError("Cannot write to closing transport")

    async def closed() -> None:
        return None

    command = shlex.join(["exec", sys.executable, "-c", FAKE_APP, *(how or ("writer", ""))])
    return AppProcess(
        command, write_bytes=gone, write_str=gone, close=closed, download_manager=DownloadManager()
    )


def test_an_app_whose_browser_left_has_its_output_read_and_ends():
    """The app writes a screen bigger than a pipe after its browser left; the server keeps reading
    (and dropping) it, so the app reads the quit and ends by itself."""

    async def scenario() -> int:
        service = serve_app()
        await service.start(80, 24)
        process = service._process
        try:
            await asyncio.wait_for(service.stop(), 120)  # bounds, not timing checks
            return await asyncio.wait_for(process.wait(), 120)
        finally:
            if process.returncode is None:
                process.kill()

    assert asyncio.run(scenario()) == 0


@pytest.mark.parametrize(("how", "ended_by"), [("polite", signal.SIGTERM), ("stubborn", signal.SIGKILL)])
def test_an_app_that_does_not_quit_gets_sigterm_then_sigkill(monkeypatch, tmp_path, how, ended_by):
    from isotui.tui import serve_service

    monkeypatch.setattr(serve_service, "GRACE_S", 0.5)
    monkeypatch.setattr(serve_service, "TERM_S", 0.5)

    async def scenario() -> int | None:
        ready = tmp_path / "ready"
        service = serve_app("deaf", how, str(ready))
        await service.start(80, 24)
        # the app's own word that it is past its prelude (on a loaded machine a fixed wait may end
        # before a stubborn app ignores SIGTERM, and SIGTERM then ends it): a bound, not a timing check
        for _ in range(1200):
            if ready.exists():
                break
            await asyncio.sleep(0.1)
        assert ready.exists(), "the app never started"
        process = service._process
        try:
            await asyncio.wait_for(service.stop(), 120)  # a bound, not a timing check
            return process.returncode
        finally:
            if process.returncode is None:
                process.kill()

    assert asyncio.run(scenario()) == -ended_by


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_served_app_ends_when_the_browser_leaves_early_and_honours_sigterm(tmp_path):
    """The real server and app: a browser that leaves at its first bytes leaves no app process
    behind; an app whose browser stays ends on SIGTERM (it runs as the server's own child)."""
    aiohttp = pytest.importorskip("aiohttp")
    pytest.importorskip("textual_serve")
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "isotui", "serve", "--port", str(port)], cwd=tmp_path, stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            try:
                urllib.request.urlopen(url, timeout=5).close()
                break
            except OSError:
                time.sleep(0.1)

        async def leave_at_first_bytes() -> None:
            async with aiohttp.ClientSession() as session:
                ws = await session.ws_connect(f"{url}/ws?width=300&height=100")
                await ws.receive()
                ws._response.connection.transport.abort()  # gone, without a closing handshake

        asyncio.run(asyncio.wait_for(leave_at_first_bytes(), 300))
        for _ in range(1200):  # a bound (the app's startup on a loaded machine), not a timing check
            if not _children(server.pid):
                break
            time.sleep(0.1)
        assert _children(server.pid) == []

        async def terminated_while_shown() -> bool:
            async with aiohttp.ClientSession() as session:
                ws = await session.ws_connect(f"{url}/ws?width=100&height=30")
                await ws.receive()
                (app,) = _children(server.pid)  # the app itself, not a shell around it
                os.kill(app, signal.SIGTERM)
                while not ws.closed:
                    message = await ws.receive()
                    if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                        break
                for _ in range(600):
                    if not _children(server.pid):
                        return True
                    await asyncio.sleep(0.1)
                return False

        assert asyncio.run(asyncio.wait_for(terminated_while_shown(), 300))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    assert server.returncode == 0


# --- 5. sentences that said the wrong thing (issue 30 item 10) ----------------------------------


def jsonl_with_bom(tmp: Path) -> None:
    (tmp / "d.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "the first line"}\n{"text": "the second"}\n')


def config_with(value: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / "m").mkdir()
        body = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}
        (tmp / "m" / "config.json").write_text(json.dumps(body).replace("32", value, 1))

    return setup


def huge_line(tmp: Path) -> None:
    with (tmp / "a.txt").open("w") as f:
        f.write("a" * 30_000_000 + "\n")


MESSAGES = [  # (args, the sentence's part, what must not be said, a setup)
    pytest.param(
        ("run", "-m", "random:bert:hidden_size", *SMALL),
        "config override 'hidden_size' is not key=value; give its value, e.g. random:bert:hidden_size=64",
        "Should contain one of",  # was: transformers' ~400 model types
        None,
        id="override-without-value",
    ),
    pytest.param(
        ("run", "-m", "random:bert:num_hidden_layers=0", *SMALL),
        "has no layers (num_hidden_layers=0), so there are no hidden states to measure",
        "output_hidden_states",
        None,
        id="no-layers",
    ),
    pytest.param(
        ("run", "adir", "-q"),
        "config file adir is a folder; give a TOML file",
        "does not exist",
        lambda t: (t / "adir").mkdir(),
        id="config-is-a-folder",
    ),
    pytest.param(
        ("run", "-m", "./m", *SMALL),
        "Validation error for field 'hidden_size': TypeError: Field 'hidden_size' expected int",
        "\n",
        config_with('"big"'),
        id="config-value-of-a-wrong-type",
    ),
    pytest.param(
        ("run", "-m", TINY, "--data", "text:a.txt", "-q"),
        "tokens are the unknown token [UNK], though the tokenizer of model",
        "pass the tokenizer it was trained with",
        huge_line,
        id="a-30MB-line",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "said", "unsaid", "setup"), MESSAGES)
def test_a_sentence_that_says_what_is_wrong(tmp_path, args, said, unsaid, setup):
    if setup is not None:
        setup(tmp_path)
    err = one_sentence(cli(*args, cwd=tmp_path), said)
    assert unsaid not in err.rstrip("\n")
    assert cached_runs(tmp_path / "cache") == 0


@pytest.mark.slow
def test_a_jsonl_file_with_a_byte_order_mark_is_read(tmp_path):
    jsonl_with_bom(tmp_path)
    proc = cli("run", "-m", TINY, "--data", "jsonl:d.jsonl", "--json", "o.json", "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "o.json").read_text())["results"][0]["meta"]["n_samples"] == 2


@pytest.mark.slow
def test_weights_of_another_size_name_the_tensor(tiny_models, tmp_path):
    import shutil

    from safetensors import safe_open

    folder = tmp_path / "m"
    shutil.copytree(tiny_models["bert"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 2 * config["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        saved = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    err = one_sentence(cli("run", "-m", "./m", *SMALL, cwd=tmp_path), "its weights do not have the sizes")
    text = " ".join(err.split())
    name = text.split("config gives (weights and config of different models?): ")[1].split(" is ")[0]
    assert f"{name} is {saved[name]} in the weights but" in text and "For details look" not in text
    assert "intermediate" in name and "use the config.json saved with these weights" in text


@pytest.mark.slow
def test_a_refused_pickle_says_isotui_never_runs_one(tiny_models, tmp_path):
    import pickle
    import shutil

    class Bomb:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'RAN'}",))

    folder = tmp_path / "m"
    folder.mkdir()
    for f in tiny_models["bert"].iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Bomb()))
    err = one_sentence(
        cli("run", "-m", "./m", *SMALL, cwd=tmp_path), "isotui reads a pickle only as plain tensors"
    )
    assert "never runs one" in err and "weights_only" not in err and "arbitrary code" not in err
    assert not (tmp_path / "RAN").exists()


@pytest.mark.slow
def test_an_unreadable_cache_entry_says_why(tmp_path):
    assert cli("run", "-m", TINY, *SMALL, cwd=tmp_path).returncode == 0
    (entry,) = (tmp_path / "cache" / "runs").glob("*.safetensors")
    entry.chmod(0)
    proc = as_a_user("run", "-m", TINY, *SMALL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"cache entry {entry.name} is unreadable (Permission denied); recomputing" in proc.stderr
    assert "FileNotFoundError" not in proc.stderr
