"""Attention statistics of every attention module of a transformers model, folded on the
measurement layer: the layer stream runs each batch under the attention probe
(:mod:`isotui.extract.attention_probe`) and hands each module's queries, keys, scores and
probabilities to its fold here (:class:`_ModuleFold`: the per-module accumulators of
:mod:`isotui.core.attention`, the sums before rotary embedding and the query/key subsamples).

Layers are numbered as in the layer table: the attention of block i (0-based) is layer i + 1,
the block whose output is hidden-state row i + 1.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, cast

import numpy as np

from isotui.core.accumulator import keep_smallest, sample_keys
from isotui.core.attention import AttentionAccumulator, HeadStats, VectorSums
from isotui.extract.attention_probe import ModuleSite
from isotui.extract.loop import BatchLoop, merge_facts
from isotui.extract.memory_plan import measured_budget, size_text
from isotui.extract.planning import ExtractOptions, effective_max_length
from isotui.extract.progress import Progress, ProgressCallback, StopCheck
from isotui.extract.runner import AttentionFold, AttentionFolds, AttentionView, LayerStream
from isotui.models.loading import LoadedModel


class Subsample:
    """A uniform subsample of the kept query (or key) positions of one module, all heads, chosen
    by :func:`sample_keys` over (sample, position): the same tokens whichever checkpoint of a
    model is read, and whatever the batching.

    Held on the device the queries and keys are made on and folded in without reading anything
    back: every position of a batch gets its key (+inf where it does not count, masked rather
    than dropped), and ``torch.topk`` keeps the ``size`` smallest of the old and new keys, a
    size known from the shapes alone. Slots still holding +inf (fewer kept positions than
    ``size`` so far) are dropped when read out (:meth:`array`, :meth:`state`, :meth:`merge`),
    in the order of the keys."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self.keys: Any = None  # (m,) float64, +inf in slots no kept position filled
        self.vectors: Any = None  # (H, m, d) float32, on the queries' (keys') device

    def add(self, x: Any, keep: Any, sample_ids: Any) -> None:
        """Fold in a batch's (B, H, T, d) vectors ``x``; ``keep``: (B, T) bool, the positions
        that count; ``sample_ids``: (B,) the batch's sample indices, on ``x``'s device."""
        import torch

        b, h, t, d = x.shape
        pos = torch.arange(t, device=x.device).expand(b, t)
        keys = sample_keys(self.seed + 7919, sample_ids[:, None].expand(b, t), pos)
        keys = keys.masked_fill(~keep, float("inf")).reshape(b * t)
        held = 0 if self.keys is None else len(self.keys)
        if self.keys is not None:
            keys = torch.cat([self.keys, keys])
        if len(keys) <= self.size:  # not full yet: every slot stays
            vec = x.permute(1, 0, 2, 3).reshape(h, b * t, d).float()
            self.keys = keys
            self.vectors = vec if self.vectors is None else torch.cat([self.vectors, vec], dim=1)
            return
        # the size smallest keys of old and new; only the chosen vectors are gathered, from the
        # batch (index past the held ones) or from the held ones, picked per slot on the device
        top = torch.topk(keys, self.size, largest=False).indices
        new = (top - held).clamp(min=0)
        vec = x[new // t, :, new % t, :].permute(1, 0, 2).float().contiguous()  # (H, size, d)
        if held:
            kept = self.vectors.index_select(1, top.clamp(max=held - 1))
            vec = torch.where((top < held)[None, :, None], kept, vec)
        self.keys, self.vectors = keys[top], vec

    def _read(self) -> tuple[Any, Any]:
        """(keys, vectors) on the CPU: the filled slots only, by key (one read, at the end)."""
        import torch

        keys, vectors = self.keys.cpu(), self.vectors.cpu()
        order = torch.argsort(keys)[: int(torch.isfinite(keys).sum())]
        return keys[order], vectors.index_select(1, order)

    def array(self) -> np.ndarray:
        return np.zeros((0, 0, 0), np.float32) if self.vectors is None else self._read()[1].numpy()

    def state(self) -> dict[str, Any]:
        """Size, seed and (once anything was seen) the keys and (H, m, d) vectors, on the CPU
        and in the order of the keys."""
        out: dict[str, Any] = {"size": self.size, "seed": self.seed}
        if self.keys is not None:
            keys, vectors = self._read()
            out |= {"keys": keys, "vectors": vectors}
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Subsample:
        sub = cls(int(state["size"]), int(state["seed"]))
        if "keys" in state:
            sub.keys, sub.vectors = state["keys"].clone(), state["vectors"].clone()
        return sub

    def merge(self, other: Subsample) -> None:
        """The subsample of the union: the smallest keys of both (keys are global)."""
        import torch

        if other.keys is None:
            return
        keys, vectors = other._read()
        if self.keys is not None:
            mine = self._read()
            keys, vectors = torch.cat([mine[0], keys]), torch.cat([mine[1], vectors], dim=1)
        keys, vectors = keep_smallest(keys, vectors, self.size, dim=1)
        order = torch.argsort(keys)
        self.keys, self.vectors = keys[order], vectors.index_select(1, order)


@dataclass
class _ModuleFold:
    """One attention module's state: its accumulators, the sums of its queries and keys before
    rotary embedding, its subsamples and whether the model rotates them (``rotated``: during a
    pass a plain bool, or a device bool OR-ed batch by batch and read only at the end,
    :attr:`rope`). During a pass, the module's :class:`~isotui.extract.runner.AttentionFold`;
    outside one, a shard's (or merged shards') state."""

    site: ModuleSite
    acc: AttentionAccumulator | None = None
    rotated: Any = False
    pre_q: VectorSums | None = None
    pre_k: VectorSums | None = None
    q_sample: Subsample | None = None
    k_sample: Subsample | None = None

    @property
    def rope(self) -> bool:
        """Whether the model rotates queries and keys (read from the device once, at the end)."""
        return bool(self.rotated)

    def partial(self, view: AttentionView) -> _ModuleFold:
        """This state with the batch folded in: copies of the sums folded in place (a
        subsample's add replaces its tensors, never edits them), so that a batch the model does
        not finish (out of memory) leaves this one as it was."""
        sums = (copy.deepcopy(self.acc), copy.deepcopy(self.pre_q), copy.deepcopy(self.pre_k))
        new = replace(self, acc=sums[0], pre_q=sums[1], pre_k=sums[2])
        new.q_sample, new.k_sample = copy.copy(self.q_sample), copy.copy(self.k_sample)
        new.add(view)
        return new

    def commit(self, sums: _ModuleFold) -> None:
        self.acc, self.rotated, self.pre_q, self.pre_k = sums.acc, sums.rotated, sums.pre_q, sums.pre_k
        self.q_sample, self.k_sample = sums.q_sample, sums.k_sample

    def add(self, v: AttentionView) -> None:
        """Fold one batch's view in place."""
        q, k = v.q, v.k
        if self.acc is None:
            self.acc = AttentionAccumulator(q.shape[1], k.shape[1], q.shape[3], q.device)
        self.acc.add(q, k, v.scores, v.probs, q_keep=v.q_keep, k_keep=v.k_keep, allowed=v.allowed)
        if self.q_sample is not None and self.k_sample is not None:
            self.q_sample.add(q, v.q_keep, v.ids)
            self.k_sample.add(k, v.k_keep, v.ids)
        if v.pre_q is not None and v.pre_k is not None:
            self._fold_pre_rope(v, v.pre_q, v.pre_k)

    def _fold_pre_rope(self, v: AttentionView, raw_q: Any, raw_k: Any) -> None:
        """Queries and keys as projected, before rotary embedding (as the hooks read them)."""
        q, k = v.q, v.k
        pq = raw_q.reshape(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2)
        pk = raw_k.reshape(k.shape[0], k.shape[2], k.shape[1], k.shape[3]).transpose(1, 2)
        if self.pre_q is None or self.pre_k is None:
            self.pre_q = VectorSums(q.shape[1], q.shape[3], q.device)
            self.pre_k = VectorSums(k.shape[1], k.shape[3], q.device)
        if pq.shape != q.shape:
            self.rotated = True
        elif self.rotated is not True:  # on the device, no read: a tensor OR-ed per batch
            differs = (pq != q).any()
            self.rotated = differs if self.rotated is False else self.rotated | differs
        self.pre_q.add(pq, v.q_keep)
        self.pre_k.add(pk, v.k_keep)


def _subsample_size(config: Any, devices: list[str], asked: int, notes: list[str]) -> int:
    """The per-module subsample: ``asked`` positions, or fewer so that all of them fit, on each
    device they live on (each module's: where its queries and keys are made), that device's
    measured free memory less the margin (:func:`~isotui.extract.memory_plan.measured_budget`,
    after the model is placed; queries and keys of every head take at most 2 x hidden size
    float32 per position). One size for all modules: the smallest any device allows."""
    width = next(
        (getattr(config, a) for a in ("hidden_size", "d_model", "n_embd") if getattr(config, a, None)), 0
    )
    if not asked or not width:
        return asked
    size, tightest = asked, None
    for device in sorted(set(devices)):
        budget = measured_budget(device)
        if budget is None:
            continue
        fit = max(2, budget // (devices.count(device) * 2 * 4 * int(width)))
        if fit < size:
            size, tightest = fit, (device, budget)
    if tightest is not None:
        device, budget = tightest
        where = "the CPU" if device == "cpu" else device
        notes.append(
            f"query/key subsample capped at {size} positions per module (of {asked} asked) "
            f"to fit the {size_text(budget)} {where} has left (its measured free memory less a margin)"
        )
    return size


@dataclass
class ModuleResult:
    """One attention module's heads, with the arrays the plots and the dynamics need."""

    site: ModuleSite
    heads: list[HeadStats]
    rope: bool
    pre_rope: list[tuple[float, float, float, float]] | None  # per head: |Q_bar|, |K_bar|, cos, dot
    histograms: np.ndarray
    q_bar: np.ndarray
    k_bar: np.ndarray
    q_sample: np.ndarray | None = None
    k_sample: np.ndarray | None = None


@dataclass
class AttentionExtraction:
    modules: list[ModuleResult]
    n_samples: int
    n_tokens: int
    max_length: int
    seconds: float
    notes: list[str] = field(default_factory=list)


def _probe_state(probe: _ModuleFold) -> dict[str, Any]:
    """A module's state: tensors and plain scalars, nested by part."""
    assert probe.acc is not None
    out: dict[str, Any] = {"site": asdict(probe.site), "rope": probe.rope, "acc": probe.acc.state()}
    for part in ("pre_q", "pre_k", "q_sample", "k_sample"):
        if getattr(probe, part) is not None:
            out[part] = getattr(probe, part).state()
    return out


def _vector_sums(state: dict[str, Any]) -> VectorSums:
    import torch

    heads, dim = state["sum"].shape
    sums = VectorSums(heads, dim, torch.device("cpu"))
    sums.load_state(state)
    return sums


def _folded(state: dict[str, Any]) -> _ModuleFold:
    return _ModuleFold(
        site=ModuleSite(**state["site"]),
        acc=AttentionAccumulator.from_state(state["acc"]),
        rotated=bool(state["rope"]),
        pre_q=_vector_sums(state["pre_q"]) if "pre_q" in state else None,
        pre_k=_vector_sums(state["pre_k"]) if "pre_k" in state else None,
        q_sample=Subsample.from_state(state["q_sample"]) if "q_sample" in state else None,
        k_sample=Subsample.from_state(state["k_sample"]) if "k_sample" in state else None,
    )


def _merge_folded(mine: _ModuleFold, other: _ModuleFold) -> None:
    if mine.site != other.site:
        raise ValueError(f"cannot merge the states of modules {mine.site.name} and {other.site.name}")
    assert mine.acc is not None and other.acc is not None  # states of modules that measured
    mine.acc.merge(other.acc)
    mine.rotated = mine.rope or other.rope
    for part in ("pre_q", "pre_k", "q_sample", "k_sample"):
        a, b = getattr(mine, part), getattr(other, part)
        if a is None:
            setattr(mine, part, b)
        elif b is not None:
            a.merge(b)


def _module_results(probes: Iterable[_ModuleFold]) -> list[ModuleResult]:
    """Per module, in layer order: heads, histograms, mean vectors and subsamples."""
    out = []
    for probe in sorted(probes, key=lambda p: p.site.order):
        acc = probe.acc
        assert acc is not None  # only modules that measured something
        pre = None
        if probe.pre_q is not None and probe.pre_k is not None and probe.rope:
            pre = _pre_summary(acc, probe.pre_q, probe.pre_k)
        out.append(
            ModuleResult(
                site=probe.site,
                heads=acc.finalize(),
                rope=probe.rope,
                pre_rope=pre,
                histograms=acc.histograms(),
                q_bar=acc.q.mean(),
                k_bar=acc.k.mean(),
                q_sample=probe.q_sample.array() if probe.q_sample else None,
                k_sample=probe.k_sample.array() if probe.k_sample else None,
            )
        )
    return out


def _pre_summary(
    acc: AttentionAccumulator, pre_q: VectorSums, pre_k: VectorSums
) -> list[tuple[float, float, float, float]]:
    qb, kb = pre_q.mean(), pre_k.mean()
    out = []
    for h in range(acc.heads):
        g = acc.kv_of(h)
        nq, nk = float(np.linalg.norm(qb[h])), float(np.linalg.norm(kb[g]))
        dot = float(qb[h] @ kb[g])
        out.append((nq, nk, dot / (nq * nk) if nq * nk > 0 else float("nan"), dot))
    return out


def extract_attention(
    loaded: LoadedModel,
    samples: Sequence[str],
    *,
    device: str,
    opts: ExtractOptions,
    on_progress: ProgressCallback,
    should_stop: StopCheck,
    model_name: str,
    modality: str,
    sample_size: int = 0,
) -> AttentionExtraction:
    """Attention statistics of every attention module of ``loaded`` over ``samples``."""
    folds, facts = _stream_attention(
        loaded, samples, device, opts, on_progress, should_stop, model_name, modality, sample_size
    )
    return _finish_attention(_module_results(folds), facts)


def extract_attention_state(
    loaded: LoadedModel,
    samples: Sequence[str],
    *,
    device: str,
    opts: ExtractOptions,
    on_progress: ProgressCallback,
    should_stop: StopCheck,
    model_name: str,
    modality: str,
    sample_size: int = 0,
) -> dict[str, Any]:
    """:func:`extract_attention`'s streamed state (over ``opts.sample_ids`` when it is a shard):
    per module its accumulators and subsamples. Merge shards with :func:`merge_attention_states`,
    end with :func:`finish_attention`."""
    folds, facts = _stream_attention(
        loaded, samples, device, opts, on_progress, should_stop, model_name, modality, sample_size
    )
    return {**facts, "modules": [_probe_state(f) for f in folds]}


def merge_attention_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state from disjoint shards of the same corpus: sums add, extremes min/max, the
    subsamples keep the smallest keys of the union."""
    facts = merge_facts(states)
    modules = [_folded(m) for m in states[0]["modules"]]
    for other in states[1:]:
        if len(other["modules"]) != len(modules):
            raise ValueError("cannot merge the states of runs that measured different modules")
        for mine, theirs in zip(modules, other["modules"], strict=True):
            _merge_folded(mine, _folded(theirs))
    return {**facts, "modules": [_probe_state(m) for m in modules]}


def finish_attention(state: dict[str, Any]) -> AttentionExtraction:
    """The statistics of a (possibly merged) :func:`extract_attention_state`."""
    return _finish_attention(_module_results(_folded(m) for m in state["modules"]), state)


def _finish_attention(modules: list[ModuleResult], facts: dict[str, Any]) -> AttentionExtraction:
    notes = list(facts["notes"])
    if any(m.site.kind == "self" and m.rope and m.pre_rope is None for m in modules):
        notes.append("queries and keys before rotary embedding could not be read for this architecture")
    return AttentionExtraction(
        modules=modules,
        n_samples=facts["n_samples"],
        n_tokens=facts["n_tokens"],
        max_length=facts["max_length"],
        seconds=facts["seconds"],
        notes=notes,
    )


def _stream_attention(
    loaded: LoadedModel,
    samples: Sequence[str],
    device: str,
    opts: ExtractOptions,
    on_progress: ProgressCallback,
    should_stop: StopCheck,
    model_name: str,
    modality: str,
    sample_size: int,
) -> tuple[list[_ModuleFold], dict[str, Any]]:
    """Run the batches under the probe, the layer stream's pass; (each module that measured
    something, in layer order, and the facts to finish)."""
    loop = BatchLoop(loaded, device, opts, on_progress, should_stop)

    def make(sites: list[ModuleSite], devices: list[str]) -> list[AttentionFold[Any]]:
        size = _subsample_size(loaded.model.config, devices, sample_size, loop.notes)
        subsample = (lambda seed: Subsample(size, seed)) if size else (lambda _seed: None)
        return [
            _ModuleFold(s, q_sample=subsample(opts.seed), k_sample=subsample(opts.seed + 1)) for s in sites
        ]

    stream = LayerStream(loop, type_uniform=False, attention_folds=AttentionFolds(make))
    max_length = effective_max_length(loaded, opts, model_name, on_progress)
    with loop.hooks:  # the probe comes out however the pass ends (prepare puts it in)
        stream.prepare(samples, modality, max_length)
        start = time.perf_counter()
        on_progress(Progress(0, loop.total, 0, 0.0))
        done = loop.run(stream, phase="", start=start)
    folds = cast("list[_ModuleFold]", list(stream.attention_made.values()))  # the folds make made
    facts = {
        "n_samples": loop.total,
        "n_tokens": done.units,
        "max_length": max_length,
        "seconds": time.perf_counter() - start,
        "notes": list(loop.notes),
    }
    return sorted((f for f in folds if f.acc is not None), key=lambda f: f.site.order), facts
