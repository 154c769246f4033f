"""The memory a Linux control group still lets this process take (cgroup v1 and v2).

A Slurm job, a container or a Kubernetes pod runs under a cgroup memory limit far below the
machine's ``MemAvailable``; a plan made from ``/proc/meminfo`` alone would be killed by the
kernel's out-of-memory killer instead of refused. Each limit on the way from the process's cgroup
up to the hierarchy's root counts (a parent's limit binds its children), and what is left under
a limit is ``limit - usage + inactive file cache`` (the page cache the kernel reclaims before it
kills anything: what container runtimes call the working set).

Files are read under ``root`` (``/`` on a real machine) so that tests can lay out a fake one.
"""

from __future__ import annotations

from pathlib import Path

_NO_LIMIT = 1 << 60  # v1 writes "no limit" as a page-rounded 2^63-1


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _stat_value(text: str | None, name: str) -> int:
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return 0


def _mounts(root: Path) -> list[tuple[str, Path, str]]:
    """(version, mount point, the cgroup path mounted there) of the memory hierarchies:
    ``v1`` for a cgroup mount with the memory controller, ``v2`` for cgroup2."""
    out = []
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3:
            continue
        fstype, options = after[0], after[2].split(",")
        mount_root, point = fields[3], root / fields[4].lstrip("/")
        if fstype == "cgroup2":
            out.append(("v2", point, mount_root))
        elif fstype == "cgroup" and "memory" in options:
            out.append(("v1", point, mount_root))
    return out


def _own_paths(root: Path) -> dict[str, str]:
    """This process's cgroup path per hierarchy: ``v1`` (the memory controller's), ``v2``."""
    out: dict[str, str] = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            out["v2"] = path
        elif "memory" in controllers.split(","):
            out["v1"] = path
    return out


def _left_in(folder: Path, version: str) -> int | None:
    """What the limit of one cgroup folder leaves; None where it sets none."""
    if version == "v2":
        limit_text, usage_text = _read(folder / "memory.max"), _read(folder / "memory.current")
        inactive = _stat_value(_read(folder / "memory.stat"), "inactive_file")
    else:
        limit_text = _read(folder / "memory.limit_in_bytes")
        usage_text = _read(folder / "memory.usage_in_bytes")
        inactive = _stat_value(_read(folder / "memory.stat"), "total_inactive_file")
    if limit_text is None or usage_text is None:
        return None
    limit_text, usage_text = limit_text.strip(), usage_text.strip()
    if not limit_text.isdigit() or not usage_text.isdigit():  # v2's "max": no limit
        return None
    limit = int(limit_text)
    if limit >= _NO_LIMIT:
        return None
    return max(0, limit - int(usage_text) + inactive)


def cgroup_memory_left(root: Path = Path("/")) -> int | None:
    """Bytes this process may still allocate under its cgroups' memory limits (the tightest on
    the way to each hierarchy's root); None when no limit is set or none can be read."""
    own = _own_paths(root)
    tightest: int | None = None
    for version, point, mount_root in _mounts(root):
        path = own.get(version)
        if path is None:
            continue
        # the process's folder below the mount: its cgroup path relative to what is mounted
        rel = path[len(mount_root) :] if path.startswith(mount_root) else path
        folder = point / rel.lstrip("/")
        if not folder.is_dir():  # a namespace that hides the path: the mount is our cgroup
            folder = point
        while True:
            left = _left_in(folder, version)
            if left is not None:
                tightest = left if tightest is None else min(tightest, left)
            if folder == point or point not in folder.parents:
                break
            folder = folder.parent
    return tightest
