"""Writing files the user names (exports) and files isotui owns (cache entries, weights).

One place decides how: a regular file is replaced atomically (a temporary file beside it, then
a rename), keeping an existing file's mode and giving a new one the umask's; a symlink is
followed, so its target is replaced and the link stays; a terminal, ``/dev/null``, a FIFO or
``-`` (stdout) is written through, never replaced; anything else is refused in one sentence.
Temporary files a killed writer left behind are removed by the next write once an hour old.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from isotui.errors import IsotuiError

STALE_SECONDS = 3600  # a temporary file this old has no writer left: a kill during a write
_STREAMS = {"-": 1, "/dev/stdout": 1, "/dev/stderr": 2}
_FD_PATH = re.compile(r"^/(?:dev/fd|proc/self/fd)/(\d+)$")
_KINDS = (
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def new_file_mode() -> int:
    """The mode a new file gets from the process umask (0644 under the usual 022)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: read it by setting it, and put it back at once
    os.umask(mask)
    return 0o666 & ~mask


def temp_pattern(name: str) -> re.Pattern[str]:
    """The names :func:`make_temp` gives for ``name`` (``name`` may be a regular expression)."""
    return re.compile(rf"^\.{name}\.[A-Za-z0-9_]{{8}}\.tmp$")


def make_temp(folder: Path, name: str, mode: int | None = None) -> tuple[int, str]:
    """A private temporary file for ``name`` in ``folder`` (same file system, so the rename is
    atomic), with ``mode`` (default: the umask's) instead of mkstemp's 0600."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    with contextlib.suppress(OSError):  # a file system without modes (e.g. vfat): nothing to keep
        os.fchmod(fd, new_file_mode() if mode is None else mode)
    return fd, tmp


def clean_stale_temps(folder: Path, pattern: re.Pattern[str], max_age: float = STALE_SECONDS) -> int:
    """Remove temporary files matching ``pattern`` older than ``max_age`` seconds; how many.

    Younger ones may belong to a writer still at work, so they stay; failures are ignored (the
    next write tries again)."""
    removed = 0
    now = time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        if not pattern.match(name):
            continue
        path = Path(folder) / name
        try:
            st = path.lstat()
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime > max_age:
                path.unlink()
                removed += 1
        except OSError:
            continue
    return removed


class OutputRefused(IsotuiError):
    """A path an output cannot be written to, in one sentence; ``reason`` alone ("it is a
    directory, not a file") for a caller that words the sentence itself (a figure's sidecar)."""

    def __init__(self, where: str, reason: str, advice: str) -> None:
        super().__init__(f"cannot write {where}: {reason}; {advice}")
        self.reason = reason


def check_output(path: str | os.PathLike[str], flag: str = "") -> None:
    """Refuse, in one sentence, an output path that :func:`write_output` would refuse, so that
    it is said before a long run. ``flag`` names the option (``--csv``) in the sentence."""
    _plan(path, flag)


def check_distinct(
    outputs: list[tuple[str, str | os.PathLike[str] | None]], advice: str = "give each its own file"
) -> None:
    """Refuse two output flags (``[("--csv", path), ("--json", path)]``) naming one file: one
    would replace the other. One file is one resolved path (``F``, ``./F``, a symlink to
    it) or, where it exists, one file on disk (:func:`os.path.samefile`: a case-insensitive
    file system's ``f`` and ``F``). Streams, devices and FIFOs may be named twice (written
    through, one after the other)."""
    seen: dict[object, str] = {}
    for flag, path in outputs:
        if not path:
            continue
        how, target, _ = _plan(path, flag)
        if how != "replace" or isinstance(target, int):
            continue
        keys: list[object] = [os.fspath(target)]
        with contextlib.suppress(OSError):  # not there yet: its resolved path says it
            st = os.stat(target)
            keys.append((st.st_dev, st.st_ino))
        first = next((seen[k] for k in keys if k in seen), None)
        if first is not None:
            raise IsotuiError(
                f"{first} and {flag} both name {os.fspath(path)}: one would replace the other; {advice}"
            )
        seen.update(dict.fromkeys(keys, flag))


def _plan(path: str | os.PathLike[str], flag: str) -> tuple[str, Path | int, int | None]:
    """How to write ``path``: ("fd", fd, None), ("through", path, None) or ("replace", target,
    mode of the existing file or None)."""
    text = os.fspath(path)
    if text in _STREAMS:
        return "fd", _STREAMS[text], None
    match = _FD_PATH.match(text)
    if match:
        return "fd", int(match.group(1)), None
    where = f"{text} ({flag})" if flag else text
    p = Path(text).expanduser()
    try:
        st = os.stat(p)  # follows a symlink: what matters is what it points at
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise OutputRefused(where, str(exc.strerror or exc), "choose another path") from None
    if st is not None:
        if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
            return "through", p, None
        for test, kind in _KINDS:
            if test(st.st_mode):
                raise OutputRefused(where, f"it is {kind}, not a file", "give a file name")
    target = Path(os.path.realpath(p))  # a symlink's target is replaced, the link stays
    return "replace", target, None if st is None else stat.S_IMODE(st.st_mode)


def write_output(path: str | os.PathLike[str], write: Callable[[IO[str]], None], flag: str = "") -> Path:
    """Write a user-named text output with ``write(file)`` (see the module doc for how)."""
    return _write(path, write, flag, {"mode": "w", "newline": "", "encoding": "utf-8"})


def write_output_bytes(path: str | os.PathLike[str], data: bytes, flag: str = "") -> Path:
    """Write a user-named binary output (a figure) as :func:`write_output` writes text."""
    return _write(path, lambda f: f.write(data), flag, {"mode": "wb"})


def _write(
    path: str | os.PathLike[str], write: Callable[[Any], Any], flag: str, how_open: dict[str, Any]
) -> Path:
    """:func:`write_output`'s work; ``how_open``: :func:`open`'s mode (and text settings)."""
    how, target, mode = _plan(path, flag)
    where = f"{os.fspath(path)} ({flag})" if flag else os.fspath(path)
    try:
        if isinstance(target, int):  # how == "fd"
            sys.stdout.flush()
            sys.stderr.flush()
            with os.fdopen(os.dup(target), **how_open) as f:
                write(f)
            return Path({1: "/dev/stdout", 2: "/dev/stderr"}.get(target, f"/dev/fd/{target}"))
        if how == "through":
            with _open_through(target, where, how_open) as f:
                write(f)
            return Path(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temps(target.parent, temp_pattern(re.escape(target.name)))
        fd, tmp = make_temp(target.parent, target.name, mode)
    except OSError as exc:
        raise IsotuiError(f"cannot write {where}: {exc.strerror or exc}; choose another path") from None
    try:
        with os.fdopen(fd, **how_open) as f:
            write(f)
        os.replace(tmp, target)
    except OSError as exc:
        raise IsotuiError(f"cannot write {where}: {exc.strerror or exc}; choose another path") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return Path(os.fspath(path)).expanduser()


def _open_through(target: Path, where: str, how_open: dict[str, Any]) -> IO[Any]:
    """Open a device or FIFO to write through. A FIFO with no reader would block the open
    silently: that is said first (on stderr), then waited for (Ctrl-C stops the wait)."""
    try:
        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK)  # a FIFO without a reader: ENXIO at once
    except OSError as exc:
        if exc.errno != errno.ENXIO:
            raise
        print(
            f"isotui: waiting for a reader of {where}, a FIFO: open it for reading (e.g. cat), "
            "or press Ctrl-C",
            file=sys.stderr,
            flush=True,
        )
        fd = os.open(target, os.O_WRONLY)
    os.set_blocking(fd, True)
    return os.fdopen(fd, **how_open)


def write_bytes_atomic(folder: Path, name: str, data: bytes, stale: re.Pattern[str] | None = None) -> Path:
    """Write ``data`` as ``folder/name`` atomically with the umask's mode (isotui's own files:
    cache entries). Raises OSError; ``stale`` names leftover temporaries to clean first."""
    folder.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(folder, stale or temp_pattern(re.escape(name)))
    fd, tmp = make_temp(folder, name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / name)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return folder / name


def claim_bytes(folder: Path, name: str, data: bytes) -> bool:
    """Write ``data`` as ``folder/name`` only if no such file exists, atomically (whole or not at
    all, first writer wins, also between machines on one shared file system): True if this call
    wrote it. Raises OSError."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = make_temp(folder, name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, folder / name)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)


def fix_modes(folder: Path) -> None:
    """Give files another library wrote into ``folder`` (safetensors makes 0600) the umask's mode."""
    mode = new_file_mode()
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)
