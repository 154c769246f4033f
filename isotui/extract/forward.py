"""One forward pass per model family, giving every hidden state per component.

transformers models return them with ``output_hidden_states=True`` (two components, ``encoder``
and ``decoder``, for encoder-decoder models); timm models give their intermediates, their
feature stages, or (ViTs) each block's token sequence read with hooks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from isotui.errors import IsotuiError
from isotui.extract.loop import Hooks
from isotui.models.loading import LoadedModel

HiddenStates = dict[str, tuple[Any, ...]]


def hidden_states(loaded: LoadedModel, inputs: dict[str, Any]) -> HiddenStates:
    """Hidden states per component (``model``, or ``encoder`` and ``decoder``)."""
    model = loaded.model
    if loaded.family == "timm":
        feats = model.forward_intermediates(inputs["pixel_values"], intermediates_only=True)
        return {"model": tuple(feats)}
    if loaded.family == "timm-features":  # a features_only model returns its stages
        return {"model": tuple(model(inputs["pixel_values"]))}
    if loaded.family == "timm-blocks":
        return {"model": _timm_blocks(model, inputs["pixel_values"])}
    with _layers_stay(model):
        out = model(**inputs, output_hidden_states=True, return_dict=True)
    enc, dec = getattr(out, "encoder_hidden_states", None), getattr(out, "decoder_hidden_states", None)
    if enc and dec:
        return {"encoder": tuple(enc), "decoder": tuple(dec)}
    hidden = getattr(out, "hidden_states", None)
    if not hidden:
        raise IsotuiError(
            f"model {type(model).__name__} returned no hidden states; isotui needs a model "
            "whose forward accepts output_hidden_states=True"
        )
    return {"model": tuple(hidden)}


@contextmanager
def _layers_stay(model: Any) -> Iterator[None]:
    """A model split by ``--device-map``: accelerate's top hook would gather every output (all
    hidden states) to the input's device; here each layer's stays where its block ran."""
    top: Any = getattr(model, "_hf_hook", None)
    gathering: list[Any] = [h for h in getattr(top, "hooks", (top,)) if getattr(h, "io_same_device", False)]
    for hook in gathering:
        hook.io_same_device = False
    try:
        yield
    finally:
        for hook in gathering:
            hook.io_same_device = True


def _timm_blocks(model: Any, pixels: Any) -> tuple[Any, ...]:
    """A timm ViT's token sequences, prefix tokens included: the input of its first block
    (patch and position embeddings, as a transformers model's layer 0), then every block's
    output. timm's forward_intermediates would drop the prefix tokens and the embeddings."""
    blocks = list(model.blocks)
    seen: list[Any] = []
    with Hooks() as hooks:
        hooks.pre(blocks[0], lambda _m, args: seen.append(args[0]))
        for block in blocks:
            hooks.forward(block, lambda _m, _i, out: seen.append(out))
        model.forward_features(pixels)
    return tuple(seen)
