"""A model already in memory, handed to isotui as an object rather than named.

``isotui.run(model, tokenizer=tok)`` measures ``model`` where it sits: it is never copied, moved
or cast; it runs in eval mode during the run and gets its own train/eval flags back afterwards
(:meth:`GivenModel.kept`). The run takes the same path as a model loaded by name: the spec
carries the object (:attr:`isotui.spec.RunSpec.given`), :func:`isotui.experiments.layer_pass.prepare`
keys it by :meth:`GivenModel.fingerprint` and :func:`~isotui.experiments.layer_pass.load_prepared`
hands :meth:`GivenModel.loaded` to the extraction instead of loading weights.

Three kinds of object, each with its call convention:

- a transformers ``PreTrainedModel`` (text with ``tokenizer=``; images or audio with
  ``processor=``, else isotui's stand-in processor, said in the notes): called as a model
  loaded by name is;
- a timm model (``timm.create_model(...)``, or ``features_only=True``): images, its own
  transform from timm's data config unless ``processor=`` gives one (called per PIL image);
- any other ``torch.nn.Module``: called as ``module(input_ids=..., attention_mask=...)`` (text,
  with ``tokenizer=``; ``token_type_ids`` too when its forward takes them) or
  ``module(pixel_values=...)`` (images, with ``processor=``: a callable taking one PIL image to
  a (C, H, W) tensor, as a torchvision transform does), and returning its hidden states layer 0
  first: a tuple or list of tensors, each (batch, position, d), (batch, d) or (batch, C, H, W),
  or an object whose ``hidden_states`` attribute is such a tuple. It has no config to say how
  many positions it takes: the default max length is its tokenizer's, at most 512 (give
  ``max_length=``).

The cache key of an object is a fingerprint of what its numbers depend on (:meth:`fingerprint`):
SHA-256 over every parameter's and buffer's bytes, the module tree (``repr``: classes and sizes),
its config and its tokenizer's or processor's saved form. Chosen over "no cache" because a
notebook that asks twice gets the answer at once, and a changed weight, however small, is a
new key (a key never answers for other weights). The hash reads each tensor once, moving it to
the CPU in slices of at most :data:`SLICE_BYTES` (never the whole model), at SHA-256's speed on
one CPU core (0.57 GB/s measured on a loaded 2-core machine: about 2 s per GB of weights);
pass ``cache=False`` to skip it (a training loop measuring weights that change every step):
then no weight is read for a key (:meth:`GivenModel.unhashed` names the run instead).
What it does not see: forward hooks you registered on the model.

Around a run (:meth:`GivenModel.kept`) the object and the process get back what the run may
change: every module's train/eval flag and torch's intra-op thread count (a run sets it,
``threads=``; its inter-op threads are left alone with an object: torch cannot set them back).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isotui.errors import IsotuiError
from isotui.models.loading import LoadedModel

SLICE_BYTES = 64 << 20  # the most of a tensor on the CPU at once while hashing it


@dataclass
class GivenModel:
    """A model object with what turns samples into its inputs, and the name its rows carry.

    ``family``: ``transformers``, ``timm``, ``timm-blocks``, ``timm-features`` (as
    :class:`~isotui.models.loading.LoadedModel` says) or ``module`` (a plain ``torch.nn.Module``)."""

    model: Any
    name: str
    family: str
    modality: str
    tokenizer: Any = None
    processor: Any = None
    notes: list[str] = field(default_factory=list)
    _fingerprint: str | None = field(default=None, repr=False)

    @property
    def device(self) -> str:
        """Where its inputs go: the device of its first parameter (of accelerate's map's entry)."""
        placed = getattr(self.model, "hf_device_map", None)
        if placed:
            from isotui.extract.memory_plan import execution_device

            return execution_device(placed)
        offloaded = _execution_device(self.model)
        if offloaded is not None:
            return offloaded
        first = next((p for p in self.model.parameters()), None)
        return str(first.device) if first is not None else "cpu"

    @property
    def dtype(self) -> str:
        """The dtype it runs in: its first floating parameter's (``float32``, ``bfloat16``...)."""
        first = next((p for p in self.model.parameters() if p.is_floating_point()), None)
        return str(first.dtype).removeprefix("torch.") if first is not None else "float32"

    def loaded(self) -> LoadedModel:
        """The object as a loaded model (the same object, in eval mode: see :meth:`kept`)."""
        loaded = LoadedModel(
            self.model.eval(),
            self.tokenizer,
            list(self.notes),
            modality=self.modality,
            processor=self.processor,
            family=self.family,
            own_tokenizer=True,
            name=self.name,
            device_map=getattr(self.model, "hf_device_map", None) or None,
        )
        if self.modality == "text" and self.family == "transformers":
            from isotui.models.loading import check_tokenizer

            check_tokenizer(loaded)
        return loaded

    @contextmanager
    def kept(self) -> Iterator[None]:
        """Inside, the model may be put in eval mode and torch's threads set for the run; after,
        every module has its train/eval flag back as it was (a training loop's model goes on
        training) and torch its intra-op thread count."""
        import torch

        modes = [(m, m.training) for m in self.model.modules()]
        threads = torch.get_num_threads()
        try:
            yield
        finally:
            for module, training in modes:
                module.training = training
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def unhashed(self) -> str:
        """What names the object in the key of a run that caches nothing (``cache=False``):
        its kind and identity in this process, no weight read (the key names no cache entry)."""
        kind = f"{type(self.model).__module__}.{type(self.model).__qualname__}"
        return f"object:unhashed:{self.family}:{kind}:{id(self.model):x}"

    def fingerprint(self) -> str:
        """``object:sha256:...`` of the weights, structure, config and tokenizer or processor
        (see the module's doc); computed once per object handed in."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(
                f"{self.family}\n{type(self.model).__module__}.{type(self.model).__qualname__}\n".encode()
            )
            h.update(repr(self.model).encode())
            to_json = getattr(getattr(self.model, "config", None), "to_json_string", None)
            if callable(to_json):
                h.update(to_json(use_diff=False).encode())
            _hash_tensors(h, self.model, self.name)
            h.update(_saved_form(self.tokenizer if self.modality == "text" else self.processor).encode())
            self._fingerprint = "object:sha256:" + h.hexdigest()
        return self._fingerprint

    @property
    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def _execution_device(model: Any) -> str | None:
    """Where accelerate's ``cpu_offload`` / ``disk_offload`` runs a model whose weights wait on
    the meta device (its modules' hooks load them at each forward): the first hook's execution
    device; None for a model without such hooks."""
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for h in getattr(hook, "hooks", (hook,)):
            device = getattr(h, "execution_device", None)
            if device is not None:  # accelerate names a GPU by its index
                return f"cuda:{device}" if isinstance(device, int) else str(device)
    return None


def _hash_tensors(h: Any, model: Any, name: str) -> None:
    """Every parameter and buffer (the state dict: names, dtypes, shapes, bytes), each moved to
    the CPU in slices of at most :data:`SLICE_BYTES`."""
    import torch

    for key, tensor in model.state_dict(keep_vars=False).items():
        if tensor.device.type == "meta":
            raise IsotuiError(
                f"model {name!r} keeps {key} on the meta device (offloaded by accelerate), so isotui "
                "cannot fingerprint its weights for the cache; pass cache=False"
            )
        h.update(f"{key}:{tensor.dtype}:{list(tensor.shape)}\n".encode())
        raw = tensor.detach().contiguous().reshape(-1)
        raw = raw.view(torch.uint8) if raw.numel() else raw.to(torch.uint8)
        for start in range(0, raw.numel(), SLICE_BYTES):
            h.update(raw[start : start + SLICE_BYTES].cpu().numpy())  # its buffer: no copy


def _saved_form(part: Any) -> str:
    """A tokenizer's or processor's identity: the files ``save_pretrained`` writes (hashed),
    an image processor's JSON, else its ``repr`` (a torchvision transform lists its steps)."""
    if part is None:
        return ""
    save = getattr(part, "save_pretrained", None)
    if callable(save):
        with tempfile.TemporaryDirectory(prefix="isotui-given-") as folder:
            save(folder)
            h = hashlib.sha256()
            for f in sorted(Path(folder).rglob("*")):
                if f.is_file():
                    h.update(f.name.encode())
                    h.update(_without_call_state(f))
            return h.hexdigest()
    to_json = getattr(part, "to_json_string", None)
    return str(to_json()) if callable(to_json) else repr(part)


def _without_call_state(f: Path) -> bytes:
    """A saved tokenizer file's bytes; a fast tokenizer's ``tokenizer.json`` without its
    ``truncation`` and ``padding`` (the last call's settings, which it remembers: isotui passes
    its own on every call, so they never change a number)."""
    raw = f.read_bytes()
    if f.name != "tokenizer.json":
        return raw
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(doc, dict):
        doc.pop("truncation", None)
        doc.pop("padding", None)
    return json.dumps(doc, sort_keys=True).encode()


# keywords of a model *name* that say how to load it: meaningless for an object already loaded
LOADING_OPTIONS = {
    "device": "it runs on the device it sits on; move it first with model.to(device)",
    "device_map": "it is placed already; place it yourself (accelerate) before handing it in",
    "max_memory": "it is placed already; place it yourself (accelerate) before handing it in",
    "dtype": "it runs in the dtype it has; cast it first with model.to(dtype)",
    "trust_remote_code": "its code is already loaded",
    "shard": "shards run in separate processes, each loading the model by name; give its name or folder",
}


def refuse_loading_options(options: dict[str, Any]) -> None:
    """One sentence for the first loading keyword given (not None) with a model object."""
    for key, why in LOADING_OPTIONS.items():
        if options.get(key) is not None:
            raise IsotuiError(f"{key}= does not apply to a model object: {why}")


def given_model(
    model: Any, *, tokenizer: Any = None, processor: Any = None, name: str | None = None
) -> GivenModel:
    """``model`` (a torch.nn.Module) as a :class:`GivenModel`, or one sentence saying what is
    missing: a text model without ``tokenizer=``, a plain module with neither."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise IsotuiError(
            f"model must be a model name, a list of names or a torch.nn.Module (got {type(model).__name__})"
        )
    label = (
        name or str(getattr(getattr(model, "config", None), "name_or_path", "") or "") or type(model).__name__
    )
    if isinstance(tokenizer, str | Path):
        from isotui.models.loading import _given_tokenizer

        tokenizer = _given_tokenizer(str(tokenizer), False)
    _check_parts(tokenizer, processor)
    refuse_meta(model, label)
    family, modality, notes = _kind(model, label, tokenizer, processor)
    if modality == "text" and tokenizer is None:
        raise IsotuiError(
            f"model {label!r} ({type(model).__name__}) reads text: give its tokenizer as tokenizer= "
            "(e.g. AutoTokenizer.from_pretrained(...))"
        )
    if modality != "text" and tokenizer is not None:
        raise IsotuiError(
            f"model {label!r} ({type(model).__name__}) reads {modality}, not text: give processor=, "
            "not tokenizer="
        )
    if processor is None and modality != "text":
        processor, note = _default_processor(model, family)
        notes.append(note)
    return GivenModel(model, label, family, modality, tokenizer, processor, notes)


def _check_parts(tokenizer: Any, processor: Any) -> None:
    """One sentence for a ``tokenizer=`` that is not a Hugging Face tokenizer (nor the name or
    folder of one, loaded before this) and a ``processor=`` that cannot be called."""
    from transformers import PreTrainedTokenizerBase

    if tokenizer is not None and not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise IsotuiError(
            f"tokenizer= takes a Hugging Face tokenizer (e.g. AutoTokenizer.from_pretrained(...)) or "
            f"the hub id or folder of one, not {_shown(tokenizer)}"
        )
    if processor is not None and not callable(processor):
        raise IsotuiError(
            "processor= takes a callable from one image (or clip) to the model's input: a "
            f"transformers processor or a torchvision transform, not {_shown(processor)}"
        )


def _shown(value: Any) -> str:
    """``an int (123)``: a value's type and a short repr, for a sentence."""
    kind = type(value).__name__
    text = repr(value)
    text = text if len(text) <= 40 else text[:39] + "…"
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind} ({text})"


def refuse_meta(model: Any, label: str) -> None:
    """One sentence, with or without the cache, for a model whose weights sit on the meta device
    with nothing to bring them (built under ``init_empty_weights`` or ``torch.device("meta")``
    and never loaded): it has no numbers to run. A model offloaded by accelerate keeps weights on
    the meta device too, with hooks on its modules that load them at each forward: it runs."""
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        return
    tensors = model.state_dict(keep_vars=True)
    on_meta = [k for k, t in tensors.items() if t.device.type == "meta"]
    if not on_meta:
        return
    total = len(tensors)
    raise IsotuiError(
        f"model {label!r} ({type(model).__name__}) has {len(on_meta):,} of its {total:,} weights on the "
        f"meta device (e.g. {on_meta[0]}), which holds no values, so there is nothing to run: load its "
        "weights first (from_pretrained, or model.to_empty(device=...) then load_state_dict)"
    )


def _kind(model: Any, label: str, tokenizer: Any, processor: Any) -> tuple[str, str, list[str]]:
    """(family, modality, notes) of a model object."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        from isotui.models.loading import _modality

        return "transformers", _modality(model, label), []
    if type(model).__module__.startswith("timm."):
        return timm_family(model, label), "image", []
    if tokenizer is not None:
        return "module", "text", []
    if processor is not None:
        return "module", "image", []
    raise IsotuiError(
        f"model {label!r} is a plain torch.nn.Module: give tokenizer= (text, called as "
        "module(input_ids=..., attention_mask=...)) or processor= (images, module(pixel_values=...))"
    )


def timm_family(model: Any, label: str) -> str:
    """How isotui reads a timm model's layers: ``timm-blocks`` (a ViT: each block's tokens),
    ``timm`` (``forward_intermediates``) or ``timm-features`` (made with ``features_only``)."""
    if getattr(model, "num_prefix_tokens", None) is not None and len(getattr(model, "blocks", ())) > 0:
        return "timm-blocks"
    if hasattr(model, "forward_intermediates"):
        return "timm"
    if type(model).__name__ == "FeatureListNet":
        return "timm-features"
    raise IsotuiError(
        f"timm model {label!r} ({type(model).__name__}) offers neither forward_intermediates nor "
        "a features_only stage list; create it with timm.create_model(..., features_only=True)"
    )


def _default_processor(model: Any, family: str) -> tuple[Any, str]:
    """timm's own transform from its data config, or isotui's stand-in for transformers."""
    if family.startswith("timm"):
        import timm

        data_cfg = timm.data.resolve_data_config({}, model=model)
        return timm.data.create_transform(**data_cfg), "the transform of timm's data config for this model"
    if family == "module":
        raise IsotuiError("a plain torch.nn.Module reading images needs processor=")  # _kind made it text
    from isotui.models.processors import default_processor

    proc, note = default_processor(model)
    return proc, f"{note} (give processor= for the model's own)"


def describe(given: GivenModel) -> str:
    """One line for the notes: which object was measured, and where."""
    size = given.weights_bytes
    return (
        f"a {type(given.model).__name__} object in memory ({size / 1e6:.1f} MB of weights on "
        f"{given.device}, {given.dtype}), measured where it sits"
    )
