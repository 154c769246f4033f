"""Issue 24: a 4-shard merge peaks at one shard state plus the running sum, +10%, in host memory.

Four shards of a wide untrained GPT-2 (d = 1,024: each layer's exact covariance alone is 8 MiB,
a state is tens of MB) are made through the CLI; the merge then runs in a fresh process, also
through the CLI. The measurement is the kernel's own: right before the merge starts (after a
garbage collection) the process's resident size is read and its peak (``VmHWM``) reset through
``/proc/self/clear_refs``, and the peak is read when the merged state reaches finalisation. So
the number is the merge's own high-water mark above what the process held just before it, and
neither the imports, the CLI nor the finalisation after it count. One state's size is read from
the shard files with safetensors (not through isotui), the running sum's from the merged state.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from isotui.cli import main

from .conftest import _bpe_tokenizer, corpus

WIDTH = 1024
LAYERS = 5  # 6 layer states per shard (embeddings and 5 blocks): per-layer transients stay small
SHARDS = 4

_MEASURE = r"""
import gc, json, re, sys
from pathlib import Path

def proc(field):
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024

import torch
from isotui.cli import main
from isotui.experiments import shards
from isotui.extract import runner

out = {}
merge, finish = shards.merge_cached, runner.finish_extraction

def measured_merge(*args, **kwargs):
    gc.collect()
    out["before"] = proc("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from the current RSS
    return merge(*args, **kwargs)

def at_finish(state):
    out["peak"] = proc("VmHWM")
    out["sum_bytes"] = sum(
        t.nbytes for layers in state["components"].values() for layer in layers
        for t in layer.values() if isinstance(t, torch.Tensor)
    )
    print("MEASURED " + json.dumps(out), flush=True)
    raise SystemExit(0)  # the finalisation is not the merge's

shards.merge_cached, runner.finish_extraction = measured_merge, at_finish
main(json.loads(sys.argv[1]))
"""


@pytest.fixture
def wide_model(tmp_path) -> Path:
    import torch
    from transformers import GPT2Config, GPT2Model

    folder = tmp_path / "wide"
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=600, n_embd=WIDTH, n_layer=LAYERS, n_head=8, n_inner=256, n_positions=64)
    GPT2Model(config).save_pretrained(folder)
    _bpe_tokenizer(folder)
    return folder


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak reset")
def test_a_four_shard_merge_peaks_at_one_state_plus_the_running_sum(wide_model, tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from isotui.experiments import shards

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(corpus(40)) + "\n", encoding="utf-8")
    cache = tmp_path / "cache"
    argv = ["run", "-m", str(wide_model), "--data", f"text:{texts}", "--max-length", "24"]
    argv += ["--batch-size", "4", "--cache-dir", str(cache), "-q"]
    monkeypatch.setattr(shards, "merge_cached", lambda *a, **k: None)  # the last shard keeps them
    for i in range(SHARDS):
        assert main([*argv, "--shard", f"{i}/{SHARDS}"]) == 0
    files = sorted((cache / "shards").glob("*.safetensors"))
    assert len(files) == SHARDS
    state_bytes = max(sum(a.nbytes for a in load_file(str(f)).values()) for f in files)
    assert state_bytes > 30e6  # big enough to stand out of the allocator's noise

    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps(argv)], capture_output=True, text=True, timeout=600
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("MEASURED ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-2000:]
    got = json.loads(line.removeprefix("MEASURED "))
    peak = got["peak"] - got["before"]
    bound = 1.1 * (state_bytes + got["sum_bytes"])
    assert peak <= bound, (
        f"the merge peaked {peak / 1e6:.1f} MB above its start, more than one state "
        f"({state_bytes / 1e6:.1f} MB) plus the running sum ({got['sum_bytes'] / 1e6:.1f} MB) + 10%"
    )
