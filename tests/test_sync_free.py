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

from .conftest import corpus, in_package
from .test_gradients import lm_models as lm_models  # a fixture, used by name

TINY_GPT2 = "random:gpt2:n_layer=2,n_embd=64,n_head=4"
ROTARY = {  # partial rotary (a quarter of each head), and full rotary with grouped keys
    "gpt_neox": (
        "random:gpt_neox:hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64"
    ),
    "llama": (
        "random:llama:hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64,"
        "num_key_value_heads=2"
    ),
}
# no rotary embedding, but q_proj/k_proj hooks: the before/after comparison runs on every batch
TINY_BART = (
    "random:bart:d_model=32,encoder_layers=1,decoder_layers=1,encoder_attention_heads=4,"
    "decoder_attention_heads=4,encoder_ffn_dim=64,decoder_ffn_dim=64"
)

# per-batch device code: every function of the accumulator module, the stream's step, --exact's
# second pass and the gradient sums (folder/file: functions, None for all)
_DEVICE_FILES = {
    "core/accumulator.py": None,
    "extract/runner.py": {"__call__", "_vectors", "_observe"},
    "core/sampled.py": {"partial", "commit"},
    "core/gradients.py": {"add", "partial", "commit"},
    "extract/objective.py": {"loss"},
    "core/attention.py": None,
    "extract/attention_probe.py": {"probe_attention"},
    "extract/attention.py": {"partial", "add", "_fold_pre_rope"},
}
# steps that also prepare the batch on the host (its masks and token ids are host tensors: their
# nonzero / int / bool are no device reads): only explicit reads of a value count
_STEP_FILES = {"extract/runner.py": {"_backward"}}
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
        if in_package(path):
            name = f"{Path(path).parent.name}/{Path(path).name}"
            func = frame.f_code.co_name
            if func in _STEP_FILES.get(name, ()):
                return (name, func) if call in _STEP_READS else None
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

    from isotui.core import accumulator

    counts: Counter[str] = Counter()
    armed = [False]
    # the CPU reads counts on the host (free there: NaN/inf rows, the reservoir's entering
    # vectors); an accelerator's sync-free paths are the ones whose reads count
    monkeypatch.setattr(accumulator, "SYNC_FREE_ON_CPU", True)

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


def _reservoir_run(monkeypatch, traced: bool):
    """A reservoir of 25 over 8 batches (one larger than it, one where none enters), and what
    numpy says it must hold: (accumulator, every vector, every key, vectors with a direction,
    same-sample pairs). ``traced``: the accelerators' sync-free writes, else the CPU's."""
    import numpy as np
    import torch

    from isotui.core import accumulator
    from isotui.core.accumulator import LayerAccumulator, sample_keys

    monkeypatch.setattr(accumulator, "SYNC_FREE_ON_CPU", traced)
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
    return acc, np.concatenate(xs), np.concatenate(all_keys), n, pairs


def test_sync_free_reservoir_and_counts_match_numpy(monkeypatch):
    """The fixed-size reservoir writes keep exactly the K smallest keys of every vector seen (and
    their vectors), when some, more than K or none enter; the device counts equal numpy's, with
    zero vectors and an empty sample. The CPU's writes (only the entering vectors, issue 40) leave
    every slot as the accelerators' writes do."""
    import numpy as np

    slots = []
    for traced in (True, False):
        acc, x_all, keys_all, n, pairs = _reservoir_run(monkeypatch, traced)
        smallest = np.argsort(keys_all)[: acc.reservoir_size]
        assert acc.res is not None and acc.res_keys is not None
        order = np.argsort(acc.res_keys.numpy())
        np.testing.assert_array_equal(acc.res_keys.numpy()[order], keys_all[smallest])
        np.testing.assert_array_equal(acc.res.numpy()[order], x_all[smallest])
        assert (acc.n, acc.n_all, acc.pairs_within) == (n, len(x_all), pairs)
        slots.append((acc.res.numpy(), acc.res_keys.numpy()))
    np.testing.assert_array_equal(slots[0][0], slots[1][0])
    np.testing.assert_array_equal(slots[0][1], slots[1][1])


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


@pytest.mark.parametrize("model", sorted(ROTARY))
@pytest.mark.parametrize("sample", [16, 4096])  # 16: the subsample fills, then updates
def test_qk_dynamics_reads_nothing_back(tmp_path, monkeypatch, syncs, model, sample):
    """qk-dynamics (the probe with a query/key subsample) on rotary models, the GPU's path: the
    subsample is chosen on the device (positions that do not count get key +inf, topk on sizes
    known from shapes) and the rotary flag is a device bool, read once at the end."""
    from isotui.core import attention
    from isotui.experiments.qk_dynamics import Checkpoint, run_dynamics

    monkeypatch.setattr(attention, "CPU_PATHS", False)
    counts, armed = syncs
    calls = _arm_loop_steps(monkeypatch, armed)
    base = make_spec(ROTARY[model], _text(tmp_path), max_length=32, batch_size=3)
    series = [Checkpoint(ROTARY[model], "a", 0), Checkpoint(ROTARY[model], "b", 1)]
    result = run_dynamics(None, series, base, None, sample_size=sample)
    assert result is not None and result.rows
    assert calls[0] >= 8, "two checkpoints of several batches"
    assert all(math.isfinite(r.q_x_qk) for r in result.rows)
    assert dict(counts) == {}


def _subsample_reference(seen: list, seed: int, size: int):
    """The ``size`` smallest keys (numpy argsort) over every kept position ``seen`` (sample ids,
    positions, (n, H, d) vectors per batch), and their (H, m, d) vectors in key order."""
    import numpy as np
    import torch

    from isotui.core.accumulator import sample_keys

    ids = np.concatenate([s[0] for s in seen])
    pos = np.concatenate([s[1] for s in seen])
    vectors = np.concatenate([s[2] for s in seen])
    keys = sample_keys(seed + 7919, torch.from_numpy(ids), torch.from_numpy(pos)).numpy()
    assert len(np.unique(keys)) == len(keys)
    pick = np.argsort(keys)[:size]
    return keys[pick], vectors[pick].transpose(1, 0, 2)


def test_subsample_is_the_smallest_keys_of_the_kept_positions_by_hand():
    """Several batches (masked positions, a batch with none kept, more than the subsample at
    once), with slots still empty (+inf) or not, and two halves merged: exactly numpy's pick."""
    import numpy as np
    import torch

    from isotui.extract.attention import Subsample

    rng = np.random.default_rng(5)
    batches = []
    for i in range(6):
        b, t = 3, int(rng.integers(2, 9))
        x = rng.normal(size=(b, 2, t, 4)).astype(np.float32)
        keep = rng.random((b, t)) < (0.0 if i == 2 else 0.6)
        batches.append((np.arange(i * b, (i + 1) * b), x, keep))
    kept = sum(int(k.sum()) for _, _, k in batches)
    for size in (3, 20, kept - 1, kept + 5, 10_000):  # kept + 5: fewer kept than slots, more seen
        whole, halves = Subsample(size, 7), [Subsample(size, 7), Subsample(size, 7)]
        seen = []
        for j, (ids, x, keep) in enumerate(batches):
            for sub in (whole, halves[j % 2]):
                sub.add(torch.from_numpy(x), torch.from_numpy(keep), torch.from_numpy(ids))
            bi, ti = np.nonzero(keep)
            seen.append((ids[bi], ti, x[bi, :, ti, :]))
        want_keys, want = _subsample_reference(seen, 7, size)
        halves[0].merge(halves[1])
        for sub in (whole, halves[0]):
            state = sub.state()
            np.testing.assert_array_equal(state["keys"].numpy(), want_keys)
            np.testing.assert_array_equal(state["vectors"].numpy(), want)
            np.testing.assert_array_equal(sub.array(), want)


def test_the_gpus_subsample_is_the_cpus_and_numpys(tmp_path, monkeypatch):
    """The probe's subsamples on both paths, one pass and two shards merged: the vectors of the
    ``size`` smallest keys over every kept position the model produced (recorded as the probe
    received them), in key order; the merged shards pick the same tokens as the one pass."""
    import dataclasses

    import numpy as np

    from isotui.core import attention
    from isotui.experiments.layer_pass import extract_options, load_prepared, prepare
    from isotui.extract import attention as probe

    size = 24
    spec = make_spec(ROTARY["llama"], _text(tmp_path), max_length=32, batch_size=3)
    prepared = prepare(spec)
    loaded, device = load_prepared(prepared)
    seen: dict[tuple[str, str], list] = {}
    original = probe._ModuleFold.partial

    def spy(self, view):
        ids = view.ids.cpu().numpy()
        for part, x, keep in (("q_sample", view.q, view.q_keep), ("k_sample", view.k, view.k_keep)):
            bi, ti = np.nonzero(keep.cpu().numpy())
            vectors = x.float().cpu().numpy()[bi, :, ti, :]  # (n, H, d)
            seen.setdefault((self.site.name, part), []).append((ids[bi], ti, vectors))
        return original(self, view)

    monkeypatch.setattr(probe._ModuleFold, "partial", spy)

    def state(ids=None) -> dict:
        return probe.extract_attention_state(
            loaded,
            prepared.samples,
            device=device,
            opts=dataclasses.replace(extract_options(spec), sample_ids=ids),
            on_progress=lambda _e: None,
            should_stop=lambda: False,
            model_name=spec.model,
            modality="text",
            sample_size=size,
        )

    def check(got: dict) -> None:
        for module in got["modules"]:
            for part in ("q_sample", "k_sample"):
                sub = module[part]
                where = (module["site"]["name"], part)
                want_keys, want = _subsample_reference(seen[where], sub["seed"], size)
                assert len(want_keys) == size, "more kept positions than the subsample holds"
                np.testing.assert_array_equal(sub["keys"].numpy(), want_keys)
                np.testing.assert_array_equal(sub["vectors"].numpy(), want)

    paths = {}
    for cpu_paths in (True, False):
        monkeypatch.setattr(attention, "CPU_PATHS", cpu_paths)
        seen.clear()
        one = state()
        check(one)
        seen.clear()
        merged = probe.merge_attention_states([state((0, 3, 4, 8, 9, 11)), state((1, 2, 5, 6, 7, 10))])
        check(merged)
        for a, b in zip(one["modules"], merged["modules"], strict=True):
            for part in ("q_sample", "k_sample"):
                np.testing.assert_array_equal(a[part]["keys"].numpy(), b[part]["keys"].numpy())
                np.testing.assert_allclose(a[part]["vectors"].numpy(), b[part]["vectors"].numpy(), atol=1e-5)
        paths[cpu_paths] = one
    for a, b in zip(paths[True]["modules"], paths[False]["modules"], strict=True):
        for part in ("q_sample", "k_sample"):
            for key in ("keys", "vectors"):
                np.testing.assert_array_equal(a[part][key].numpy(), b[part][key].numpy())


@pytest.mark.parametrize("cpu_paths", [True, False])
def test_rotary_flag_on_both_paths(tmp_path, monkeypatch, cpu_paths):
    """The rotary flag (queries differ before and after the embedding, OR-ed over batches on the
    device): set for GPT-NeoX and Llama, not for GPT-2, whichever path measures."""
    from isotui.core import attention
    from isotui.experiments.attention import measure_attention

    monkeypatch.setattr(attention, "CPU_PATHS", cpu_paths)
    data = _text(tmp_path)
    models = ((ROTARY["gpt_neox"], True), (ROTARY["llama"], True), (TINY_GPT2, False), (TINY_BART, False))
    for name, rotary in models:
        rows = measure_attention(make_spec(name, data, max_length=32, batch_size=3), None, sample_size=8).rows
        assert rows and all(r.rope is rotary for r in rows), name
        assert all(math.isfinite(r.cos_qk_bar_pre_rope) == rotary for r in rows), name


def test_rotary_check_reads_nothing_back(tmp_path, monkeypatch, syncs):
    """A model without rotary embedding whose queries and keys are read before it too (BART's
    q_proj/k_proj): the comparison of before and after runs on every batch, on the device."""
    from isotui.core import attention
    from isotui.experiments.attention import measure_attention

    monkeypatch.setattr(attention, "CPU_PATHS", False)
    counts, armed = syncs
    calls = _arm_loop_steps(monkeypatch, armed)
    result = measure_attention(make_spec(TINY_BART, _text(tmp_path), max_length=32, batch_size=3), None)
    assert calls[0] >= 4 and result.rows and not any(r.rope for r in result.rows)
    assert dict(counts) == {}


# -- issue 26: where each tensor lives, traced; host-to-device copies from pageable memory -----------

_READS = {
    "item",
    "cpu",
    "tolist",
    "numpy",
    "nonzero",
    "unique",
    "unique_consecutive",
    "masked_select",
    "argwhere",
    "bincount",
    "equal",
    "allclose",
    "is_nonzero",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__array__",
}
_FACTORIES = {"zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint", "eye", "linspace"}


class _Ids:
    """Tensors by identity, forgotten when freed (a WeakSet compares tensors with ==)."""

    def __init__(self) -> None:
        self.ids: set[int] = set()

    def add(self, t) -> None:
        import weakref

        if id(t) not in self.ids:
            self.ids.add(id(t))
            weakref.finalize(t, self.ids.discard, id(t))

    def __contains__(self, t) -> bool:
        return id(t) in self.ids


class _Where:
    """A torch-function mode that follows where each tensor would live on a GPU (the CPU trace
    cannot tell): model weights and what is made from them, or made with an explicit ``device=``,
    are device tensors; the rest (token ids, masks, numpy) host tensors. While ``armed``, counts
    (1) a copy of a host tensor to the device unless it is pinned and non-blocking (a pageable
    copy waits for the device) and (2) every read of a device tensor on the host: ``.item()``,
    ``.cpu()``, ``nonzero``, a boolean mask, ``bincount``..., from isotui's own code (the
    model's forward is the bare forward's business)."""

    def __init__(self) -> None:
        from torch.overrides import TorchFunctionMode

        self.device = _Ids()
        self.pinned = _Ids()
        self.counts: Counter[str] = Counter()
        self.armed = False
        tracer = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                return tracer.after(func, args, kwargs, func(*args, **kwargs))

        self.mode = Mode()

    def on_device(self, t: object) -> bool:
        import torch

        return isinstance(t, torch.Tensor) and t in self.device

    def _any_device(self, items) -> bool:
        for a in items:
            if isinstance(a, list | tuple):
                if self._any_device(a):
                    return True
            elif self.on_device(a):
                return True
        return False

    def _mark(self, out, device: bool) -> None:
        import torch

        if not device:
            return
        for t in out if isinstance(out, list | tuple) else (out,):
            if isinstance(t, torch.Tensor):
                self.device.add(t)

    def count(self, what: str) -> None:
        if not self.armed:
            return
        where = _own_frame()
        if where is not None:
            self.counts[f"{what} in {where}"] += 1

    def after(self, func, args, kwargs, out):
        """Count what ``func`` did, mark where its result lives, and return it (a move that is a
        no-op on the CPU returns a copy, as a GPU would: the host tensor stays a host tensor)."""
        import torch

        name = getattr(func, "__name__", "")
        source = args[0] if args else None
        if name in ("to", "cuda", "pin_memory") and isinstance(source, torch.Tensor):
            target = kwargs.get("device")
            for a in args[1:]:
                if isinstance(a, torch.device | str | torch.Tensor):
                    target = a
            if name == "pin_memory":
                self.pinned.add(out)
                self._mark(out, self.on_device(source))
                return out
            if name == "cuda" or target is not None:
                if not self.on_device(source):
                    if not (source in self.pinned and kwargs.get("non_blocking")):
                        self.count("pageable host-to-device copy")
                    if out is source:
                        out = out.clone()
                self._mark(out, True)
                return out
        if name in ("as_tensor", "tensor") and kwargs.get("device") is not None:
            if not self.on_device(source):
                self.count(f"host-to-device copy by torch.{name}")
                if out is source:
                    out = out.clone()
            self._mark(out, True)
            return out
        if name in _FACTORIES or name.endswith("_like"):
            self._mark(out, kwargs.get("device") is not None or self._any_device(args))
            return out
        device = self._any_device(args) or self._any_device(list(kwargs.values()))
        bool_mask = name in ("__getitem__", "__setitem__") and any(
            isinstance(p, torch.Tensor) and p.dtype == torch.bool
            for p in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
        reads = name in _READS or bool_mask or (name == "where" and len(args) == 1)
        reads |= name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else None, torch.Tensor)
        if reads and device:
            self.count(f"{name}()")
        self._mark(out, device and name not in ("cpu", "numpy", "tolist", "item"))
        return out


def _own_frame() -> str | None:
    """``file:function`` of the isotui code that made the call (skipping torch's frames), or
    None when it is not isotui's (the model's forward, transformers, the tests)."""
    frame = sys._getframe(4)  # past this, count, after and the mode's __torch_function__
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" in path or "/contextlib.py" in path or "/weakref" in path:
            frame = frame.f_back
            continue
        if in_package(path):
            return f"{Path(path).parent.name}/{Path(path).name}:{frame.f_code.co_name}"
        return None
    return None


@pytest.fixture
def where(monkeypatch):
    """A :class:`_Where` over every pass of :class:`BatchLoop` (the model's weights are device
    tensors), armed from the second batch on: building the batch, moving it, the step. The CPU
    has no pinned memory: ``pin_memory`` is traced (a copy marked pinned)."""
    import torch

    from isotui.extract import device as device_module
    from isotui.extract.loop import BatchLoop

    tracer = _Where()
    monkeypatch.setattr(device_module, "PINNED_ON_CPU", True)

    def pin_memory(self, *_args, **_kwargs):
        pinned = self.clone()
        tracer.pinned.add(pinned)
        return pinned

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    original_run, original_attempt = BatchLoop.run, BatchLoop._attempt
    seen = [0]

    def run(self, step, *args, **kwargs):
        for t in (*self.model.parameters(), *self.model.buffers()):
            tracer.device.add(t)
        with tracer.mode:
            return original_run(self, step, *args, **kwargs)

    def attempt(self, step, idx, ledger=None):
        seen[0] += 1
        tracer.armed = seen[0] >= 2
        try:
            return original_attempt(self, step, idx, ledger)
        finally:
            tracer.armed = False

    monkeypatch.setattr(BatchLoop, "run", run)
    monkeypatch.setattr(BatchLoop, "_attempt", attempt)
    return tracer, seen


@pytest.mark.parametrize(
    "experiment", ["layers", "layers --exact", "final-norm", "gradients", "attention", "qk-dynamics"]
)
def test_no_pageable_copy_nor_read_of_a_device_tensor_per_batch(
    tmp_path, where, lm_models, experiment, monkeypatch
):
    """Issue 26 (about 23 syncs per batch on an H100 though the trace above found none): every
    host tensor a batch needs goes to the device pinned and non-blocking, and nothing made on the
    device is read back, anywhere in isotui's per-batch code (the loop, the stream, the
    accumulators, the experiments' steps), after the first batch."""
    from isotui.core import accumulator, attention

    monkeypatch.setattr(attention, "CPU_PATHS", False)  # the GPU's path of the probe
    monkeypatch.setattr(accumulator, "SYNC_FREE_ON_CPU", True)  # and of the NaN/inf count and the reservoir
    tracer, seen = where
    data = _text(tmp_path)
    if experiment.startswith("layers"):
        exact = "exact" in experiment
        spec = make_spec(TINY_GPT2, data, max_length=32, batch_size=3, reservoir=16, exact=exact)
        assert measure(spec, None).rows
    elif experiment == "final-norm":
        from isotui.experiments.final_norm import measure_final_norm

        measure_final_norm(make_spec(TINY_GPT2, data, max_length=32, batch_size=3, reservoir=16))
    elif experiment == "gradients":
        from isotui.experiments.gradients import measure_gradients

        measure_gradients(make_spec(str(lm_models["gpt2"]), data, max_length=32, batch_size=3), top_k=3)
    elif experiment == "attention":
        from isotui.experiments.attention import measure_attention

        measure_attention(make_spec(TINY_GPT2, data, max_length=32, batch_size=3), None)
    else:  # the probe with its query/key subsample, on a rotary model
        from isotui.experiments.qk_dynamics import Checkpoint, run_dynamics

        base = make_spec(ROTARY["llama"], data, max_length=32, batch_size=3)
        series = [Checkpoint(ROTARY["llama"], "a", 0)]
        assert run_dynamics(None, series, base, None, sample_size=16) is not None
    assert seen[0] >= 4
    assert dict(tracer.counts) == {}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_nonfinite_from_row_norms_counts_as_a_scan_of_every_value(monkeypatch, dtype):
    """The CPU's NaN/inf count (from the float64 row norms, then only the rows holding one)
    equals numpy's scan of every value, and the accelerators' path, for values at the ends of
    each dtype's range: a float32 row of 3e38s is finite, its norm too (issue 40)."""
    import numpy as np
    import torch

    from isotui.core import accumulator

    dt = getattr(torch, dtype)
    big = torch.finfo(dt).max
    x = torch.randn(50, 24, dtype=torch.float64).to(dt)
    x[3] = big  # finite at the top of the range: not counted
    x[7, 2], x[7, 5], x[9, 0], x[11, :] = math.nan, math.inf, -math.inf, math.nan
    x[20] = 0  # a zero row: no direction, not a bad one
    expect_values = int(np.count_nonzero(~np.isfinite(x.to(torch.float64).numpy())))
    expect_rows = int(np.count_nonzero(~np.isfinite(x.to(torch.float64).numpy()).all(1)))
    assert (expect_values, expect_rows) == (27, 3)
    norms = torch.linalg.vector_norm(x.to(torch.float64), dim=1)
    for traced in (False, True):
        monkeypatch.setattr(accumulator, "SYNC_FREE_ON_CPU", traced)
        values, rows = accumulator._nonfinite(x, norms)
        assert (int(values), int(rows.sum())) == (expect_values, expect_rows)
        assert rows.nonzero().flatten().tolist() == [7, 9, 11]


@pytest.mark.parametrize("traced", [False, True])
def test_type_sums_match_numpy_on_both_paths(monkeypatch, traced):
    """Self-similarity's per-type sums, with types repeated within a sample, zero vectors and
    untracked units: the CPU's (groups of one counted as 1, issue 40) and the accelerators'
    sync-free ones both equal numpy's sums over each (sample, type) group."""
    import numpy as np
    import torch

    from isotui.core import accumulator
    from isotui.core.accumulator import LayerAccumulator

    monkeypatch.setattr(accumulator, "SYNC_FREE_ON_CPU", traced)
    rng = np.random.default_rng(5)
    m, d, k, b = 60, 6, 4, 5
    x = rng.normal(size=(m, d))
    x[rng.random(m) < 0.1] = 0.0
    ids = np.sort(rng.integers(0, b, m))
    types = rng.integers(-1, k, m)  # -1: untracked
    acc = LayerAccumulator(d, torch.device("cpu"), full_cov=False, reservoir=8, types=k)
    u = torch.from_numpy(x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-300))
    nonzero = torch.from_numpy(np.linalg.norm(x, axis=1) > 0)
    got = acc._type_sums(u, torch.from_numpy(ids), torch.from_numpy(types), nonzero)
    live = (types >= 0) & nonzero.numpy()
    for t in range(k):
        at = live & (types == t)
        assert got["type_n"][t].item() == at.sum()
        np.testing.assert_allclose(got["type_u"][t].numpy(), u.numpy()[at].sum(0), atol=1e-12)
        groups = [u.numpy()[at & (ids == s)] for s in range(b)]
        within = sum(float(np.sum(g.sum(0) ** 2)) for g in groups)
        assert got["type_within"][t].item() == pytest.approx(within, rel=1e-12)
        assert got["type_within_n"][t].item() == sum(len(g) ** 2 for g in groups)
