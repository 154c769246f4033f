"""The per-batch accumulation path reads nothing back from the device after the first batch
(issue 15): on a GPU every ``.item()``, ``.cpu()``, boolean-mask index or ``torch.unique`` per
layer per batch waits for the queue to drain. On the CPU the same calls are counted by wrapping
them; only calls made from the per-batch device code (the accumulators, the stream's step) count,
not the host-side preparation of the batch's inputs (masks, token ids: already on the host)."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import pytest

from isotui.experiments.layerwise import measure
from isotui.spec import make_spec

from .conftest import corpus
from .test_gradients import lm_models as lm_models  # a fixture, used by name

TINY_GPT2 = "random:gpt2:n_layer=2,n_embd=64,n_head=4"

# per-batch device code: every function of the accumulator module, the stream's step, --exact's
# second pass and the gradient sums (folder/file: functions, None for all)
_DEVICE_FILES = {
    "core/accumulator.py": None,
    "extract/runner.py": {"__call__", "_vectors"},
    "core/sampled.py": {"partial", "commit"},
    "core/gradients.py": {"add"},
    "core/attention.py": None,
}
# experiments' steps that also prepare the batch on the host (its masks and token ids are host
# tensors: their nonzero / int / bool are no device reads): only explicit reads of a value count
_STEP_FILES = {"experiments/final_norm.py": {"step"}, "experiments/gradients.py": {"step"}}
_STEP_READS = {"item", "cpu", "tolist", "numpy", "__float__", "__array__"}

# calls that read a device value on the host (explicitly, or implicitly through Python)
_SYNC_METHODS = (
    "item",
    "cpu",
    "tolist",
    "numpy",
    "nonzero",
    "unique",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__array__",
)
_SYNC_FUNCTIONS = ("unique", "nonzero", "masked_select", "argwhere")


def _caller(call: str) -> tuple[str, str] | None:
    """(file, function) of the nearest isotui frame, when it is per-batch device code."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{Path('isotui')}/" in path and "/tests/" not in path:
            name = f"{Path(path).parent.name}/{Path(path).name}"
            func = frame.f_code.co_name
            if name in _STEP_FILES:
                return (name, func) if func in _STEP_FILES[name] and call in _STEP_READS else None
            if name not in _DEVICE_FILES:
                return None
            funcs = _DEVICE_FILES[name]
            return (name, func) if funcs is None or func in funcs else None
        frame = frame.f_back
    return None


def _has_bool_mask(index: object) -> bool:
    import torch

    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


@pytest.fixture
def syncs(monkeypatch):
    """A Counter of host reads from per-batch device code, counted only while ``armed[0]``."""
    import torch

    counts: Counter[str] = Counter()
    armed = [False]

    def wrap(owner, name, check=None):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if armed[0] and (check is None or check(args)):
                where = _caller(name)
                if where is not None:
                    counts[f"{name} in {where[0]}:{where[1]}"] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in _SYNC_METHODS:
        wrap(torch.Tensor, name)
    for name in _SYNC_FUNCTIONS:
        wrap(torch, name)
    # boolean-mask indexing: the result's size is the mask's count, read on the host
    wrap(torch.Tensor, "__getitem__", lambda args: _has_bool_mask(args[1]))
    wrap(torch.Tensor, "__setitem__", lambda args: _has_bool_mask(args[1]))
    return counts, armed


def _arm_after_first_batch(monkeypatch, armed: list[bool]) -> list[int]:
    from isotui.extract.runner import LayerStream

    original = LayerStream.__call__
    calls = [0]

    def step(self, batch):
        calls[0] += 1
        armed[0] = calls[0] >= 2
        try:
            return original(self, batch)
        finally:
            armed[0] = False

    monkeypatch.setattr(LayerStream, "__call__", step)
    return calls


@pytest.mark.parametrize("reservoir", [16, 4096])  # 16: the reservoir fills, then updates
def test_no_host_sync_after_the_first_batch(tmp_path, monkeypatch, syncs, reservoir):
    counts, armed = syncs
    calls = _arm_after_first_batch(monkeypatch, armed)
    path = tmp_path / "t.txt"
    path.write_text("\n".join(corpus(12)) + "\n", encoding="utf-8")
    spec = make_spec(TINY_GPT2, f"text:{path}", max_length=32, batch_size=3, reservoir=reservoir)
    result = measure(spec, None)
    assert calls[0] >= 4, "the test needs several batches"
    assert result.rows and all(r.n_vectors > 0 for r in result.rows)
    assert dict(counts) == {}


def test_sync_free_reservoir_and_counts_match_numpy():
    """The fixed-size reservoir writes keep exactly the K smallest keys of every vector seen (and
    their vectors), when some, more than K or none enter; the device counts equal numpy's, with
    zero vectors and an empty sample."""
    import numpy as np
    import torch

    from isotui.core.accumulator import LayerAccumulator, sample_keys

    rng = np.random.default_rng(3)
    d, k, b = 8, 25, 4
    acc = LayerAccumulator(d, torch.device("cpu"), full_cov=False, reservoir=k)
    xs, all_keys, n, pairs = [], [], 0, 0
    for batch in range(8):
        m = 40 if batch == 4 else 20  # batch 4: more vectors than the reservoir holds
        ids = np.sort(rng.integers(0, b - (batch == 2), m))  # batch 2: its last sample is empty
        x = rng.normal(size=(m, d)).astype(np.float32)
        x[rng.random(m) < 0.2] = 0.0
        keys = sample_keys(0, torch.from_numpy(ids + b * batch), torch.arange(m))
        if batch == 7:  # no key small enough: nothing enters
            keys = torch.full((m,), 1.0 - 1e-12, dtype=torch.float64)
        acc.commit(acc.partial(torch.from_numpy(x), torch.from_numpy(ids), keys, None, None, b))
        live = np.linalg.norm(x, axis=1) > 0
        per = np.bincount(ids[live], minlength=b)
        n, pairs = n + int(live.sum()), pairs + int((per * (per - 1)).sum())
        xs.append(x)
        all_keys.append(keys.numpy())
    x_all, keys_all = np.concatenate(xs), np.concatenate(all_keys)
    smallest = np.argsort(keys_all)[:k]
    assert acc.res is not None and acc.res_keys is not None
    order = np.argsort(acc.res_keys.numpy())
    np.testing.assert_array_equal(acc.res_keys.numpy()[order], keys_all[smallest])
    np.testing.assert_array_equal(acc.res.numpy()[order], x_all[smallest])
    assert (acc.n, acc.n_all, acc.pairs_within) == (n, len(x_all), pairs)


def _arm_loop_steps(monkeypatch, armed: list[bool]) -> list[int]:
    """Arm the counter in every :class:`BatchLoop` step after the loop's first (any experiment)."""
    from isotui.extract.loop import BatchLoop

    original = BatchLoop.run
    calls = [0]

    def run(self, step, *args, **kwargs):
        first = [True]

        def traced(batch):
            calls[0] += 1
            armed[0] = not first[0]
            first[0] = False
            try:
                return step(batch)
            finally:
                armed[0] = False

        return original(self, traced, *args, **kwargs)

    monkeypatch.setattr(BatchLoop, "run", run)
    return calls


def _text(tmp_path, n: int = 12) -> str:
    path = tmp_path / "t.txt"
    path.write_text("\n".join(corpus(n)) + "\n", encoding="utf-8")
    return f"text:{path}"


def test_exact_second_pass_reads_nothing_back(tmp_path, monkeypatch, syncs):
    """--exact's second pass (ExactPass.partial/commit): counts stay on the device, zero vectors
    are masked rather than dropped, the live dimensions are an index picked once per layer."""
    counts, armed = syncs
    calls = _arm_loop_steps(monkeypatch, armed)
    spec = make_spec(TINY_GPT2, _text(tmp_path), max_length=32, batch_size=3, reservoir=16, exact=True)
    result = measure(spec, None)
    assert calls[0] >= 8, "two passes of several batches"
    assert result.meta["exact"] is True and all(r.avg_cos_abtt_se == 0.0 for r in result.rows)
    assert dict(counts) == {}


def test_final_norm_reads_nothing_back(tmp_path, monkeypatch, syncs):
    """Both sides of the norm go into sums beside the activations (no copy to the host)."""
    from isotui.experiments.final_norm import measure_final_norm

    counts, armed = syncs
    calls = _arm_loop_steps(monkeypatch, armed)
    measure_final_norm(make_spec(TINY_GPT2, _text(tmp_path), max_length=32, batch_size=3, reservoir=16))
    assert calls[0] >= 4
    assert dict(counts) == {}


def test_gradients_read_nothing_back(tmp_path, monkeypatch, syncs, lm_models):
    """The gradient sums count non-zero rows on the device; the loss is read once, at the end."""
    from isotui.experiments.gradients import measure_gradients

    counts, armed = syncs
    calls = _arm_loop_steps(monkeypatch, armed)
    spec = make_spec(str(lm_models["gpt2"]), _text(tmp_path), max_length=32, batch_size=3)
    result = measure_gradients(spec, top_k=3)
    assert calls[0] >= 4 and math.isfinite(result.meta["loss_per_token"])
    assert dict(counts) == {}


def test_attention_probe_sums_read_nothing_back(tmp_path, monkeypatch, syncs):
    """The probe's per-head sums (queries, keys, scores, softmax rows): positions that do not
    count are masked rather than dropped, the score histogram is counted by index_add_."""
    from isotui.core import attention
    from isotui.experiments.attention import measure_attention

    monkeypatch.setattr(attention, "CPU_PATHS", False)  # the GPU's path (the CPU's uses numpy)
    counts, armed = syncs
    calls = _arm_loop_steps(monkeypatch, armed)
    result = measure_attention(make_spec(TINY_GPT2, _text(tmp_path), max_length=32, batch_size=3), None)
    assert calls[0] >= 4 and result.rows
    assert dict(counts) == {}


def test_the_gpus_path_of_the_attention_sums_gives_the_cpus_numbers(tmp_path, monkeypatch):
    """The two paths of core/attention.py (numpy on the CPU; masked, read-free torch elsewhere)
    give the same table: traced above on the GPU's path, the CPU's is what users here run. The
    entropy agrees to float32's last bit per term: numpy's log and torch's differ there."""
    from dataclasses import asdict

    from isotui.core import attention
    from isotui.experiments.attention import measure_attention

    spec = make_spec(TINY_GPT2, _text(tmp_path), max_length=32, batch_size=3)
    cpu = measure_attention(spec, None).rows
    monkeypatch.setattr(attention, "CPU_PATHS", False)
    gpu = measure_attention(spec, None).rows
    assert len(cpu) == len(gpu) > 0
    for a, b in zip(cpu, gpu, strict=True):
        for key, value in asdict(a).items():
            if isinstance(value, float) and math.isfinite(value):
                rel = 1e-7 if key == "entropy" else 1e-12
                assert asdict(b)[key] == pytest.approx(value, rel=rel, abs=1e-15), key
            else:
                assert asdict(b)[key] == value or (value != value and asdict(b)[key] != asdict(b)[key]), key
