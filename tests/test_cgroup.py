"""The CPU budget honours a cgroup memory limit (a Slurm job's, a container's), v1 and v2, laid out
in a fake root as the kernel lays out /proc and /sys/fs/cgroup."""

from __future__ import annotations

from pathlib import Path

import pytest

from isotui.extract import cgroup as cg

GiB = 1 << 30


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v1(root: Path, folder: str, limit: int, usage: int, inactive: int = 0) -> None:
    base = root / "sys/fs/cgroup/memory" / folder.lstrip("/")
    _write(base / "memory.limit_in_bytes", f"{limit}\n")
    _write(base / "memory.usage_in_bytes", f"{usage}\n")
    _write(base / "memory.stat", f"cache 5\ntotal_inactive_file {inactive}\ntotal_rss 7\n")


def _v2(root: Path, folder: str, limit: int | None, usage: int, inactive: int = 0) -> None:
    base = root / "sys/fs/cgroup" / folder.lstrip("/")
    _write(base / "memory.max", f"{'max' if limit is None else limit}\n")
    _write(base / "memory.current", f"{usage}\n")
    _write(base / "memory.stat", f"anon 3\nfile 9\ninactive_file {inactive}\nactive_file 4\n")


V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "36 31 0:33 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
)
V2_MOUNTS = "30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_v1_the_tightest_limit_on_the_way_up_counts(tmp_path: Path) -> None:
    _write(tmp_path / "proc/self/mountinfo", V1_MOUNTS)
    _write(tmp_path / "proc/self/cgroup", "5:cpu:/\n4:memory:/slurm/uid_0/job_7\n0::/\n")
    _v1(tmp_path, "/", cg._NO_LIMIT + 4096, 10 * GiB)  # the root: "no limit"
    _v1(tmp_path, "/slurm", 64 * GiB, 20 * GiB)  # 44 GiB left
    _v1(tmp_path, "/slurm/uid_0", cg._NO_LIMIT, 20 * GiB)
    _v1(tmp_path, "/slurm/uid_0/job_7", 8 * GiB, 3 * GiB, inactive=1 * GiB)  # 6 GiB left
    assert cg.cgroup_memory_left(tmp_path) == 8 * GiB - 3 * GiB + 1 * GiB
    # the parent binds when it is tighter
    _v1(tmp_path, "/slurm", 24 * GiB, 20 * GiB)
    assert cg.cgroup_memory_left(tmp_path) == 4 * GiB


def test_v2_max_is_no_limit_and_a_parent_limit_binds(tmp_path: Path) -> None:
    _write(tmp_path / "proc/self/mountinfo", V2_MOUNTS)
    _write(tmp_path / "proc/self/cgroup", "0::/system.slice/job.scope\n")
    _v2(tmp_path, "/system.slice/job.scope", None, 2 * GiB)
    assert cg.cgroup_memory_left(tmp_path) is None  # "max" everywhere: no limit
    _v2(tmp_path, "/system.slice", 5 * GiB, 4 * GiB, inactive=512 << 20)
    assert cg.cgroup_memory_left(tmp_path) == GiB + (512 << 20)


def test_a_namespace_that_hides_the_path_reads_the_mount_itself(tmp_path: Path) -> None:
    # inside a container the cgroup file names a host path the container's mount does not have
    _write(tmp_path / "proc/self/mountinfo", V2_MOUNTS)
    _write(tmp_path / "proc/self/cgroup", "0::/kubepods/pod1/abc\n")
    _v2(tmp_path, "/", 3 * GiB, GiB)
    assert cg.cgroup_memory_left(tmp_path) == 2 * GiB


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    assert cg.cgroup_memory_left(tmp_path) is None
    _write(tmp_path / "proc/self/mountinfo", V1_MOUNTS)
    _write(tmp_path / "proc/self/cgroup", "4:memory:/job\n")
    _write(tmp_path / "sys/fs/cgroup/memory/job/memory.limit_in_bytes", "garbage\n")
    _write(tmp_path / "sys/fs/cgroup/memory/job/memory.usage_in_bytes", "1\n")
    assert cg.cgroup_memory_left(tmp_path) is None


def test_the_cpu_budget_is_the_lesser_of_meminfo_and_the_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    from isotui.extract import device
    from isotui.extract.memory_plan import margin, measured_budget

    system = device.available_memory("cpu")
    assert system is not None and system > 300 << 20
    monkeypatch.setattr(cg, "cgroup_memory_left", lambda root=Path("/"): 300 << 20)
    assert device.available_memory("cpu") == 300 << 20
    assert measured_budget("cpu") == (300 << 20) - margin(300 << 20)
    monkeypatch.setattr(cg, "cgroup_memory_left", lambda root=Path("/"): None)
    assert abs(device.available_memory("cpu") - system) < 2 * GiB  # meminfo alone, read again


def test_a_run_is_planned_within_the_cgroup_limit(tiny_models, tmp_path, monkeypatch):
    """A container or Slurm job with 300 MiB left under its cgroup limit and a machine with
    gigabytes free: the run's CPU budget is the cgroup's less the margin, recorded in its plan."""
    from isotui.experiments.layerwise import measure
    from isotui.extract.memory_plan import margin
    from isotui.spec import make_spec

    data = tmp_path / "t.txt"
    data.write_text("one two three four\nfive six seven eight\n", encoding="utf-8")
    spec = make_spec(str(tiny_models["gpt2"]), f"text:{data}", device="cpu")
    monkeypatch.setattr(cg, "cgroup_memory_left", lambda root=Path("/"): 300 << 20)
    plan = measure(spec, None).meta["memory_plan"]
    assert plan["budget_bytes"] == {"cpu": (300 << 20) - margin(300 << 20)}
    assert sum(plan["accumulator_bytes"].values()) <= plan["budget_bytes"]["cpu"]
