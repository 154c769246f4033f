"""Issue 24: a ``--max-memory cpu=300MB`` run of a model that does not fit in it (half of its
blocks offloaded to disk) peaks, above the process's fixed baseline, within the CPU plan it
recorded +10%.

The model is an untrained GPT-2 saved to ``tmp_path``: d = 256, 12 blocks, ``n_inner`` 1,024,
the tests' 600-token BPE tokenizer; 38.7 MB of float32 weights, of which ``cpu=300MB`` (less
isotui's 256 MiB margin, its sums and its workspace) leaves accelerate about 16.5 MB in memory.

The run is the CLI (``main(["run", ...])``) in a fresh process. Its fixed baseline is what that
process holds after importing torch, transformers, accelerate and isotui and after a first,
warm-up run of the same command on the tests' 2-block GPT-2 (every code path once: the libraries'
code pages and BLAS/LAPACK's buffers are the process's, not this run's), a garbage collection
and a heap trim: there the resident size is read and the kernel's peak (``VmHWM``) reset through
``/proc/self/clear_refs``. The peak is read when the run has returned. The plan is what the run
recorded in its JSON: the CPU's weights, accumulators and the larger of its two workspaces
(folding a batch and finalising a layer), not recomputed here.

It does not hold yet (strict xfail: it fails the day it passes, so the mark goes). Measured here
(load 3-4 on 2 cores): 58.2 MB against 24.2 planned before a loaded model stopped making a
key/value cache and the drift correlation's exact Spearman table was cut; 39.8-41.7 MB after,
32.1 MB with ``MALLOC_MMAP_THRESHOLD_=131072``. What is left, sampled (``RssAnon``/``RssFile``
every 2 ms, the main thread's stack at each new peak; /proc/self/smaps): about 4.6 MB of
file-backed pages beyond the CPU weights accelerate keeps (those weights are the weight file's
mapped pages): 1.6 MB more of the weight file, the rest library code that this run touches first
(the warm-up offloads nothing to disk), about 3 MB of anonymous memory that loading and
tokenising leave, and glibc's heap, which keeps 6-9 MB of freed batch memory between its
trims; the forward's and the fold's own live bytes stay within the planned workspace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import _bpe_tokenizer, corpus

pytestmark = pytest.mark.slow

_MEASURE = r"""
import gc, json, re, sys
from pathlib import Path

def proc(field):
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024

import torch, transformers, accelerate  # noqa: F401
from isotui.cli import main
from isotui.extract.heap import release_free_memory

model, warm, data, out = sys.argv[1:5]
flags = ["--data", data, "--max-length", "32", "--batch-size", "4", "--reservoir", "1024",
         "--device-map", "auto", "--max-memory", "cpu=300MB", "--no-cache", "-q"]
assert main(["run", "-m", warm, *flags, "--json", out + ".warm"]) == 0
gc.collect()
release_free_memory()
before = {f: proc(f) for f in ("VmRSS", "RssAnon", "RssFile")}
Path("/proc/self/clear_refs").write_text("5")
assert main(["run", "-m", model, *flags, "--json", out]) == 0
after = {f: proc(f) for f in ("VmHWM", "RssAnon", "RssFile")}
print("MEASURED " + json.dumps({"base": before, "after": after}), flush=True)
"""


def _plan_of(found: object) -> dict | None:
    """The ``memory_plan`` a run's JSON export records (wherever it sits)."""
    if isinstance(found, dict):
        if isinstance(found.get("memory_plan"), dict):
            return found["memory_plan"]
        found = list(found.values())
    if isinstance(found, list):
        return next((p for p in map(_plan_of, found) if p is not None), None)
    return None


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak reset")
@pytest.mark.xfail(
    strict=True,
    reason="issue 24, open: 39.8-41.7 MB against 24.2 planned (58.2 before the key/value cache and "
    "the Spearman table were cut); what is left: glibc's heap keeping freed batch memory (32.1 MB "
    "with MALLOC_MMAP_THRESHOLD_=131072), file pages beyond the CPU weights (about 4.6 MB) "
    "and what loading and tokenising leave (about 3 MB), none of them in the plan",
)
def test_an_offloaded_run_under_max_memory_peaks_within_its_plan(tiny_models, tmp_path):
    import torch
    from transformers import GPT2Config, GPT2Model

    folder = tmp_path / "gpt2-12"
    _bpe_tokenizer(folder)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=600, n_embd=256, n_layer=12, n_head=4, n_inner=1024, n_positions=128)
    GPT2Model(config).save_pretrained(folder)
    texts = tmp_path / "corpus.txt"
    texts.write_text("\n".join(corpus(300)) + "\n", encoding="utf-8")
    out = tmp_path / "run.json"
    env = {**os.environ, "ISOTUI_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(folder), str(tiny_models["gpt2"]), f"text:{texts}", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("MEASURED ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-2000:]
    got = json.loads(line.removeprefix("MEASURED "))
    plan = _plan_of(json.loads(out.read_text()))
    assert plan is not None
    assert plan["weights_bytes"].get("disk", 0) > plan["weights_bytes"]["cpu"] > 0  # offloaded, half on disk
    cpu = (
        plan["weights_bytes"]["cpu"]
        + plan["accumulator_bytes"]["cpu"]
        + max(plan["transient_bytes"]["cpu"], plan["finalisation_bytes"]["cpu"])
    )
    base, after = got["base"], got["after"]
    peak = after["VmHWM"] - base["VmRSS"]
    anon = (after["RssAnon"] - base["RssAnon"]) / 1e6
    file = (after["RssFile"] - base["RssFile"]) / 1e6
    assert peak <= 1.1 * cpu, (
        f"the run peaked {peak / 1e6:.1f} MB above its baseline, more than its CPU plan "
        f"({cpu / 1e6:.1f} MB: weights, sums and workspace) + 10%; at its end {anon:+.1f} MB "
        f"anonymous and {file:+.1f} MB file-backed"
    )
