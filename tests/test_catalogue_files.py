"""The fault catalogue, files and cache half (issue 11): nothing lost, nothing overwritten.

Read it as a table. Each group is one cause; each parametrised case gives the input, the
sentence expected (or a distinctive part of it), the exit code, and what must be on disk
afterwards. The CLI cases run the real ``isotui`` in a subprocess. Cases that need a small or a
read-only file system mount a tmpfs (root only) and are skipped where mounting is impossible; the
full-disk cause also has an in-process case that always runs.

Special files are made privately under the test's folder (``mknod`` of a /dev/null twin, a FIFO,
a socket): a regression must never replace the machine's own /dev/null or /dev/stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

TINY = "random:bert:hidden_size=32,num_hidden_layers=1,num_attention_heads=4,intermediate_size=64"
TINY_2 = "random:bert:hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64"
SMALL = ["--max-samples", "20", "-q"]
DRIFT = ["--hidden", "16", "--heads", "2", "--intermediate", "32", "--vocab", "50", "--batch", "2"]
DRIFT += ["--seq-len", "8", "--norms", "0,5", "-q"]
HOUR = 3600


def cli(*args: str, umask: int | None = None, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess (PYTHONPATH from the environment carries the worktree)."""
    return subprocess.run(
        [sys.executable, "-m", "isotui", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=timeout,
        umask=-1 if umask is None else umask,
        **kw,
    )


def clean(proc: subprocess.CompletedProcess) -> None:
    """No traceback and no 'internal error' whatever the exit code."""
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr


def one_sentence(proc: subprocess.CompletedProcess, part: str) -> None:
    """Exit 2 with ``part`` in one 'isotui: error:' line and no traceback."""
    clean(proc)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and part in proc.stderr.replace("\n", " "), proc.stderr


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def temps(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.tmp")) if folder.is_dir() else []


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "64k"):
    """A small tmpfs at ``path`` (skip the test where it cannot be mounted)."""
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); run as root for this case")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(folder: Path) -> None:
    """Fill the file system of ``folder`` to the last byte (ENOSPC on the next write)."""
    fd = os.open(folder / "ballast", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for chunk in (4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * chunk):
                    pass
    finally:
        os.close(fd)


def read_only(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> tuple[Path, str]:
    """A cache holding one entry of the tiny model (so export cases are cache hits, no torch)."""
    root = tmp_path_factory.mktemp("warm")
    proc = cli("run", "-m", TINY, *SMALL, "--cache-dir", str(root))
    assert proc.returncode == 0, proc.stderr
    (entry,) = entries(root / "runs")
    return root, entry.stem


def copy_cache(warm: tuple[Path, str], dest: Path) -> tuple[Path, str]:
    root, key = warm
    shutil.copytree(root / "runs", dest / "runs")
    return dest, key


def rewrite_entry(path: Path, change: Callable[[dict, dict], None]) -> None:
    """Change an entry's header and arrays and give it a valid checksum again."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from isotui.store.cache import _digest

    with safe_open(str(path), framework="numpy") as f:
        header = json.loads(f.metadata()["isotui"])
    arrays = load_file(str(path))
    change(header, arrays)
    header["digest"] = _digest(arrays, header["result"])
    save_file(arrays, str(path), metadata={"isotui": json.dumps(header)})


class Bomb:
    """A pickle that, if ever loaded, leaves a marker file: loading it is the failure."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ---------------------------------------------------------------------------------------------
# 1. A cache that cannot be written never costs the result (full disk: safetensors raised
#    SafetensorError, which nothing caught: no table, no CSV/JSON, later models never ran).
# ---------------------------------------------------------------------------------------------

FULL_DISK = [
    # (case, command after the cache folder, what must be printed or written besides the sentence)
    ("run, two models", ["run", "-m", TINY, "-m", TINY_2, *SMALL], "two tables, CSV and JSON of both"),
    ("experiment attention", ["experiment", "attention", "-m", TINY, *SMALL], "JSON of the heads"),
    ("experiment drift-block", ["experiment", "drift-block", *DRIFT], "JSON of the sweep"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,command,printed", FULL_DISK, ids=[c[0] for c in FULL_DISK])
def test_full_cache_disk_keeps_the_result(tmp_path, case, command, printed):
    with tmpfs(tmp_path / "cache") as root:
        folder = {"run": "runs", "experiment": command[1] if len(command) > 1 else ""}[command[0]]
        (root / folder).mkdir()
        fill(root)
        out_json = tmp_path / "out.json"
        extra = ["--csv", str(tmp_path / "out.csv")] if command[0] == "run" else []
        proc = cli(*command, "--cache-dir", str(root), "--json", str(out_json), *extra)
        clean(proc)
        assert proc.returncode == 0, proc.stderr
        said = " ".join((proc.stdout + proc.stderr).split())  # rich wraps long lines
        assert "could not write to the cache in" in said and "No space left on device" in said
        assert "not cached" in said
        payload = json.loads(out_json.read_text())
        if command[0] == "run":  # both models ran, printed and exported
            assert [r["model"] for r in payload["results"]] == [TINY, TINY_2]
            assert proc.stdout.count("avg_cos") >= 2 or proc.stdout.count("layer") >= 2
            assert (tmp_path / "out.csv").read_text().count("\n") == 1 + 2 + 3  # header, 2 + 3 layers
            assert said.count("could not write to the cache") == 2  # one sentence per model
        assert entries(root / folder) == [] and temps(root / folder) == []


@pytest.mark.parametrize(
    "error",
    ["SafetensorError", "ENOSPC"],
    ids=["serializer raises SafetensorError", "write raises OSError(ENOSPC)"],
)
def test_cache_write_failure_is_one_notice_in_process(tmp_path, monkeypatch, error):
    """Where no tmpfs can be mounted: the same two failures, raised by the real writer's parts."""
    import errno

    import safetensors.numpy
    from safetensors import SafetensorError

    from isotui.experiments.layerwise import measure
    from isotui.spec import make_spec
    from isotui.store import files
    from isotui.store.cache import ResultCache

    def fail(*_a, **_k):
        if error == "SafetensorError":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save", fail) if error == "SafetensorError" else (
        monkeypatch.setattr(files.os, "replace", fail)
    )
    cache = ResultCache(tmp_path / "c")
    notices: list[str] = []
    result = measure(make_spec(TINY, "builtin", max_samples=20), cache, on_notice=notices.append)
    assert len(result.rows) == 2 and not result.from_cache
    assert len(notices) == 1 and "could not write to the cache" in notices[0]
    assert "No space left on device" in notices[0] and "not cached" in notices[0]
    assert entries(cache.runs) == [] and temps(cache.runs) == []


# ---------------------------------------------------------------------------------------------
# 2. Exports: special files and symlinks were replaced by a 0600 regular file.
# ---------------------------------------------------------------------------------------------


def _chardev(p: Path) -> Path:
    try:
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a private twin of /dev/null
    except OSError as exc:
        pytest.skip(f"cannot make a device node here ({exc.strerror})")
    return p


def _blockdev(p: Path) -> Path:
    try:
        os.mknod(p, stat.S_IFBLK | 0o600, os.makedev(7, 0))  # a private name for loop0
    except OSError as exc:
        pytest.skip(f"cannot make a device node here ({exc.strerror})")
    return p


def _fifo(p: Path) -> Path:
    os.mkfifo(p)
    return p


def _socket(p: Path) -> Path:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()
    return p


def _symlink_to_file(p: Path) -> Path:
    target = p.parent / "real.csv"
    target.write_text("old\n")
    os.chmod(target, 0o640)
    p.symlink_to(target.name)
    return p


def _dangling_symlink(p: Path) -> Path:
    p.symlink_to("made-by-the-export.csv")
    return p


def _symlink_to_stdout(p: Path) -> Path:
    p.symlink_to("/proc/self/fd/1")
    return p


def _directory(p: Path) -> Path:
    p.mkdir()
    return p


@dataclass
class Target:
    case: str
    make: Callable[[Path], Path]
    said: str | None  # the refusal, or None: written
    code: int
    after: Callable[[Path, subprocess.CompletedProcess], None] = field(repr=False)


def _still(kind: Callable[[int], bool]) -> Callable[[Path, subprocess.CompletedProcess], None]:
    def check(p: Path, _proc) -> None:
        assert kind(os.lstat(p).st_mode), f"{p} was replaced: mode {oct(os.lstat(p).st_mode)}"

    return check


def _link_kept_target_written(p: Path, _proc) -> None:
    assert p.is_symlink() and os.readlink(p) == "real.csv"
    real = p.parent / "real.csv"
    assert real.read_text().startswith("model,component,layer")
    assert stat.S_IMODE(real.stat().st_mode) == 0o640  # the existing file's mode is kept


def _dangling_followed(p: Path, _proc) -> None:
    assert p.is_symlink() and (p.parent / "made-by-the-export.csv").read_text().startswith("model,")


def _csv_on_stdout(p: Path, proc) -> None:
    assert "model,component,layer" in proc.stdout
    assert p.is_symlink() if p.name != "-" else True


TARGETS = [
    Target("a character device (/dev/null twin)", _chardev, None, 0, _still(stat.S_ISCHR)),
    Target("a FIFO (read by another process)", _fifo, None, 0, _still(stat.S_ISFIFO)),
    Target("'-' (stdout)", lambda p: Path("-"), None, 0, _csv_on_stdout),
    Target("a symlink to /proc/self/fd/1", _symlink_to_stdout, None, 0, _csv_on_stdout),
    Target("a symlink to a file", _symlink_to_file, None, 0, _link_kept_target_written),
    Target("a dangling symlink", _dangling_symlink, None, 0, _dangling_followed),
    Target("a socket", _socket, "it is a socket, not a file", 2, _still(stat.S_ISSOCK)),
    Target("a block device", _blockdev, "it is a block device, not a file", 2, _still(stat.S_ISBLK)),
    Target("a directory", _directory, "it is a directory, not a file", 2, _still(stat.S_ISDIR)),
]


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS, ids=[t.case for t in TARGETS])
def test_export_to_special_files_and_symlinks(tmp_path, warm, target):
    root, _key = warm
    path = target.make(tmp_path / "out")
    reader_got: list[bytes] = []
    if target.make is _fifo:  # a reader at the other end, as `isotui ... --csv fifo & cat fifo`
        reader = threading.Thread(target=lambda: reader_got.append(Path(path).read_bytes()), daemon=True)
        reader.start()
    proc = cli("run", "-m", TINY, *SMALL, "--cache-dir", str(root), "--csv", str(path))
    if target.said:
        one_sentence(proc, target.said)
        assert f"cannot write {path} (--csv)" in proc.stderr
    else:
        clean(proc)
        assert proc.returncode == target.code, proc.stderr
    target.after(Path(path), proc)
    if target.make is _fifo:
        reader.join(30)
        assert reader_got and reader_got[0].startswith(b"model,component,layer")


EXPERIMENT_OUTPUTS = [
    # (experiment, flag): a socket as the output is refused before anything is computed
    ("attention", "--csv"),
    ("drift-block", "--json"),
    ("final-norm", "--csv"),
    ("gradients", "--json"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,flag", EXPERIMENT_OUTPUTS, ids=[f"{n} {f}" for n, f in EXPERIMENT_OUTPUTS])
def test_experiment_outputs_refuse_special_files_before_the_run(tmp_path, name, flag):
    sock = _socket(tmp_path / "out")
    proc = cli("experiment", name, flag, str(sock), timeout=600)  # the cache: $ISOTUI_CACHE_DIR
    one_sentence(proc, f"cannot write {sock} ({flag}): it is a socket, not a file")
    assert stat.S_ISSOCK(os.lstat(sock).st_mode) and not (tmp_path / "cache").exists()


MODES = [
    # (case, umask, existing file's mode or None, expected mode afterwards)
    ("new export, umask 022", 0o022, None, 0o644),
    ("new export, umask 027", 0o027, None, 0o640),
    ("existing export 0604 keeps its mode", 0o022, 0o604, 0o604),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,umask,existing,expected", MODES, ids=[m[0] for m in MODES])
def test_export_mode_honours_umask_and_keeps_an_existing_mode(
    tmp_path, warm, case, umask, existing, expected
):
    root, _key = warm
    out = tmp_path / "out.json"
    if existing is not None:
        out.write_text("{}")
        os.chmod(out, existing)
    proc = cli("run", "-m", TINY, *SMALL, "--cache-dir", str(root), "--json", str(out), umask=umask)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(out.stat().st_mode) == expected and json.loads(out.read_text())["results"]


@pytest.mark.parametrize("umask,expected", [(0o022, 0o644), (0o077, 0o600)], ids=["umask 022", "umask 077"])
def test_cache_entry_mode_honours_umask(tmp_path, umask, expected):
    from isotui.store.cache import ResultCache

    old = os.umask(umask)
    try:
        path = ResultCache(tmp_path).put_payload("ab" * 16, {"x": 1}, {"a": np.arange(4.0)})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == expected


def test_train_tiny_weights_honour_umask(tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertModel

    from isotui.experiments.train_tiny import _save_checkpoint
    from isotui.models.naming import bundled_minilm_dir

    model = BertModel(
        BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    )
    tokenizer = AutoTokenizer.from_pretrained(str(bundled_minilm_dir()))
    old = os.umask(0o022)
    try:
        folder = _save_checkpoint(model, tokenizer, tmp_path, 10)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}


STALE = [
    # (case, leftover temporary's name, age in seconds, removed by the next write?)
    ("export temp of a killed write, 2 h old", ".out.csv.abcd1234.tmp", 2 * HOUR, True),
    ("export temp, 10 min old (maybe a live writer)", ".out.csv.efgh5678.tmp", 600, False),
    ("someone else's .tmp, 2 h old", ".notes.tmp", 2 * HOUR, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,name,age,removed", STALE, ids=[s[0] for s in STALE])
def test_stale_export_temporaries_are_cleaned(tmp_path, warm, case, name, age, removed):
    root, _key = warm
    leftover = tmp_path / name
    leftover.write_text("partial")
    os.utime(leftover, (time.time() - age, time.time() - age))
    proc = cli("run", "-m", TINY, *SMALL, "--cache-dir", str(root), "--csv", str(tmp_path / "out.csv"))
    assert proc.returncode == 0, proc.stderr
    assert leftover.exists() is not removed
    assert (tmp_path / "out.csv").read_text().startswith("model,component,layer")


CACHE_STALE = [
    # (case, leftover temporary's name in runs/, age in seconds, removed by the next cache write?)
    ("entry temp of a killed write, 2 h old", ".{k}.safetensors.k1ll3d00.tmp", 2 * HOUR, True),
    ("the same, as older versions named it", ".{k}.k1ll3d00.tmp", 2 * HOUR, True),
    ("entry temp, 1 min old (maybe a live writer)", ".{k}.safetensors.wr1t1ng0.tmp", 60, False),
]


@pytest.mark.parametrize("case,name,age,removed", CACHE_STALE, ids=[c[0] for c in CACHE_STALE])
def test_stale_cache_temporaries_are_cleaned(tmp_path, case, name, age, removed):
    from isotui.store.cache import ResultCache

    cache = ResultCache(tmp_path)
    cache.runs.mkdir(parents=True)
    leftover = cache.runs / name.format(k="cd" * 16)
    leftover.write_bytes(b"half an entry")
    os.utime(leftover, (time.time() - age, time.time() - age))
    cache.put_payload("ab" * 16, {"x": 1}, {"a": np.arange(4.0)})
    assert leftover.exists() is not removed


# ---------------------------------------------------------------------------------------------
# 4. Stale cache after weights change in place (the fingerprint was name, size and mtime).
# ---------------------------------------------------------------------------------------------


def _save_bert(folder: Path, seed: int, tokenizer_from: Path) -> None:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    BertModel(config).save_pretrained(folder)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "special_tokens")):
            shutil.copy(f, folder / f.name)


def test_weights_changed_in_place_same_size_and_mtime_give_new_numbers(tmp_path, tiny_models):
    from isotui.experiments.layerwise import measure
    from isotui.spec import make_spec
    from isotui.store.cache import ResultCache

    model, other = tmp_path / "model", tmp_path / "other"
    _save_bert(model, 0, tiny_models["bert"])
    _save_bert(other, 1, tiny_models["bert"])
    cache = ResultCache(tmp_path / "cache")
    spec = make_spec(str(model), "builtin", max_samples=20)
    first = measure(spec, cache)
    weights = model / "model.safetensors"
    before = weights.stat()
    assert (other / "model.safetensors").stat().st_size == before.st_size
    with open(weights, "r+b") as f:  # in place: same inode, same size
        f.write((other / "model.safetensors").read_bytes())
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime preserved
    assert weights.stat().st_mtime_ns == before.st_mtime_ns and weights.stat().st_size == before.st_size
    again = measure(spec, cache)
    truth = measure(make_spec(str(other), "builtin", max_samples=20), None)  # the new weights, no cache
    assert not again.from_cache
    assert [r.avg_cos for r in again.rows] == [r.avg_cos for r in truth.rows]
    assert [r.avg_cos for r in again.rows] != [r.avg_cos for r in first.rows]


def test_weight_digest_is_remembered_so_a_repeated_run_does_not_rehash(tmp_path, tiny_models, monkeypatch):
    import hashlib

    from isotui.models.naming import DIGESTS_FILE, parse_model

    ref = parse_model(str(tiny_models["bert"]))
    calls: list[str] = []
    real = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, d: calls.append(f.name) or real(f, d))
    first = ref.fingerprint(tmp_path)
    assert len(calls) == 1 and (tmp_path / DIGESTS_FILE).is_file()
    assert ref.fingerprint(tmp_path) == first and len(calls) == 1  # remembered: no re-hash
    os.utime(tiny_models["bert"] / "model.safetensors")  # a touch changes mtime/ctime: hashed again
    assert ref.fingerprint(tmp_path) == first and len(calls) == 2
    (tmp_path / DIGESTS_FILE).write_text("[not, json")  # a damaged memo only costs a re-hash
    assert ref.fingerprint(tmp_path) == first and len(calls) == 3


# ---------------------------------------------------------------------------------------------
# 5. Cache removal that deleted too much ('' matched everything; --all took foreign files).
# ---------------------------------------------------------------------------------------------


@dataclass
class Removal:
    case: str
    keys: Callable[[str], list[str]]  # from the entry's key
    said: str
    code: int
    entry_kept: bool
    twins: bool = False  # two isotui entries sharing the first 6 characters


FOREIGN = "feedfacefeedfacefeedfacefeedface"
REMOVALS = [
    Removal("empty key (an unset $KEY)", lambda k: [""], "too short", 2, True),
    Removal("5-character prefix", lambda k: [k[:5]], "too short", 2, True),
    Removal("6-character prefix", lambda k: [k[:6]], "removed 1 cached run", 0, False),
    Removal("full key", lambda k: [k], "removed 1 cached run", 0, False),
    Removal("ambiguous prefix", lambda k: [k[:6]], "matches 2 cached entries", 2, True, twins=True),
    Removal("a foreign file's name", lambda k: [FOREIGN], "matches no cached run", 2, True),
    Removal("--all beside a foreign file", lambda k: ["--all"], "left 1 file(s)", 0, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("removal", REMOVALS, ids=[r.case for r in REMOVALS])
def test_cache_rm_only_removes_isotui_entries_by_a_clear_key(tmp_path, warm, removal):
    from safetensors.numpy import save_file

    root, key = copy_cache(warm, tmp_path / "cache")
    runs = root / "runs"
    foreign = runs / f"{FOREIGN}.safetensors"
    save_file({"w": np.zeros(3)}, str(foreign), metadata={"owner": "someone else"})
    twin = runs / f"{key[:6]}{'0' * 26}.safetensors"
    if removal.twins:
        shutil.copy(runs / f"{key}.safetensors", twin)
    proc = cli("cache", "--cache-dir", str(root), "rm", *removal.keys(key))
    if removal.code == 2:
        one_sentence(proc, removal.said)
        assert "nothing was removed" in proc.stderr
    else:
        clean(proc)
        assert proc.returncode == 0 and removal.said in proc.stderr, proc.stderr
    assert (runs / f"{key}.safetensors").exists() is removal.entry_kept
    assert foreign.exists()  # never isotui's to remove
    assert twin.exists() is removal.twins


READ_ONLY_RM = [("rm --all", ["--all"]), ("rm KEY", None)]


@pytest.mark.slow
@pytest.mark.parametrize("case,keys", READ_ONLY_RM, ids=[c[0] for c in READ_ONLY_RM])
def test_cache_rm_on_a_read_only_cache_is_one_sentence(tmp_path, warm, case, keys):
    with tmpfs(tmp_path / "cache", "1m") as root:
        _, key = copy_cache(warm, root)
        read_only(root)
        proc = cli("cache", "--cache-dir", str(root), "rm", *(keys or [key]))
        one_sentence(proc, "cannot remove cache entries in")
        assert "Read-only file system" in proc.stderr
        assert (root / "runs" / f"{key}.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# 8. Listing a changing or odd cache (cache ls and the app crashed).
# ---------------------------------------------------------------------------------------------


def _odd_counts(header: dict, _arrays: dict) -> None:
    header["result"]["meta"]["n_samples"] = "many"
    header["result"]["meta"]["created"] = 5


def _odd_text(header: dict, _arrays: dict) -> None:  # counts fine: the app died on these
    header["result"]["model"] = 123
    header["result"]["meta"]["data"] = ["builtin"]


ODD = [
    # (case, how runs/ is made odd, expected in stdout, skipped count on stderr)
    ("a dangling symlink", lambda runs, key: (runs / "gone.safetensors").symlink_to("nowhere"), None, 1),
    ("a directory named *.safetensors", lambda runs, key: (runs / "d.safetensors").mkdir(), None, 1),
    (
        "a foreign safetensors file",
        lambda runs, key: __import__("safetensors.numpy").numpy.save_file(
            {"w": np.zeros(2)}, str(runs / f"{FOREIGN}.safetensors")
        ),
        None,
        1,
    ),
    ("a truncated entry", lambda runs, key: (runs / "t.safetensors").write_bytes(b"\x10\x00"), None, 1),
    (
        "checksum-valid entry, counts of odd types",
        lambda runs, key: rewrite_entry(runs / f"{key}.safetensors", _odd_counts),
        "(unreadable)",
        0,
    ),
    (
        "checksum-valid entry, model and data not text",
        lambda runs, key: rewrite_entry(runs / f"{key}.safetensors", _odd_text),
        "(unreadable)",
        0,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,make_odd,shown,skipped", ODD, ids=[o[0] for o in ODD])
def test_cache_ls_on_an_odd_cache(tmp_path, warm, case, make_odd, shown, skipped):
    root, key = copy_cache(warm, tmp_path / "cache")
    make_odd(root / "runs", key)
    proc = cli("cache", "--cache-dir", str(root), "ls")
    clean(proc)
    assert proc.returncode == 0, proc.stderr
    assert key[:12] in proc.stdout
    if shown:
        assert shown in proc.stdout
    if skipped:
        assert f"skipped {skipped} file(s)" in proc.stderr
    else:
        assert "skipped" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("case,make_odd,shown,skipped", ODD, ids=[o[0] for o in ODD])
def test_app_starts_on_an_odd_cache(tmp_path, warm, case, make_odd, shown, skipped):
    import asyncio

    from textual.widgets import OptionList

    from isotui.tui.app import IsotuiApp

    root, key = copy_cache(warm, tmp_path / "cache")
    make_odd(root / "runs", key)

    async def scenario():
        app = IsotuiApp(cache_root=root, export_dir=tmp_path)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            models = app.query_one("#models", OptionList)
            return [models.get_option_at_index(i).id for i in range(models.option_count)]

    ids = asyncio.run(scenario())
    assert ("model:minilm" in ids) and ((f"run:{key}" in ids) is (shown is None))


def test_entries_vanishing_while_listing_are_skipped_and_counted(tmp_path, monkeypatch):
    from isotui.store.cache import ResultCache

    cache = ResultCache(tmp_path)
    for i in range(4):
        cache.put_payload(f"{i:032x}", {"model": "m", "meta": {}}, {"a": np.arange(3.0)})
    real = ResultCache._header

    def vanishing(path):
        if path.stem.endswith(("1", "3")):
            path.unlink()  # removed by another process between the listing and the read
        return real(path)

    monkeypatch.setattr(ResultCache, "_header", staticmethod(vanishing))
    scan = cache.scan()
    assert len(scan.entries) == 2 and scan.skipped == 2


def test_listing_while_another_thread_deletes_never_fails(tmp_path):
    from isotui.store.cache import ResultCache

    cache = ResultCache(tmp_path)
    data = cache.put_payload("0" * 32, {"model": "m", "meta": {}}, {"a": np.arange(3.0)}).read_bytes()
    for i in range(1, 150):
        (cache.runs / f"{i:032x}.safetensors").write_bytes(data)
    stop, scanning = threading.Event(), threading.Event()

    def deleter():
        scanning.wait()  # start deleting only once the lister runs (else a quick deleter may finish first)
        for p in sorted(cache.runs.glob("*.safetensors"), reverse=True):
            p.unlink()
            if stop.is_set():
                return

    thread = threading.Thread(target=deleter)
    thread.start()
    seen = []
    while True:
        scanning.set()
        scan = cache.scan()
        seen.append(len(scan.entries) + scan.skipped)
        if not thread.is_alive():
            break
    stop.set()
    thread.join()
    assert seen and all(n <= 150 for n in seen)


@pytest.mark.slow
def test_two_concurrent_rm_all_remove_each_entry_once(tmp_path, warm):
    root, key = copy_cache(warm, tmp_path / "cache")
    for i in range(40):
        shutil.copy(root / "runs" / f"{key}.safetensors", root / "runs" / f"{i:032x}.safetensors")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "isotui", "cache", "--cache-dir", str(root), "rm", "--all"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("Traceback" not in err for _, err in outs)
    removed = sum(int(err.split("removed ")[1].split()[0]) for _, err in outs)
    assert removed == 41 and entries(root / "runs") == []


# ---------------------------------------------------------------------------------------------
# 9 (that case only). An attention entry with a valid checksum but a wrong structure failed on
#    every run, was never recomputed, and `cache rm KEY` could not remove it.
# ---------------------------------------------------------------------------------------------

WRONG_STRUCTURE = [
    ("rows lack a field", lambda h, a: [r.pop("entropy") for r in h["result"]["rows"]]),
    ("meta without modules", lambda h, a: h["result"]["meta"].pop("modules")),
    ("an array missing", lambda h, a: a.pop("hist.0")),
    ("a number that is text", lambda h, a: h["result"]["rows"][0].__setitem__("entropy", "high")),
]


@pytest.fixture(scope="module")
def attention_entry(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("attention")
    proc = cli("experiment", "attention", "-m", TINY, *SMALL, "--cache-dir", str(root))
    assert proc.returncode == 0, proc.stderr
    (entry,) = entries(root / "attention")
    return root, entry


@pytest.mark.slow
@pytest.mark.parametrize("case,damage", WRONG_STRUCTURE, ids=[w[0] for w in WRONG_STRUCTURE])
def test_attention_entry_of_a_wrong_structure_is_reported_and_recomputed(
    tmp_path, attention_entry, case, damage
):
    from isotui.experiments.attention import attention_cache, find_attention
    from isotui.spec import make_spec

    src_root, src = attention_entry
    root = tmp_path / "cache"
    shutil.copytree(src_root, root)
    path = root / "attention" / src.name
    rewrite_entry(path, damage)
    notices: list[str] = []
    spec = make_spec(TINY, "builtin", max_samples=20)
    _prepared, key, hit = find_attention(spec, attention_cache(root), 0, notices.append)
    assert hit is None and key == path.stem
    assert (
        len(notices) == 1 and f"{key}.safetensors is unreadable" in notices[0] and "recomputing" in notices[0]
    )
    proc = cli("cache", "--cache-dir", str(root), "rm", key)  # and removable by its key
    clean(proc)
    assert proc.returncode == 0 and "removed 1 cached experiment result(s)" in proc.stderr
    assert not path.exists()


@pytest.mark.slow
def test_attention_entry_of_a_wrong_structure_is_recomputed_by_the_cli(tmp_path, attention_entry):
    src_root, src = attention_entry
    root = tmp_path / "cache"
    shutil.copytree(src_root, root)
    path = root / "attention" / src.name
    rewrite_entry(path, WRONG_STRUCTURE[1][1])
    proc = cli("experiment", "attention", "-m", TINY, *SMALL, "--cache-dir", str(root))
    clean(proc)
    assert proc.returncode == 0 and "is unreadable" in proc.stderr and "recomputing" in proc.stderr
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:  # rewritten whole
        assert "modules" in json.loads(f.metadata()["isotui"])["result"]["meta"]


# ---------------------------------------------------------------------------------------------
# What already held (keep it): kills, concurrency, damage, read-only hits, no pickle.
# ---------------------------------------------------------------------------------------------

_SLOW_WRITER = """
import os, sys, time
import numpy as np
from isotui.store.cache import ResultCache

real = os.fdopen

class Slow:
    def __init__(self, f):
        self.f = f
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()
    def write(self, data):
        self.f.write(data[: len(data) // 2]); self.f.flush()
        print("half written", flush=True)
        time.sleep(120)
        self.f.write(data[len(data) // 2 :])

os.fdopen = lambda fd, mode="r", *a, **k: Slow(real(fd, mode, *a, **k))
ResultCache(sys.argv[1]).put_payload("ab" * 16, {"x": 1}, {"a": np.arange(100000.0)})
"""

KILLS = [
    # (signal, temporary left behind until the next write an hour later)
    (signal.SIGINT, False),
    (signal.SIGKILL, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("sig,temp_left", KILLS, ids=["SIGINT mid-write", "SIGKILL mid-write"])
def test_a_kill_during_a_cache_write_leaves_no_partial_entry(tmp_path, sig, temp_left):
    from isotui.store.cache import ResultCache

    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "half written"
    proc.send_signal(sig)
    proc.wait(60)
    runs = tmp_path / "runs"
    assert entries(runs) == []  # never a half-written entry under the entry's name
    assert bool(temps(runs)) is temp_left
    for t in temps(runs):  # the next write, an hour later, removes what the kill left
        os.utime(t, (time.time() - 2 * HOUR, time.time() - 2 * HOUR))
    ResultCache(tmp_path).put_payload("cd" * 16, {"x": 2}, {"a": np.arange(3.0)})
    assert temps(runs) == []


@pytest.mark.slow
def test_sigint_during_a_cli_run_leaves_no_partial_entry(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "isotui",
            "run",
            "-m",
            TINY,
            "--max-samples",
            "400",
            "--cache-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:  # inside the run: torch is loaded
        with contextlib.suppress(OSError):
            if "libtorch" in maps.read_text():
                break
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=300)
    # finished (0), or interrupted: exit 130, or (rarely, under load: about 1 run in 25 at a 1 s
    # delay) "isotui: cancelled" and then an end by the signal itself (-2), which a shell reports
    # as 130 too: a ^C that lands in transformers' import-time ``exec`` of generated code
    # (``dataclasses``) is recorded by CPython 3.11 as unhandled even though isotui catches it.
    # Either way: no traceback, and no partial entry below.
    assert proc.returncode in (0, 130, -signal.SIGINT) and "Traceback" not in err
    from isotui.experiments.layer_pass import read
    from isotui.store.cache import ResultCache

    cache = ResultCache(tmp_path)
    assert temps(cache.runs) == []
    for entry in entries(cache.runs):  # finished before the signal: then complete
        assert read(cache, entry.stem) is not None


@pytest.mark.slow
def test_three_identical_concurrent_runs_give_one_entry_and_identical_numbers(tmp_path):
    outs = [tmp_path / f"out{i}.json" for i in range(3)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "isotui",
                "run",
                "-m",
                TINY,
                *SMALL,
                "--cache-dir",
                str(tmp_path / "c"),
                "--json",
                str(out),
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        for out in outs
    ]
    errs = [p.communicate(timeout=900)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    rows = [json.loads(o.read_text())["results"][0]["rows"] for o in outs]
    assert rows[0] == rows[1] == rows[2]
    assert len(entries(tmp_path / "c" / "runs")) == 1 and temps(tmp_path / "c" / "runs") == []


def _flip_last_bytes(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    raw[-8:] = bytes(b ^ 0xFF for b in raw[-8:])
    p.write_bytes(bytes(raw))


def _change_a_digit(p: Path) -> None:
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    with safe_open(str(p), framework="numpy") as f:
        header = json.loads(f.metadata()["isotui"])
    header["result"]["rows"][0]["avg_cos"] += 0.1
    save_file(load_file(str(p)), str(p), metadata={"isotui": json.dumps(header)})


def _old_schema(p: Path) -> None:
    rewrite_entry(p, lambda h, a: h.__setitem__("schema", 0))


def _no_metadata(p: Path) -> None:
    from safetensors.numpy import load_file, save_file

    save_file(load_file(str(p)), str(p))


def _pickle_entry(p: Path) -> None:
    p.write_bytes(pickle.dumps(Bomb(p.parent.parent / "PICKLE-LOADED")))


DAMAGE = [
    # (case, damage, what the notice says)
    ("an array's bits flipped", _flip_last_bytes, "damaged (checksum mismatch)"),
    ("a digit of the table changed", _change_a_digit, "damaged (checksum mismatch)"),
    ("truncated to half", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "unreadable"),
    ("empty file", lambda p: p.write_bytes(b""), "unreadable"),
    ("text, not safetensors", lambda p: p.write_text("hello"), "unreadable"),
    ("a pickle under the entry's name", _pickle_entry, "unreadable"),
    ("an older schema", _old_schema, "has schema 0"),
    ("no isotui metadata", _no_metadata, "unreadable"),
    (
        "header is a JSON list",
        lambda p: rewrite_entry(p, lambda h, a: h.__setitem__("result", [])),
        "unreadable",
    ),
    (
        "rows of odd types",
        lambda p: rewrite_entry(p, lambda h, a: h["result"].__setitem__("rows", 7)),
        "unreadable",
    ),
]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """A healthy entry of the tiny model and its numbers (measured once, in-process)."""
    from isotui.experiments.layerwise import measure
    from isotui.spec import make_spec
    from isotui.store.cache import ResultCache

    root = tmp_path_factory.mktemp("healthy")
    spec = make_spec(TINY, "builtin", max_samples=20)
    result = measure(spec, ResultCache(root))
    return spec, root, result


@pytest.mark.parametrize("case,damage,said", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damaged_entries_are_reported_and_recomputed(tmp_path, healthy, case, damage, said):
    from isotui.experiments.layerwise import measure
    from isotui.store.cache import ResultCache

    spec, src, first = healthy
    shutil.copytree(src / "runs", tmp_path / "runs")
    cache = ResultCache(tmp_path)
    damage(cache.path_for(first.key))
    notices: list[str] = []
    again = measure(spec, cache, on_notice=notices.append)
    assert not again.from_cache and len(notices) == 1 and said in notices[0] and "recomputing" in notices[0]
    assert [r.avg_cos for r in again.rows] == [r.avg_cos for r in first.rows]
    hit = measure(spec, cache)  # rewritten whole
    assert hit.from_cache and [r.avg_cos for r in hit.rows] == [r.avg_cos for r in first.rows]
    assert not (tmp_path / "PICKLE-LOADED").exists()


@pytest.mark.slow
def test_a_read_only_cache_answers_hits(tmp_path, warm):
    with tmpfs(tmp_path / "cache", "1m") as root:
        _, key = copy_cache(warm, root)
        read_only(root)
        proc = cli("run", "-m", TINY, *SMALL, "--cache-dir", str(root), "--json", str(tmp_path / "o.json"))
        clean(proc)
        assert proc.returncode == 0 and "(cache)" in proc.stdout, proc.stderr
        assert "could not write" not in proc.stderr
        assert json.loads((tmp_path / "o.json").read_text())["results"][0]["key"] == key


@pytest.mark.slow
def test_a_pickled_weights_file_is_never_loaded(tmp_path, tiny_models):
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny_models["bert"].iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    marker = tmp_path / "PICKLE-LOADED"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Bomb(marker)))
    proc = cli("run", "-m", str(folder), *SMALL, "--cache-dir", str(tmp_path / "c"))
    clean(proc)
    assert proc.returncode == 2 and not marker.exists()
    assert entries(tmp_path / "c" / "runs") == []
