"""``isotui serve``'s server: textual-serve's, with each browser's app process made to end.

textual-serve reads an app's output only while the browser is there: the first write to a
browser that has left raises, and its reader stops. The app then fills the pipe of its output and
blocks in that write, for good: it never reads the quit the server sends, and a SIGTERM, handled in
its (blocked) event loop, does nothing (issue 30: a browser that left while the app started left
an isotui process running for 19 minutes). Here the output of an app whose browser left is read
and dropped until the app ends, and an app that has not ended :data:`GRACE_S` seconds after the
quit gets SIGTERM, then SIGKILL. The app runs as the server's child itself (``exec``), not under
a shell that would keep the signals from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

from aiohttp import web
from textual_serve.app_service import AppService
from textual_serve.server import Server, to_int

log = logging.getLogger("textual-serve")

GRACE_S = 30.0  # after the quit: an app stopping a running job waits for it (bounded) first
TERM_S = 10.0  # after SIGTERM, before SIGKILL
BROWSER_GONE = (ConnectionError, RuntimeError)  # aiohttp's writes to a closed websocket


class AppProcess(AppService):
    """One browser's app process; its output is read to the end, and it is made to end."""

    async def on_data(self, payload: bytes) -> None:
        with contextlib.suppress(*BROWSER_GONE):  # the browser left: drop it, keep reading
            await super().on_data(payload)

    async def on_meta(self, data: bytes) -> None:
        with contextlib.suppress(*BROWSER_GONE):
            await super().on_meta(data)

    async def on_packed(self, payload: bytes) -> None:
        with contextlib.suppress(*BROWSER_GONE):
            await super().on_packed(payload)

    async def stop(self) -> None:
        """Ask the app to quit; SIGTERM after :data:`GRACE_S`, SIGKILL :data:`TERM_S` later;
        return once it has ended and its output is read."""
        task, process = self._task, self._process
        if task is None or process is None:
            return
        self._task = None
        await self._download_manager.cancel_app_downloads(app_service_id=self.app_service_id)
        await self.send_meta({"type": "quit"})
        await end_process(process, GRACE_S, TERM_S)
        with contextlib.suppress(Exception):
            self.stdin.close()
        await task


async def end_process(process: Any, grace: float, term: float) -> int | None:
    """Wait up to ``grace`` seconds for ``process`` (an asyncio subprocess) to end, then SIGTERM
    it and wait ``term`` seconds, then SIGKILL it; its exit code."""
    for sig, wait in ((None, grace), (signal.SIGTERM, term), (signal.SIGKILL, None)):
        if sig is not None and process.returncode is None:
            log.warning("isotui app %s did not quit: sending %s", process.pid, sig.name)
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)
        try:
            return int(await asyncio.wait_for(process.wait(), wait))
        except TimeoutError:  # asyncio.TimeoutError is this from 3.11 on
            continue
    return process.returncode


class AppServer(Server):
    """textual-serve's server, starting an :class:`AppProcess` for each browser."""

    async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
        """As textual-serve's own, with :class:`AppProcess` in place of its app service."""
        websocket = web.WebSocketResponse(heartbeat=15)
        width = to_int(request.query.get("width", "80"), 80)
        height = to_int(request.query.get("height", "24"), 24)
        service: AppProcess | None = None

        async def close() -> None:  # the app said it exits: close the browser's end
            await websocket.close()

        try:
            await websocket.prepare(request)
            service = AppProcess(
                self.command,
                write_bytes=websocket.send_bytes,
                write_str=websocket.send_str,
                close=close,
                download_manager=self.download_manager,
                debug=self.debug,
            )
            await service.start(width, height)
            await self._process_messages(websocket, service)
        except asyncio.CancelledError:
            await websocket.close()
        except Exception as error:
            log.exception(error)
        finally:
            if service is not None:
                await service.stop()
        return websocket
