"""``isotui serve``: the app in a browser, through ``textual-serve``.

Each browser tab that opens the page starts its own ``isotui`` process (the app, with Textual's
web driver) on this machine; exports and screenshots then go to that browser as downloads (see
``IsotuiApp.export_file``). The server listens on 127.0.0.1 by default: reach it from your own
machine through an SSH tunnel rather than opening a port to the network, since whoever opens the
page runs models and reads files as you.
"""

from __future__ import annotations

import errno
import ipaddress
import shlex
import socket
import sys
from typing import Any

from isotui.errors import IsotuiError

INSTALL = "isotui serve needs the textual-serve package: pip install 'isotui[serve]'"
LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def app_command(*, fresh: bool = False) -> str:
    """The shell command textual-serve runs for each browser: this Python's ``isotui``, in place
    of the shell (``exec``), so that the server's signals reach the app itself."""
    return "exec " + shlex.join([sys.executable, "-m", "isotui", *(["--fresh"] if fresh else [])])


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def page_url(host: str, port: int) -> str:
    """Where the browser finds the page (IPv6 literals in brackets; all interfaces: this host)."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def check_address(host: str, port: int) -> None:
    """Refuse, in the flags' terms, an address the server could not listen on, before
    textual-serve starts (its own failure is a traceback after its banner)."""
    if not 1 <= port <= 65535:
        raise IsotuiError(f"--port must be between 1 and 65535 (got {port})")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        raise IsotuiError(f"--host {host}: not a name or address of this machine") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp listens
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise IsotuiError(
                    f"--port {port} is already in use on {host} (another isotui serve?): pick another"
                ) from None
            if exc.errno == errno.EACCES:
                raise IsotuiError(f"--port {port} needs root on {host}: use a port above 1023") from None
            raise IsotuiError(f"--host {host}: cannot listen there ({exc.strerror or exc})") from None


def serve(host: str, port: int, *, public_url: str | None = None, fresh: bool = False, err: Any) -> int:
    """Serve the app until Ctrl+C; 0 when stopped, :class:`IsotuiError` for a bad flag."""
    try:
        import textual_serve.server  # noqa: F401  (the extra itself: serve_service may be loaded already)

        from isotui.tui.serve_service import AppServer
    except ImportError:
        raise IsotuiError(INSTALL) from None
    check_address(host, port)
    if not is_loopback(host):
        err.print(
            f"isotui serve: listening on {host}: anyone who can reach port {port} runs isotui as you "
            "(models, files); the default 127.0.0.1 with an SSH tunnel keeps it to you",
            highlight=False,
        )
    url = public_url or page_url(host, port)
    server = AppServer(app_command(fresh=fresh), host=host, port=port, title="isotui", public_url=url)
    try:
        server.serve()
    except OSError as exc:  # lost the port between the check and the bind
        raise IsotuiError(f"--port {port} on {host}: {exc.strerror or exc}") from None
    return 0
