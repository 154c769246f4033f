"""One forward pass per model family, giving every hidden state per component.

transformers models return them with ``output_hidden_states=True`` (two components, ``encoder``
and ``decoder``, for encoder-decoder models); timm models give their intermediates, their
feature stages, or (ViTs) each block's token sequence read with hooks. The layers run reads a
transformers model's layers one by one in hooks on its blocks (:func:`block_sites`,
:func:`watch_layers`) once its first batch showed they are the very tensors returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    if loaded.family == "module":  # a plain torch.nn.Module handed in (isotui.models.given)
        return {"model": _module_states(loaded, inputs)}
    config = getattr(model, "config", None)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):  # some transformers versions return
        if getattr(config, key, None) == 0:  # the embeddings alone, others nothing: refused alike
            raise IsotuiError(
                f"model {type(model).__name__} has no layers ({key}=0), so there are no hidden "
                f"states to measure; give it at least one ({key}=1)"
            )
    with layers_stay(model):
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
def layers_stay(model: Any) -> Iterator[None]:
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


Sites = dict[str, list[Any]]  # component -> its blocks, in order


def block_sites(loaded: LoadedModel) -> Sites:
    """Per component, the stack of blocks whose inputs and outputs should be the hidden states:
    the first list of modules of one class under the component's root (``encoder.layer``,
    ``h``, ``layers``, ``block``). A guess, which the caller checks against the hidden states
    the model returns before relying on it; empty for timm models (they have their own path)."""
    import torch

    model = loaded.model
    if loaded.family.startswith("timm") or loaded.family == "module":
        return {}
    roots = {"model": model}
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        get_enc, get_dec = getattr(model, "get_encoder", None), getattr(model, "get_decoder", None)
        if get_enc is None or get_dec is None:
            return {}
        roots = {"encoder": get_enc(), "decoder": get_dec()}
    out: Sites = {}
    for component, root in roots.items():
        for module in root.modules():
            if (
                isinstance(module, torch.nn.ModuleList)
                and len(module)
                and len({type(m) for m in module}) == 1
            ):
                out[component] = list(module)
                break
        else:
            return {}
    return out


def layer_tensor(i: int, args: tuple[Any, ...]) -> Any:
    """The hidden state a :func:`watch_layers` hook of layer ``i`` sees: layer 0 the first
    block's input (positional, or the ``hidden_states`` keyword), the others an output (a
    tensor, or the first item of a tuple or model output)."""
    if i == 0:
        inputs, kwargs = args
        return inputs[0] if inputs else kwargs.get("hidden_states")
    out = args[1]
    return out if hasattr(out, "ndim") else out[0]


def watch_layers(
    hooks: Hooks, blocks: list[Any], last: Any, hook_for: Callable[[int], Callable[..., None]]
) -> None:
    """Register ``hook_for(i)(module, *args)`` where layer ``i`` appears (see :func:`layer_tensor`):
    layer 0 before the first block, layer i after block i-1, the last after ``last`` (the final
    norm the model applies, when it does) or else after the last block."""
    hooks.pre(blocks[0], hook_for(0), with_kwargs=True)
    for i, block in enumerate(blocks):
        hooks.forward(last if last is not None and i == len(blocks) - 1 else block, hook_for(i + 1))


def _module_states(loaded: LoadedModel, inputs: dict[str, Any]) -> tuple[Any, ...]:
    """A plain module's hidden states by its call convention (isotui.models.given): a tuple or
    list of tensors, layer 0 first, or an object holding one as ``hidden_states``."""
    import torch

    out = loaded.model(**inputs)
    hidden = getattr(out, "hidden_states", out)
    if isinstance(hidden, torch.Tensor) or not isinstance(hidden, tuple | list) or not hidden:
        raise IsotuiError(
            f"model {loaded.name!r} ({type(loaded.model).__name__}) returned "
            f"{type(hidden).__name__}; a plain torch.nn.Module must return its hidden states, layer "
            "0 first: a tuple or list of (batch, position, d) tensors, or an object with hidden_states"
        )
    if not all(isinstance(h, torch.Tensor) for h in hidden):
        raise IsotuiError(
            f"model {loaded.name!r} ({type(loaded.model).__name__}) returned a sequence holding "
            "something other than tensors; its hidden states must be tensors, layer 0 first"
        )
    for i, h in enumerate(hidden):
        problem = vectors_problem(h, inputs)
        if problem is not None:
            raise IsotuiError(
                f"model {loaded.name!r} ({type(loaded.model).__name__}): its hidden state {i} {problem}; "
                "a plain module returns its hidden states, layer 0 first, one floating-point vector "
                "per input token"
            )
    return tuple(hidden)


def vectors_problem(h: Any, inputs: dict[str, Any]) -> str | None:
    """What keeps ``h`` (a hidden state a plain module returned, or a ``--modules`` site's
    tensor) from being the batch's vectors, said as the end of a sentence; None when nothing does.
    It must be floating-point (token ids handed back, ``input_ids``, are not vectors), have the
    batch's samples on its first axis and, for text, a (batch, position, d) tensor's positions
    must be the input's tokens one for one: a tensor of other positions (a prompt-tuned model's
    virtual tokens before the text, a pooled or cut sequence) cannot be matched to its tokens
    (padding, special tokens, token types), so its numbers would be wrong."""
    shape = tuple(int(n) for n in h.shape)
    if not h.is_floating_point():
        dtype = str(h.dtype).removeprefix("torch.")
        return (
            f"is {'an' if dtype.startswith(('i', 'u')) else 'a'} {dtype} tensor of shape {shape}: "
            "hidden states are floating-point vectors, not token ids or counts"
        )
    first = next(iter(inputs.values()), None)
    batch = int(first.shape[0]) if first is not None and first.ndim else None
    if batch is not None and (h.ndim < 2 or shape[0] != batch):
        return (
            f"has shape {shape} for a batch of {batch} samples: its first axis must be the batch, "
            "(batch, position, d), (batch, d) or (batch, C, H, W)"
        )
    ids = inputs.get("input_ids")
    if ids is not None and h.ndim == 3 and shape[1] != ids.shape[1]:
        return (
            f"has shape {shape} for input_ids of shape {tuple(int(n) for n in ids.shape)}: its "
            f"{shape[1]} positions are not the input's {int(ids.shape[1])} tokens, so isotui cannot "
            "tell which vector is which token (a prompt-tuned model adds virtual tokens: measure its "
            "base model)"
        )
    return None


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
