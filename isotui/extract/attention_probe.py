"""The attention probe, the measurement layer's attention sites: an attention function
registered in transformers' ``AttentionInterface`` (with the eager 4-D float mask). Every
attention module of the model calls it with the queries and keys it computed (projection with
bias, per head, after rotary embedding where the model rotates them; keys before grouped-query
repetition) and its mask; the probe computes the attention exactly as the eager implementation
does and hands it to the module's observer (the layer stream's). Queries and keys before rotary
embedding are read with forward hooks on the projections (``q_proj``/``k_proj``, or GPT-NeoX's
fused ``query_key_value``; after ``q_norm``/``k_norm`` where a model has them). The attention of
block i (0-based) is layer i + 1, the block whose output is hidden-state row i + 1.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from isotui.errors import IsotuiError
from isotui.extract.loop import Hooks
from isotui.extract.memory_plan import device_name
from isotui.models.loading import LoadedModel

PROBE = "isotui_probe"
_ACTIVE: dict[int, Callable[..., None]] = {}  # id(attention module) -> its observer, while a pass is on
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
    observe = _ACTIVE.get(id(module))
    if observe is not None:
        observe(query, key, scores, probs, allowed)
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


def _module_device(module: Any, run_device: str) -> str:
    """Where ``module`` makes its queries and keys, so where its subsamples live: its weights'
    device; the run's for weights accelerate keeps off it (offloaded: the meta device); the
    CPU for MPS (the probe measures on the CPU there: no float64)."""
    weight = next(module.parameters(), None)
    where = device_name(run_device if weight is None or weight.device.type == "meta" else weight.device)
    return "cpu" if where.startswith("mps") else where


def _pre_rope_hooks(module: Any, raw: dict[str, Any], hooks: Hooks) -> None:
    """Forward hooks that put the projected queries/keys (before rotary) in ``raw``."""
    import torch

    def keep(slot: str, split: Any = None) -> Any:
        def hook(_m: Any, _args: Any, out: Any) -> None:
            if isinstance(out, tuple):
                out = out[0]
            raw[slot] = out if split is None else split(out)

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
            raw["k"] = qkv[..., hd : 2 * hd].flatten(-2)
            return qkv[..., :hd].flatten(-2)

        hooks.forward(fused, keep("q", split))


def install_probe(
    loaded: LoadedModel, hooks: Hooks, run_device: str, observe: Callable[..., None]
) -> list[tuple[ModuleSite, str]]:
    """Switch ``loaded``'s attention to the probe until ``hooks`` are removed: each attention
    module in a block hands what it computes to ``observe(site, raw, query, key, scores, probs,
    allowed)``, its hooks having put its queries and keys before rotary embedding in ``raw``
    (``q``, ``k``). Returns each module's site and the device it makes its queries and keys on."""
    if loaded.family != "transformers":
        raise IsotuiError(
            "attention statistics need a transformers model; timm models are not read by the probe"
        )
    register_probe()
    model = loaded.model
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(PROBE)
    except Exception as exc:
        raise IsotuiError(
            f"{type(model).__name__} cannot switch its attention implementation ({exc}); isotui "
            "reads queries and keys through transformers' attention interface"
        ) from None
    probed: dict[int, tuple[ModuleSite, str, dict[str, Any]]] = {}
    stale: list[tuple[Any, Any]] = []  # (a sub-model's config the switch missed, its implementation)

    def undo() -> None:
        with _LOCK:
            for key in probed:
                _ACTIVE.pop(key, None)
        for config, was in reversed(stale):
            config._attn_implementation = was
        with contextlib.suppress(Exception):  # the model is about to be dropped anyway
            model.set_attn_implementation(previous)

    hooks.undo(undo)
    enc_dec = bool(getattr(model.config, "is_encoder_decoder", False))
    for name, module in model.named_modules():
        if not (type(module).__name__.endswith("Attention") and hasattr(module, "config")):
            continue
        site = site_of(name, enc_dec)
        if site is None:
            continue
        if any(p[0].order == site.order for p in probed.values()):
            raise IsotuiError(
                f"{type(model).__name__} nests its attention blocks in stages ({name}), so isotui "
                "cannot number them as layers; the attention probe reads single-stack models"
            )
        if module.config._attn_implementation != PROBE:
            # transformers 5.0-5.19 switch only the top config: T5's encoder and decoder keep
            # their own copies (transformers 5.20 switches those too)
            stale.append((module.config, module.config._attn_implementation))
            module.config._attn_implementation = PROBE
        probed[id(module)] = (site, _module_device(module, run_device), {})
        _pre_rope_hooks(module, probed[id(module)][2], hooks)
    with _LOCK:
        _ACTIVE.update({key: functools.partial(observe, p[0], p[2]) for key, p in probed.items()})
    return [(site, device) for site, device, _raw in probed.values()]
