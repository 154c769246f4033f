"""`isotui serve` (the app in a browser), exports delivered to that browser, the theme a terminal
without truecolor starts with, and the GPU header from NVML (with nvidia-smi as fallback)."""

from __future__ import annotations

import asyncio
import csv
import io
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from textual import events

from isotui.cli import main
from isotui.tui.app import EXPORT_DELIVERY, IsotuiApp
from isotui.tui.themes import starting_theme
from tests.test_snapshots import fixture_result

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SCREEN_PARTS = ("isotui — ", " · cache /", "filter, or type a model")  # the header, the models pane


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- isotui serve ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_serve_answers_with_the_app_page_and_runs_the_app_for_a_browser(tmp_path):
    """The server on 127.0.0.1: its page names isotui and points the browser's websocket back at
    the same address; a websocket client (what the page's script does) gets the app's first
    screen (its header and models pane), drawn by the isotui process the server started."""
    aiohttp = pytest.importorskip("aiohttp")
    pytest.importorskip("textual_serve")
    port = _free_port()
    log = tmp_path / "server.log"  # a file, not a pipe: a full pipe would stall the server
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "isotui", "serve", "--port", str(port)],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        page = None
        for _ in range(600):  # until the server listens (or has died)
            assert server.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as answer:
                    page = answer.read().decode()
                break
            except OSError:
                time.sleep(0.1)
        assert page is not None, "the server never answered"
        assert "<div>isotui</div>" in page
        assert f'data-session-websocket-url="ws://127.0.0.1:{port}/ws"' in page

        async def first_screen() -> str:
            async with (
                aiohttp.ClientSession() as session,
                session.ws_connect(f"http://127.0.0.1:{port}/ws?width=120&height=36") as ws,
            ):
                text = ""
                while not all(part in ANSI.sub("", text) for part in SCREEN_PARTS):
                    message = await ws.receive()
                    assert message.type == aiohttp.WSMsgType.BINARY, message
                    text += message.data.decode("utf-8", "replace")
                return ANSI.sub("", text)

        screen = asyncio.run(asyncio.wait_for(first_screen(), 300))  # a bound, not a timing check
        assert all(part in screen for part in SCREEN_PARTS)
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl+C: textual-serve's graceful exit
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert server.returncode == 0


def test_serve_without_textual_serve_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "textual_serve", None)
    monkeypatch.setitem(sys.modules, "textual_serve.server", None)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'isotui[serve]'" in err and "Traceback" not in err


def test_serve_refuses_a_port_in_use_and_a_bad_port_in_flag_terms(capsys):
    pytest.importorskip("textual_serve")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"--port {port} is already in use on 127.0.0.1" in capsys.readouterr().err
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port must be between 1 and 65535 (got 70000)" in capsys.readouterr().err


# -- exports reach the browser when served ---------------------------------------------------------


class _Delivered:
    """What the app handed Textual's delivery API (the web driver would stream it to the browser)."""

    def __init__(self) -> None:
        self.files: list[tuple[str, bytes, str | None]] = []

    def __call__(self, path_or_file, *, save_filename=None, name=None, **_kw) -> str:
        self.files.append((save_filename, path_or_file.read(), name))
        return "key"


def _export_app(tmp_path: Path) -> IsotuiApp:
    return IsotuiApp(cache_root=tmp_path / "cache", export_dir=tmp_path / "exports", device_probe=lambda: "t")


def test_served_app_delivers_exports_and_screenshots_instead_of_writing_on_the_server(tmp_path, monkeypatch):
    """Made to think it is in a browser (`is_web`), the app sends the CSV and the screenshot
    through `deliver_binary` and writes nothing in its export folder; the CSV sent is the one a
    terminal session writes to disk for the same results."""
    results = [fixture_result("minilm", 7, 384, 0.22), fixture_result("random:gpt2", 13, 768, 0.6)]

    async def scenario(web: bool) -> tuple[_Delivered, list[str]]:
        monkeypatch.setattr(IsotuiApp, "is_web", property(lambda self: web))
        app = _export_app(tmp_path / ("web" if web else "tty"))
        delivered = _Delivered()
        app.deliver_binary = delivered  # type: ignore[method-assign]
        notes: list[str] = []
        app.notify = lambda message, **_kw: notes.append(message)  # type: ignore[method-assign]
        async with app.run_test(size=(120, 36)) as pilot:
            for result in results:
                app.add_result(result)
            await pilot.press("e", "S")
            await pilot.pause()
            failed = OSError("connection closed")  # the browser went away mid-download
            app.post_message(events.DeliveryFailed("key", failed, name=EXPORT_DELIVERY))
            await pilot.pause()
        return delivered, notes

    delivered, notes = asyncio.run(scenario(web=True))
    assert not (tmp_path / "web" / "exports").exists()  # nothing on the server's disk
    (csv_name, csv_bytes, csv_tag), (svg_name, svg_bytes, _) = delivered.files
    assert re.fullmatch(r"isotui-\d{8}-\d{6}-comparison\.csv", csv_name) and csv_tag == EXPORT_DELIVERY
    rows = list(csv.DictReader(io.StringIO(csv_bytes.decode())))
    assert [r["model"] for r in rows] == ["minilm"] * 7 + ["random:gpt2"] * 13
    assert [float(r["avg_cos"]) for r in rows] == [row.avg_cos for res in results for row in res.rows]
    assert svg_name.endswith(".svg") and svg_bytes.lstrip().startswith(b"<svg")
    assert f"sent {csv_name} to your browser (2 models)" in notes
    assert f"sent {svg_name} to your browser" in notes
    assert "the export did not reach the browser: connection closed" in notes

    delivered, notes = asyncio.run(scenario(web=False))
    assert delivered.files == []
    (on_disk,) = (tmp_path / "tty" / "exports").glob("*.csv")
    assert on_disk.read_bytes() == csv_bytes
    assert len(list((tmp_path / "tty" / "exports").glob("*.svg"))) == 1
    assert f"wrote {on_disk} (2 models)" in notes


def test_lab_export_is_delivered_when_served(tmp_path, monkeypatch):
    """The attention lab's CSV goes the same way (the app's export_file)."""
    from isotui.tui.lab import LabScreen

    monkeypatch.setattr(IsotuiApp, "is_web", property(lambda self: True))

    class Result:
        def __init__(self) -> None:
            self.rows = [{"layer": 0, "value": 0.5}, {"layer": 1, "value": 0.25}]

    async def scenario() -> _Delivered:
        app = _export_app(tmp_path)
        delivered = _Delivered()
        app.deliver_binary = delivered  # type: ignore[method-assign]
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.press("A")
            await pilot.pause()
            lab = app.screen
            assert isinstance(lab, LabScreen)
            monkeypatch.setattr(type(lab.active_tab()), "result", lambda self: Result())
            lab.action_export()  # (the key: the tab's settings box may have the cursor)
            await pilot.pause()
        return delivered

    ((name, data, tag),) = asyncio.run(scenario()).files
    assert name.endswith(".csv") and tag == EXPORT_DELIVERY
    assert list(csv.DictReader(io.StringIO(data.decode()))) == [
        {"layer": "0", "value": "0.5"},
        {"layer": "1", "value": "0.25"},
    ]
    assert not list(tmp_path.glob("**/*.csv"))


# -- the theme over SSH ----------------------------------------------------------------------------


async def _theme(tmp_path: Path) -> str:
    app = _export_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        return app.theme


@pytest.mark.parametrize(
    ("colorterm", "expected"),
    [(None, "isotui-256"), ("", "isotui-256"), ("truecolor", "isotui-dark"), ("24bit", "isotui-dark")],
)
def test_app_starts_with_the_256_colour_theme_unless_truecolor_is_announced(
    tmp_path, monkeypatch, colorterm, expected
):
    monkeypatch.delenv("TEXTUAL_COLOR_SYSTEM", raising=False)
    if colorterm is None:
        monkeypatch.delenv("COLORTERM", raising=False)  # what an SSH session without SendEnv has
    else:
        monkeypatch.setenv("COLORTERM", colorterm)
    assert asyncio.run(_theme(tmp_path)) == expected


def test_theme_setting_wins_and_a_browser_is_truecolor(tmp_path, monkeypatch):
    monkeypatch.delenv("COLORTERM", raising=False)
    monkeypatch.delenv("TEXTUAL_COLOR_SYSTEM", raising=False)
    settings = tmp_path / "config.toml"
    settings.write_text('theme = "isotui-light"\n')
    monkeypatch.setenv("ISOTUI_CONFIG", str(settings))
    assert asyncio.run(_theme(tmp_path)) == "isotui-light"
    monkeypatch.delenv("ISOTUI_CONFIG")
    monkeypatch.setattr(IsotuiApp, "is_web", property(lambda self: True))
    assert asyncio.run(_theme(tmp_path)) == "isotui-dark"
    # textual-serve announces truecolor to the app it starts through Textual's own variable
    assert starting_theme(None, {"TEXTUAL_COLOR_SYSTEM": "truecolor"}) == "isotui-dark"
    assert starting_theme(None, {"COLORTERM": "TrueColor"}) == "isotui-dark"
    assert starting_theme("isotui-high-contrast", {}) == "isotui-high-contrast"
