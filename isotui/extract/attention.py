"""Read queries, keys and attention probabilities out of any transformers model, batch by batch.

The probe is an attention function registered in transformers' ``AttentionInterface`` (with
the eager 4-D float mask): every attention module of the model calls it with the queries and
keys it computed (projection with bias, per head, after rotary embedding where the model rotates
them; keys before grouped-query repetition) and its mask. The probe computes the attention
exactly as the eager implementation does and folds statistics into per-module accumulators
(:mod:`isotui.core.attention`). Queries and keys before rotary embedding are read with forward
hooks on the projections (``q_proj``/``k_proj``, or GPT-NeoX's fused ``query_key_value``; after
``q_norm``/``k_norm`` where a model has them).

Layers are numbered as in the layer table: the attention of block i (0-based) is layer i + 1,
the block whose output is hidden-state row i + 1.
"""

from __future__ import annotations

import contextlib
import copy
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from isotui.core.accumulator import keep_smallest, sample_keys
from isotui.core.attention import AttentionAccumulator, HeadStats, VectorSums
from isotui.errors import IsotuiError
from isotui.extract.device import to_device
from isotui.extract.loop import Batch, BatchLoop, Hooks, merge_facts
from isotui.extract.memory_plan import device_name, measured_budget, size_text
from isotui.extract.planning import ExtractOptions, effective_max_length
from isotui.extract.progress import Progress, ProgressCallback, StopCheck
from isotui.models.loading import LoadedModel

PROBE = "isotui_probe"
_ACTIVE: dict[int, _ModuleProbe] = {}  # id(attention module) -> its probe, while a run is on
_LOCK = threading.Lock()
_UNSUPPORTED = ("softcap", "s_aux", "sinks")
CROSS_NAMES = ("encdecattention", "encoder_attn", "crossattention", "cross_attn")


def register_probe() -> None:
    """Make ``isotui_probe`` a valid attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(PROBE, probe_attention)
    AttentionMaskInterface.register(PROBE, eager_mask)


def _repeat_kv(x: Any, n: int) -> Any:
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def probe_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """Eager attention that also measures. Returns (output (B, T, H, d), probabilities)."""
    import torch

    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise IsotuiError(
                f"{type(module).__name__} uses attention {name!r}, which isotui's attention probe does "
                "not model; its queries and keys cannot be measured exactly"
            )
    if kwargs.get("sliding_window") is not None and attention_mask is None:
        raise IsotuiError(
            f"{type(module).__name__} uses sliding-window attention without a mask; isotui cannot "
            "tell which pairs it attends to"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    scores = torch.matmul(query.float(), _repeat_kv(key, groups).float().transpose(-1, -2))
    scores.mul_(scaling)  # in place: the same products as eager's ``* scaling``, one block less
    logits = scores
    bias = kwargs.get("position_bias")
    if bias is not None:  # T5: relative position bias, added like the eager implementation
        logits = logits + bias.float()
    allowed = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            allowed = attention_mask[:, :, :, : key.shape[-2]]
            logits = logits.masked_fill(~allowed, float("-inf"))
        else:
            mask = attention_mask[:, :, :, : key.shape[-2]]
            allowed = mask > torch.finfo(mask.dtype).min / 2
            logits = logits + mask.float()
    elif getattr(module, "is_causal", False) and query.shape[-2] > 1:
        t, s = query.shape[-2], key.shape[-2]
        allowed = torch.ones(t, s, dtype=torch.bool, device=query.device).tril(s - t)[None, None]
        logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if allowed is None:
        allowed = torch.ones((1, 1, *scores.shape[-2:]), dtype=torch.bool, device=scores.device)
    probe = _ACTIVE.get(id(module))
    if probe is not None:
        probe.observe(query, key, scores, probs, allowed)
    out = torch.matmul(probs.to(value.dtype), _repeat_kv(value, groups))
    return out.transpose(1, 2).contiguous(), probs


@dataclass
class ModuleSite:
    """Where an attention module sits: component, layer (block + 1), self or cross attention."""

    name: str
    component: str
    layer: int
    kind: str

    @property
    def order(self) -> tuple[int, int, bool]:
        return (
            {"encoder": 0, "model": 0, "decoder": 1}.get(self.component, 2),
            self.layer,
            self.kind == "cross",
        )


def site_of(name: str, encoder_decoder: bool) -> ModuleSite | None:
    """The site of the module named ``name`` (its dotted path), None if it is in no block."""
    numbers = re.findall(r"\.(\d+)(?:\.|$)", f".{name}")
    if not numbers:
        return None
    lowered = name.lower().replace("_", "")
    kind = "cross" if any(c.replace("_", "") in lowered for c in CROSS_NAMES) else "self"
    component = "model"
    if encoder_decoder:
        component = "encoder" if re.search(r"(^|\.)encoder(\.|$)", name) else "decoder"
    return ModuleSite(name, component, int(numbers[0]) + 1, kind)


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


class _ModuleProbe:
    """One attention module's accumulators, fed by :func:`probe_attention` and the hooks."""

    def __init__(self, site: ModuleSite, run: AttentionRun) -> None:
        self.site, self.run = site, run
        self.acc: AttentionAccumulator | None = None
        self.pre_q: VectorSums | None = None
        self.pre_k: VectorSums | None = None
        self.pre_raw: dict[str, Any] = {}
        self.q_sample = Subsample(run.sample_size, run.seed) if run.sample_size else None
        self.k_sample = Subsample(run.sample_size, run.seed + 1) if run.sample_size else None
        # whether queries differ before and after the rotary embedding: a plain bool, or a device
        # bool OR-ed batch by batch and read only at the end (:attr:`rope`)
        self._rope: Any = False

    @property
    def rope(self) -> bool:
        """Whether the model rotates queries and keys (read from the device once, at the end)."""
        return bool(self._rope)

    def save(self) -> tuple[Any, ...]:
        """What this probe holds before a batch (copies of the sums folded in place), so that
        :meth:`restore` can undo a batch the model did not finish (out of memory mid-forward)."""
        sums = (copy.deepcopy(self.acc), copy.deepcopy(self.pre_q), copy.deepcopy(self.pre_k))
        subsamples = (copy.copy(self.q_sample), copy.copy(self.k_sample))  # add() replaces, never edits
        return (*sums, *subsamples, self._rope)

    def restore(self, saved: tuple[Any, ...]) -> None:
        self.acc, self.pre_q, self.pre_k, self.q_sample, self.k_sample, self._rope = saved
        self.pre_raw.clear()

    def observe(self, q: Any, k: Any, scores: Any, probs: Any, allowed: Any) -> None:

        b, h, t, d = q.shape
        if b != len(self.run.sample_ids):
            raise IsotuiError(
                f"{self.site.name} attends within windows ({b} windows for {len(self.run.sample_ids)} "
                "samples, as Swin does); isotui's attention probe reads whole-sequence attention only"
            )
        if q.device.type == "mps":  # no float64 on MPS: measure on the CPU
            q, k, scores, probs, allowed = (x.cpu() for x in (q, k, scores, probs, allowed))
        q_keep, k_keep = self.run.keep_on(self.site, t, k.shape[-2], q.device)
        device = q.device
        if self.acc is None:
            self.acc = AttentionAccumulator(h, k.shape[1], d, device)
        self.acc.add(q, k, scores, probs, q_keep=q_keep, k_keep=k_keep, allowed=allowed)
        if self.q_sample is not None and self.k_sample is not None:
            ids = self.run.ids_on(device)
            self.q_sample.add(q, q_keep, ids)
            self.k_sample.add(k, k_keep, ids)
        if self.pre_raw:
            self._fold_pre_rope(q, k, q_keep, k_keep, device)

    def _fold_pre_rope(self, q: Any, k: Any, q_keep: Any, k_keep: Any, device: Any) -> None:
        """Queries and keys as projected, before rotary embedding (hooks filled ``pre_raw``)."""
        raw_q, raw_k = self.pre_raw.pop("q", None), self.pre_raw.pop("k", None)
        self.pre_raw.clear()
        if raw_q is None or raw_k is None:
            return
        pq = raw_q.reshape(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2)
        pk = raw_k.reshape(k.shape[0], k.shape[2], k.shape[1], k.shape[3]).transpose(1, 2)
        if self.pre_q is None or self.pre_k is None:
            self.pre_q = VectorSums(q.shape[1], q.shape[3], device)
            self.pre_k = VectorSums(k.shape[1], k.shape[3], device)
        if pq.shape != q.shape:
            self._rope = True
        elif self._rope is not True:  # on the device, no read: a tensor OR-ed per batch
            differs = (pq != q).any()
            self._rope = differs if self._rope is False else self._rope | differs
        self.pre_q.add(pq, q_keep)
        self.pre_k.add(pk, k_keep)


def _pre_rope_hooks(module: Any, probe: _ModuleProbe, hooks: Hooks) -> None:
    """Forward hooks that hand the projected queries/keys (before rotary) to ``probe``."""
    import torch

    def keep(slot: str, split: Any = None) -> Any:
        def hook(_m: Any, _args: Any, out: Any) -> None:
            if isinstance(out, tuple):
                out = out[0]
            probe.pre_raw[slot] = out if split is None else split(out)

        return hook

    children = dict(module.named_children())
    q_mod = children["q_norm"] if "q_norm" in children else children.get("q_proj")
    k_mod = children["k_norm"] if "k_norm" in children else children.get("k_proj")
    if q_mod is not None and k_mod is not None:
        hooks.forward(q_mod, keep("q"))
        hooks.forward(k_mod, keep("k"))
        return
    fused = children.get("query_key_value")
    if isinstance(fused, torch.nn.Module) and hasattr(module, "head_size"):  # GPT-NeoX: per head q|k|v
        hd = module.head_size

        def split(out: Any) -> Any:
            qkv = out.view(*out.shape[:-1], -1, 3 * hd)
            probe.pre_raw["k"] = qkv[..., hd : 2 * hd].flatten(-2)
            return qkv[..., :hd].flatten(-2)

        hooks.forward(fused, keep("q", split))


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


def _module_device(module: Any, run_device: str) -> str:
    """Where ``module`` makes its queries and keys, so where its subsamples live: its weights'
    device; the run's for weights accelerate keeps off it (offloaded: the meta device); the
    CPU for MPS (the probe measures on the CPU there: no float64)."""
    weight = next(module.parameters(), None)
    where = device_name(run_device if weight is None or weight.device.type == "meta" else weight.device)
    return "cpu" if where.startswith("mps") else where


class AttentionRun:
    """The attention probe's step on a :class:`BatchLoop` (its batching, devices, out-of-memory
    back-off and progress), with the probe in place of hidden-state hooks."""

    def __init__(self, loop: BatchLoop, *, sample_size: int) -> None:
        self.loop = loop
        self.loaded = loop.loaded
        self.model = loop.model
        self.sample_size = sample_size
        self.seed = loop.opts.seed
        self.probes: dict[int, _ModuleProbe] = {}
        self.masks: dict[tuple[Any, ...], Any] = {}  # (component, width[, device]) -> mask
        self.fed: Any = None
        self.sample_ids: Any = None
        self.ids: dict[Any, Any] = {}  # the batch's sample ids on each device that asked
        self.devices: dict[int, str] = {}  # id(attention module) -> where it makes its queries and keys
        self.previous: Any = None
        self.stale: list[tuple[Any, Any]] = []  # (a sub-model's config the switch missed, its implementation)

    @property
    def notes(self) -> list[str]:
        """The run's notes: the loop's (back-offs) and the probe's, in the order they came."""
        return self.loop.notes

    def install(self) -> None:
        if self.loaded.family != "transformers":
            raise IsotuiError(
                "attention statistics need a transformers model; timm models are not read by the probe"
            )
        register_probe()
        model = self.model
        self.previous = model.config._attn_implementation
        try:
            model.set_attn_implementation(PROBE)
        except Exception as exc:
            raise IsotuiError(
                f"{type(model).__name__} cannot switch its attention implementation ({exc}); isotui "
                "reads queries and keys through transformers' attention interface"
            ) from None
        enc_dec = bool(getattr(model.config, "is_encoder_decoder", False))
        for name, module in model.named_modules():
            if not (type(module).__name__.endswith("Attention") and hasattr(module, "config")):
                continue
            site = site_of(name, enc_dec)
            if site is None:
                continue
            if any(p.site.order == site.order for p in self.probes.values()):
                raise IsotuiError(
                    f"{type(model).__name__} nests its attention blocks in stages ({name}), so isotui "
                    "cannot number them as layers; the attention probe reads single-stack models"
                )
            if module.config._attn_implementation != PROBE:
                # transformers 5.0-5.19 switch only the top config: T5's encoder and decoder keep
                # their own copies (transformers 5.20 switches those too)
                self.stale.append((module.config, module.config._attn_implementation))
                module.config._attn_implementation = PROBE
            probe = _ModuleProbe(site, self)
            self.probes[id(module)] = probe
            self.devices[id(module)] = _module_device(module, self.loop.device)
            _pre_rope_hooks(module, probe, self.loop.hooks)
        self._size_subsamples()
        with _LOCK:
            _ACTIVE.update(self.probes)

    def _size_subsamples(self) -> None:
        """Shrink the per-module subsample so that all of them fit, on each device they live on
        (each module's: where its queries and keys are made), that device's measured free memory
        less the margin (:func:`~isotui.extract.memory_plan.measured_budget`, after the model is
        placed; queries and keys of every head take at most 2 x hidden size float32 per position).
        One size for all modules: the smallest any device allows."""
        if not self.sample_size or not self.probes:
            return
        config = self.model.config
        width = next(
            (getattr(config, a) for a in ("hidden_size", "d_model", "n_embd") if getattr(config, a, None)), 0
        )
        if not width:
            return
        size, tightest = self.sample_size, None
        for device in sorted(set(self.devices.values())):
            budget = measured_budget(device)
            if budget is None:
                continue
            modules = sum(1 for d in self.devices.values() if d == device)
            fit = max(2, budget // (modules * 2 * 4 * int(width)))
            if fit < size:
                size, tightest = fit, (device, budget)
        if tightest is not None:
            device, budget = tightest
            where = "the CPU" if device == "cpu" else device
            self.notes.append(
                f"query/key subsample capped at {size} positions per module (of {self.sample_size} asked) "
                f"to fit the {size_text(budget)} {where} has left (its measured free memory less a margin)"
            )
        for probe in self.probes.values():
            for sub in (probe.q_sample, probe.k_sample):
                if sub is not None:
                    sub.size = size

    def uninstall(self) -> None:
        self.loop.hooks.remove()
        with _LOCK:
            for key in self.probes:
                _ACTIVE.pop(key, None)
        for config, previous in reversed(self.stale):
            config._attn_implementation = previous
        self.stale.clear()
        with contextlib.suppress(Exception):  # the model is about to be dropped anyway
            self.model.set_attn_implementation(self.previous)

    def keep(self, site: ModuleSite, q_len: int, k_len: int) -> tuple[Any, Any]:
        """(B, T) query positions and (B, S) key positions that count, from the feeder's masks."""
        k_comp = "encoder" if site.kind == "cross" else site.component
        return self._mask(site.component, q_len), self._mask(k_comp, k_len)

    def keep_on(self, site: ModuleSite, q_len: int, k_len: int, device: Any) -> tuple[Any, Any]:
        """:meth:`keep` on ``device``, each mask moved there once per batch (issue 26: a copy
        from pageable memory waits for the device; every module shares it)."""
        q_comp, k_comp = site.component, "encoder" if site.kind == "cross" else site.component
        return self._mask_on(q_comp, q_len, device), self._mask_on(k_comp, k_len, device)

    def _mask_on(self, component: str, width: int, device: Any) -> Any:
        key = (component, width, str(device))
        if key not in self.masks:
            self.masks[key] = to_device(self._mask(component, width), device)
        return self.masks[key]

    def ids_on(self, device: Any) -> Any:
        """The batch's (B,) sample indices on ``device``, moved there once per batch."""
        if device not in self.ids:
            self.ids[device] = to_device(self.sample_ids, device)
        return self.ids[device]

    def _mask(self, component: str, width: int) -> Any:
        key = (component, width)
        if key not in self.masks:
            self.masks[key] = self.loop.keep(self.fed, component, width)
        return self.masks[key]

    def __call__(self, batch: Batch) -> int:
        """Run one batch under the probe; every module's statistics fold it in, or (when the
        model fails part-way, out of memory) none does."""
        import torch

        self.fed, self.masks = batch.fed, {}
        self.sample_ids, self.ids = batch.ids, {}
        saved = {key: probe.save() for key, probe in self.probes.items()}
        try:
            with self.loop.model_call("a batch under the attention probe"), torch.inference_mode():
                self.model(**batch.inputs, return_dict=True)
        except BaseException:
            for key, probe in self.probes.items():
                probe.restore(saved[key])
            raise
        if not any(p.acc is not None for p in self.probes.values()):
            raise IsotuiError(
                f"{type(self.model).__name__} does not compute attention through transformers' "
                "attention interface, so isotui cannot read its queries and keys"
            )
        return batch.units

    def results(self) -> list[ModuleResult]:
        return _module_results(p for p in self.probes.values() if p.acc is not None)

    def state(self) -> list[dict[str, Any]]:
        """Each measured module's folded state, in layer order (see :func:`extract_attention_state`)."""
        probes = sorted((p for p in self.probes.values() if p.acc is not None), key=lambda p: p.site.order)
        return [_probe_state(p) for p in probes]


@dataclass
class _Folded:
    """One module's state outside a run (a shard's, or merged shards'): what a probe holds."""

    site: ModuleSite
    acc: AttentionAccumulator
    rope: bool
    pre_q: VectorSums | None = None
    pre_k: VectorSums | None = None
    q_sample: Subsample | None = None
    k_sample: Subsample | None = None


def _probe_state(probe: _ModuleProbe | _Folded) -> dict[str, Any]:
    """A probe's (or :class:`_Folded`'s) state: tensors and plain scalars, nested by part."""
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


def _folded(state: dict[str, Any]) -> _Folded:
    return _Folded(
        site=ModuleSite(**state["site"]),
        acc=AttentionAccumulator.from_state(state["acc"]),
        rope=bool(state["rope"]),
        pre_q=_vector_sums(state["pre_q"]) if "pre_q" in state else None,
        pre_k=_vector_sums(state["pre_k"]) if "pre_k" in state else None,
        q_sample=Subsample.from_state(state["q_sample"]) if "q_sample" in state else None,
        k_sample=Subsample.from_state(state["k_sample"]) if "k_sample" in state else None,
    )


def _merge_folded(mine: _Folded, other: _Folded) -> None:
    if mine.site != other.site:
        raise ValueError(f"cannot merge the states of modules {mine.site.name} and {other.site.name}")
    mine.acc.merge(other.acc)
    mine.rope = mine.rope or other.rope
    for part in ("pre_q", "pre_k", "q_sample", "k_sample"):
        a, b = getattr(mine, part), getattr(other, part)
        if a is None:
            setattr(mine, part, b)
        elif b is not None:
            a.merge(b)


def _module_results(probes: Iterable[_ModuleProbe | _Folded]) -> list[ModuleResult]:
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
    run, facts = _stream_attention(
        loaded, samples, device, opts, on_progress, should_stop, model_name, modality, sample_size
    )
    return _finish_attention(run.results(), facts)


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
    run, facts = _stream_attention(
        loaded, samples, device, opts, on_progress, should_stop, model_name, modality, sample_size
    )
    return {**facts, "modules": run.state()}


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
) -> tuple[AttentionRun, dict[str, Any]]:
    """Run the batches under the probe; (the run with its probes, the facts to finish)."""
    loop = BatchLoop(loaded, device, opts, on_progress, should_stop)
    run = AttentionRun(loop, sample_size=sample_size)
    max_length = effective_max_length(loaded, opts, model_name, on_progress)
    loop.prepare(samples, modality, max_length)
    run.install()
    start = time.perf_counter()
    try:
        on_progress(Progress(0, loop.total, 0, 0.0))
        done = loop.run(run, phase="", start=start)
    finally:
        run.uninstall()
    facts = {
        "n_samples": loop.total,
        "n_tokens": done.units,
        "max_length": max_length,
        "seconds": time.perf_counter() - start,
        "notes": list(run.notes),
    }
    return run, facts
