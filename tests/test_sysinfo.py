"""The GPU header from NVML, with a recorded fake ``pynvml`` (the real package's function names,
structures and error classes; the answers of a two-GPU H100 node), and its fallbacks."""

from __future__ import annotations

import asyncio
import os
import subprocess as sp
import sys
import time
import types

import pytest

from isotui.tui import sysinfo

from .test_tui import _wait

real = pytest.importorskip("pynvml")  # nvidia-ml-py: its structures and error classes
GIB = 2**30
MIB = 2**20


def fake_pynvml(*, init_error: int | None = None, unsupported: tuple[str, ...] = (), own_pid: int = 0):
    """A ``pynvml`` module answering as a recorded H100 node does: GPU 0 runs ``own_pid`` (the
    app's worker) and another user's job, GPU 1 is idle. Its samples are timed from when it is
    made (not when this module was collected: NVML's window is a few seconds)."""
    now_us = int(time.time() * 1e6)
    gpus = [
        {
            "name": "NVIDIA H100 80GB HBM3",
            "memory": real.c_nvmlMemory_t(85520809984, 60129542144, 25391267840),
            "util": real.c_nvmlUtilization_t(87, 41),
            "procs": [(own_pid, 3489660928), (4242, 21474836480)],
            # NVML keeps a few samples per process; the newest one counts
            "samples": [
                (own_pid, now_us - 9_000_000, 12),
                (own_pid, now_us - 1_000_000, 64),
                (4242, now_us, 20),
            ],
        },
        {
            "name": "NVIDIA H100 80GB HBM3",
            "memory": real.c_nvmlMemory_t(85520809984, 84987740160, 533069824),
            "util": real.c_nvmlUtilization_t(0, 0),
            "procs": [],
            "samples": [],
        },
    ]
    m = types.ModuleType("pynvml")
    m.NVMLError = real.NVMLError
    m.NVMLLibraryMismatchError = real.NVMLLibraryMismatchError
    calls: list[str] = []
    m.calls = calls

    def check(name: str) -> None:
        calls.append(name)
        if name in unsupported:
            raise real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED)

    def nvmlInit() -> None:
        calls.append("nvmlInit")
        if init_error is not None:
            raise real.NVMLError(init_error)

    def nvmlDeviceGetComputeRunningProcesses(handle):
        check("nvmlDeviceGetComputeRunningProcesses")
        return [
            real.nvmlStructToFriendlyObject(real.c_nvmlProcessInfo_v3_t(pid, used, 0xFFFFFFFF, 0xFFFFFFFF))
            for pid, used in gpus[handle]["procs"]
        ]

    def nvmlDeviceGetProcessUtilization(handle, timeStamp):
        check("nvmlDeviceGetProcessUtilization")
        samples = [s for s in gpus[handle]["samples"] if s[1] > timeStamp]
        if not samples:  # NVML's answer when no process ran since timeStamp
            raise real.NVMLError(real.NVML_ERROR_NOT_FOUND)
        return [real.c_nvmlProcessUtilizationSample_t(pid, ts, sm, 0, 0, 0) for pid, ts, sm in samples]

    def nvmlDeviceGetUtilizationRates(handle):
        check("nvmlDeviceGetUtilizationRates")
        return gpus[handle]["util"]

    m.nvmlInit = nvmlInit
    m.nvmlShutdown = lambda: calls.append("nvmlShutdown")
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: gpus[h]["name"]
    m.nvmlDeviceGetMemoryInfo = lambda h: gpus[h]["memory"]
    m.nvmlDeviceGetUtilizationRates = nvmlDeviceGetUtilizationRates
    m.nvmlDeviceGetComputeRunningProcesses = nvmlDeviceGetComputeRunningProcesses
    m.nvmlDeviceGetProcessUtilization = nvmlDeviceGetProcessUtilization
    return m


def _smi(monkeypatch) -> None:
    """nvidia-smi answering for the same node (names and free memory only)."""
    answer = "0, NVIDIA H100 80GB HBM3, 57344, 81559\n1, NVIDIA H100 80GB HBM3, 81050, 81559\n"
    monkeypatch.setattr(sysinfo.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(
        sysinfo.subprocess, "run", lambda cmd, **kw: sp.CompletedProcess(cmd, 0, stdout=answer, stderr="")
    )


def test_header_from_nvml_shows_utilisation_and_per_process_memory(monkeypatch):
    _smi(monkeypatch)  # present, but NVML answers first
    fake = fake_pynvml(own_pid=777)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpus = sysinfo.query_gpus()
    assert fake.calls[0] == "nvmlInit" and fake.calls[-1] == "nvmlShutdown"
    line = sysinfo.describe_devices(gpus, own_pids={777})
    free0, total, ours, theirs = 60129542144 / GIB, 85520809984 / GIB, 3489660928 / GIB, 21474836480 / GIB
    free1 = 84987740160 / GIB
    assert line == (
        f"cuda:0 NVIDIA H100 80GB HBM3 ({free0:.1f}/{total:.1f} GiB free, 87% busy; "
        f"isotui {ours:.1f} GiB 64%, 1 other {theirs:.1f} GiB)  "
        f"cuda:1 NVIDIA H100 80GB HBM3 ({free1:.1f}/{total:.1f} GiB free, 0% busy)"
    )
    assert gpus[0].processes == (
        sysinfo.GpuProcess(777, 3489660928 // MIB, 64),
        sysinfo.GpuProcess(4242, 21474836480 // MIB, 20),
    )
    # without the app's pids, both processes are other users'
    assert f"2 others {(3489660928 + 21474836480) / GIB:.1f} GiB" in sysinfo.describe_devices(gpus)


def test_nvml_readings_a_gpu_does_not_support_are_left_out(monkeypatch):
    fake = fake_pynvml(
        own_pid=777, unsupported=("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetProcessUtilization")
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    line = sysinfo.describe_devices(sysinfo.query_gpus(), own_pids={777})
    assert "busy" not in line and "%" not in line
    assert f"isotui {3489660928 / GIB:.1f} GiB, 1 other" in line


@pytest.mark.parametrize("why", ["nvml-error", "absent"])
def test_header_falls_back_to_nvidia_smi_without_nvml(monkeypatch, why):
    _smi(monkeypatch)
    if why == "absent":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    else:  # installed, but the driver's library is missing
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=real.NVML_ERROR_LIBRARY_NOT_FOUND))
    gpus = sysinfo.query_gpus()
    assert [(g.index, g.free_mib, g.total_mib, g.processes) for g in gpus] == [
        (0, 57344, 81559, None),
        (1, 81050, 81559, None),
    ]
    assert sysinfo.describe_devices(gpus, own_pids={os.getpid()}).startswith(
        f"cuda:0 NVIDIA H100 80GB HBM3 ({57344 / 1024:.1f}/{81559 / 1024:.1f} GiB free)  cuda:1"
    )


def test_app_header_counts_the_apps_own_process_as_isotui(tmp_path, monkeypatch):
    from isotui.tui.app import IsotuiApp

    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(own_pid=os.getpid()))
    # the fake's samples are timed when it is made; a loaded machine may take longer than NVML's
    # window to start the app and probe, and the newest sample in any window is still the 64%
    monkeypatch.setattr(sysinfo, "UTIL_WINDOW_S", 3600.0)

    async def scenario() -> str:
        app = IsotuiApp(cache_root=tmp_path / "cache", export_dir=tmp_path)
        async with app.run_test(size=(200, 30)) as pilot:
            await _wait(pilot, lambda: app.device_line)  # the probe runs on a worker thread
            return app.sub_title

    assert f"isotui {3489660928 / GIB:.1f} GiB 64%, 1 other" in asyncio.run(scenario())
