"""Load a model and its tokenizer through transformers (imported here, lazily, never at start-up)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from isotui.errors import IsotuiError, NoHeadError
from isotui.models.naming import ModelRef, bundled_minilm_dir
from isotui.models.placement import quiet_accelerate as quiet_accelerate  # importable from here too
from isotui.models.placement import tied_weights_bug as tied_weights_bug

# Modules that some architectures apply to the last hidden state before returning it.
FINAL_NORM_NAMES = (
    "ln_f",
    "norm",
    "norm_f",
    "final_layer_norm",
    "final_layernorm",
    "ln_final",
    "final_norm",
    "layer_norm",  # Whisper's encoder/decoder, stable-layer-norm wav2vec 2.0
    "layernorm",
)


MODALITY_OF_INPUT = {
    "input_ids": "text",
    "pixel_values": "image",
    "input_values": "audio",  # wav2vec 2.0, HuBERT: raw waveform
    "input_features": "audio",  # Whisper: log-mel frames
}


@dataclass
class LoadedModel:
    """A model in eval mode on its device, with what turns samples into its inputs.

    ``tokenizer`` for text; ``processor`` for images and audio (a Hugging Face image processor or
    feature extractor, or isotui's stand-in when the checkpoint has none, said in ``notes``).
    ``family`` is ``transformers`` or ``timm`` (timm models have no hidden_states output: their
    intermediate features are taken instead).
    """

    model: Any
    tokenizer: Any
    notes: list[str] = field(default_factory=list)
    modality: str = "text"
    processor: Any = None
    family: str = "transformers"
    own_tokenizer: bool = True  # False: a stand-in (untrained models fed MiniLM's tokenizer, --tokenizer)
    name: str = ""  # as the user named the model, for messages
    device_map: dict[str, Any] | None = None  # --device-map: module -> device (accelerate's placement)
    resident_before: int | None = None  # this process's resident bytes just before loading it

    @property
    def model_type(self) -> str:
        config = getattr(self.model, "config", None)
        return getattr(config, "model_type", "") or ""


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))


def _quiet_transformers() -> None:
    """No weight-loading progress bars or advice banners in the middle of our own output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _parse_value(text: str) -> Any:
    """A config override value: JSON (2, 0.1, "x", [1,2]) or Python-style True/False/None."""
    python_words = {"True": True, "False": False, "None": None}
    if text in python_words:
        return python_words[text]
    try:
        return json.loads(text)
    except ValueError:
        return text


PICKLE_REFUSED = (
    "its weights are a pickle (.bin, .pt or .pth) that holds more than tensors; isotui reads a pickle "
    "only as plain tensors and never runs one (a pickle can run any code): use this model's "
    "safetensors weights (model.safetensors)"
)


def _short(exc: BaseException) -> str:
    """The first line of an error (with the next one when the first only introduces it)."""
    if "Weights only load failed" in str(exc):  # torch's advice ends at its unsafe switch: not ours
        return PICKLE_REFUSED
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    if first.endswith(":") and len(lines) > 1:  # "Validation error for field 'hidden_size':"
        first = f"{first} {lines[1]}"
    return first if len(first) < 300 else first[:297] + "..."


def _size_mismatch(where: str, kwargs: dict[str, Any]) -> str:
    """Which weights do not have the shapes the config gives: the model built on the meta device
    (no memory) against the safetensors headers of the weight files."""
    import torch
    from transformers import AutoConfig, AutoModel

    said = "its weights do not have the sizes its config gives (weights and config of different models?)"
    try:
        with torch.device("meta"):
            model = AutoModel.from_config(AutoConfig.from_pretrained(where, **kwargs))
        expected = {k: list(v.shape) for k, v in model.state_dict().items()}
        saved: dict[str, list[int]] = {}
        for f in sorted(Path(where).glob("*.safetensors")):
            with f.open("rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            saved |= {k: v["shape"] for k, v in header.items() if isinstance(v, dict) and "shape" in v}
    except Exception:
        return said
    prefix = getattr(model, "base_model_prefix", "")
    differ = []
    for name, shape in saved.items():
        mine = expected.get(name) or expected.get(name.removeprefix(f"{prefix}."))
        if mine is not None and mine != shape:
            differ.append((name, shape, mine))
    if not differ:
        return said
    name, shape, mine = differ[0]
    more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
    return (
        f"{said}: {name} is {shape} in the weights but {mine} for the config{more}; use the config.json "
        "saved with these weights"
    )


def load_model(
    ref: ModelRef,
    *,
    device: str,
    dtype: str,
    seed: int,
    trust_remote_code: bool,
    head: str | None = None,
    tokenizer: str | None = None,
    device_map: str | None = None,
    max_memory: Sequence[tuple[int | str, int]] | None = None,
) -> LoadedModel:
    """Load ``ref`` onto ``device`` in ``dtype``; every failure becomes one :class:`IsotuiError`.

    ``device_map`` (``--device-map``, with ``max_memory``): placed across devices by accelerate
    as transformers' ``from_pretrained(device_map=..., max_memory=...)`` places it (an untrained
    model is built, then dispatched by the same map), with layers that fit nowhere offloaded to a
    temporary folder; ``device`` is then ignored and ``loaded.device_map`` says where each part is.

    ``tokenizer`` (``--tokenizer``): a text model is fed this tokenizer instead of its own
    (``own_tokenizer`` False); without it, a checkpoint with no usable tokenizer of its own is
    refused (see :func:`check_tokenizer`) rather than measured on unknown tokens.

    ``head="lm"``: the model with its language-model head (masked LM for encoders, causal LM for
    decoders, see :func:`lm_class`) instead of the bare ``AutoModel``; a checkpoint that lacks
    the head's weights is refused in one sentence rather than given a random head.
    """
    from contextlib import AbstractContextManager, nullcontext

    from isotui.extract.device import fixed_cost

    before = fixed_cost()  # stated beside the plan (issue 36)
    placement, quiet = None, cast(AbstractContextManager[None], nullcontext())
    if device_map is not None:
        from isotui.extract.memory_values import check_devices

        check_devices(max_memory)
        placement, quiet = Placement(device_map, dict(max_memory) if max_memory else None), quiet_accelerate()
    with quiet:
        loaded = _load(
            ref,
            device=device,
            dtype=dtype,
            seed=seed,
            trust=trust_remote_code,
            head=head,
            tokenizer=tokenizer,
            placement=placement,
        )
    loaded.name, loaded.resident_before = ref.name, before
    _no_key_value_cache(loaded.model)
    if loaded.modality == "text" and tokenizer is not None and ref.kind != "random":
        loaded.tokenizer, loaded.own_tokenizer = _given_tokenizer(tokenizer, trust_remote_code), False
        loaded.notes.append(f"fed the tokenizer {tokenizer} (--tokenizer), not the model's own")
    if loaded.modality == "text" and ref.kind != "random":  # untrained: any tokenizer is a stand-in
        check_tokenizer(loaded)
    return loaded


def _no_key_value_cache(model: Any) -> None:
    """A decoder's forward keeps each block's keys and values for generation unless told not to
    (``use_cache``): 2 x layers x tokens x d values, as many as the hidden states themselves,
    alive until the forward returns and counted nowhere in the memory plan. isotui never
    generates, so a loaded model makes none (the hidden states are the same)."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False


@dataclass(frozen=True)
class Placement:
    """``--device-map`` and ``--max-memory`` as accelerate takes them."""

    device_map: str
    max_memory: dict[int | str, int] | None

    def load_kwargs(self, folder: str) -> dict[str, Any]:
        """from_pretrained's keywords: the map, the budgets and a folder for what fits nowhere."""
        return {"device_map": self.device_map, "max_memory": self.max_memory, "offload_folder": folder}

    def dispatch(self, model: Any, name: str) -> Any:
        """An already built (untrained) model placed by the map from_pretrained would make."""
        from accelerate import dispatch_model

        from isotui.models.placement import infer_device_map, refuse_all_on_disk

        folder = offload_dir(model)
        try:
            placed = infer_device_map(model, self.device_map, self.max_memory)
            refuse_all_on_disk(placed, name)
            model = dispatch_model(model, device_map=placed, offload_dir=folder)
        except IsotuiError:
            raise
        except Exception as exc:
            raise IsotuiError(
                f"--device-map {self.device_map}: could not place model {name!r} ({_short(exc)})"
            ) from None
        model.hf_device_map = placed
        return model

    def keep_new_weights_in_memory(
        self, model: Any, info: dict[str, Any], where: Any, dtype: Any, kwargs: dict[str, Any]
    ) -> Any:
        """``model``, or the same checkpoint loaded again with the modules whose weights it lacks
        (a pooler the checkpoint never trained) in CPU memory instead of on disk: accelerate
        offloads only the checkpoint's own tensors, so such a module fails at its first forward
        with a KeyError (transformers 5, accelerate 1.15). The reload keeps everything else where
        the first map put it."""
        placed: dict[str, Any] = dict(getattr(model, "hf_device_map", None) or {})
        owners = {k.rpartition(".")[0] for k in info.get("missing_keys", ())}
        if not any(placed.get(_entry(placed, o)) == "disk" for o in owners):
            return model
        for owner in owners:
            while (entry := _entry(placed, owner)) != owner and placed.get(entry) == "disk":
                device = placed.pop(entry)  # split the entry into its parts, each where it was
                parent = model.get_submodule(entry)
                prefix = f"{entry}." if entry else ""
                for name, _ in parent.named_children():
                    placed[prefix + name] = device
                own = [*parent.named_parameters(recurse=False), *parent.named_buffers(recurse=False)]
                for name, _ in own:
                    placed[prefix + name] = device
            if placed.get(owner) == "disk":
                placed[owner] = "cpu"
        cls = type(model)
        del model
        return cls.from_pretrained(
            where, dtype=dtype, **{**self.load_kwargs(offload_dir()), "device_map": placed}, **kwargs
        )


def _entry(placed: dict[str, Any], module: str) -> str:
    """The device map's entry that places ``module``: itself, or its nearest ancestor ('' is all)."""
    while module not in placed and module:
        module = module.rpartition(".")[0]
    return module


def offload_dir(owner: Any = None) -> str:
    """A fresh folder for the weights one model offloads to disk (never shared: accelerate
    reuses what a folder already holds), removed with ``owner`` or at exit."""
    import shutil
    import tempfile
    import weakref

    folder = tempfile.mkdtemp(prefix="isotui-offload-")
    if owner is not None:
        weakref.finalize(owner, shutil.rmtree, folder, True)
    else:
        import atexit

        atexit.register(shutil.rmtree, folder, True)
    return folder


@contextmanager
def readable(module: Any) -> Iterator[None]:
    """``module``'s own weights readable inside (on the CPU) even when ``--device-map`` offloaded
    them (accelerate keeps them on the meta device between forwards)."""
    if getattr(module, "_hf_hook", None) is None:
        yield
        return
    import torch
    from accelerate.utils import align_module_device

    with align_module_device(module, torch.device("cpu")):
        yield


def _placed(model: Any, device: str, placement: Placement | None, **to: Any) -> Any:
    """``model`` in eval mode where it goes: on ``device`` (in ``to``'s dtype), or as placed."""
    if placement is None:
        return model.to(device=device, **to).eval()
    return model.eval()


def _load(
    ref: ModelRef,
    *,
    device: str,
    dtype: str,
    seed: int,
    trust: bool,
    head: str | None,
    tokenizer: str | None,
    placement: Placement | None = None,
) -> LoadedModel:
    import torch
    from transformers import AutoModel, AutoTokenizer

    _quiet_transformers()
    trust_remote_code = trust
    torch_dtype = getattr(torch, dtype)
    if ref.kind == "timm" or (ref.kind == "random" and ref.random_source_kind == "timm"):
        if head:
            raise NoHeadError(f"model {ref.name!r} is a timm image model, which has no language-model head")
        if placement is not None:
            raise IsotuiError(f"--device-map places transformers models; {ref.name!r} is a timm model")
        return _load_timm(ref, device=device, torch_dtype=torch_dtype, seed=seed)
    if ref.kind == "random":
        return _load_random(
            ref,
            device=device,
            torch_dtype=torch_dtype,
            seed=seed,
            trust=trust_remote_code,
            head=head,
            tokenizer=tokenizer,
            placement=placement,
        )
    folder = ref.local_dir()
    if folder is not None and ref.kind == "hub" and not _has_weights(folder):
        folder = None  # a partial download: let transformers fetch the rest of that commit
    where: Any = str(folder) if folder is not None else ref.source
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if folder is None and ref.revision:
        kwargs["revision"] = ref.revision
    placing = placement.load_kwargs(offload_dir()) if placement is not None else {}
    try:
        with warnings.catch_warnings():  # torch warns of a pickle's protocol, then refuses it (said below)
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            if head:
                from transformers import AutoConfig

                cls = lm_class(AutoConfig.from_pretrained(where, **kwargs), ref.name)
                model, info = cls.from_pretrained(
                    where, dtype=torch_dtype, output_loading_info=True, **placing, **kwargs
                )
                _check_head(model, info, ref.name)
            else:
                model, info = AutoModel.from_pretrained(
                    where, dtype=torch_dtype, output_loading_info=True, **placing, **kwargs
                )
        if placement is not None:
            model = placement.keep_new_weights_in_memory(model, info, where, torch_dtype, kwargs)
    except IsotuiError:
        raise
    except Exception as exc:
        if placement is not None and tied_weights_bug(exc):
            raise IsotuiError(
                f"--device-map {placement.device_map} could not place model {ref.name!r} within "
                "--max-memory: transformers' device-map planner fails on its tied weights at this "
                "budget (a known bug, huggingface/transformers#35824); give --max-memory more or less"
            ) from None
        if "ignore_mismatched_sizes" in str(exc):  # its own text points at a report isotui hides
            raise IsotuiError(f"could not load model {ref.name!r}: {_size_mismatch(where, kwargs)}") from None
        own_code = not trust_remote_code and _names_own_code(where, kwargs)
        hint = " (it needs its own code: pass --trust-remote-code if you trust it)" if own_code else ""
        raise IsotuiError(f"could not load model {ref.name!r}: {_short(exc)}{hint}") from None
    loaded = LoadedModel(_placed(model, device, placement), None, modality=_modality(model, ref.name))
    loaded.device_map = getattr(model, "hf_device_map", None) if placement is not None else None
    if loaded.modality == "text":
        try:
            loaded.tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        except Exception as exc:
            raise IsotuiError(
                f"could not load the tokenizer of model {ref.name!r} ({_short(exc)}); pass the tokenizer it "
                "was trained with as --tokenizer NAME_OR_DIR"
            ) from None
    else:
        _attach_processor(loaded, where, kwargs)
    return loaded


def _names_own_code(where: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the checkpoint's config.json asks for code of its own (``auto_map``) or names a
    ``model_type`` this transformers does not know: only then is --trust-remote-code the advice."""
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config, _ = PretrainedConfig.get_config_dict(where, revision=kwargs.get("revision"))
    except Exception:
        return False  # no readable config: the load error itself says what is wrong
    model_type = config.get("model_type")
    return "auto_map" in config or (isinstance(model_type, str) and model_type not in CONFIG_MAPPING)


TOKENIZER_MIN_SHARE = 0.5  # a tokenizer covering less of the embedding table is not the model's
UNKNOWN_MAX_SHARE = 0.5  # more unknown tokens than this on the first samples: a foreign tokenizer
UNKNOWN_CHECK_SAMPLES = 64


def text_tokenizer(ref: ModelRef, *, tokenizer: str | None, trust: bool) -> Any | None:
    """The tokenizer :func:`load` feeds a text model of ``ref``, without its weights: what a dry
    run counts the corpus's tokens with (``--tokenizer``'s; an untrained model's own or the
    stand-in; else the checkpoint's). None where it cannot be had without loading the model
    (a timm model takes no text; a checkpoint whose tokenizer will not load: the run says why)."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    if ref.kind == "timm" or (ref.kind == "random" and ref.random_source_kind == "timm"):
        return None
    if tokenizer is not None:
        return _given_tokenizer(tokenizer, trust)
    if ref.kind == "random":
        return _random_tokenizer(ref, _random_config(ref, trust), trust, [])[0]
    folder = ref.local_dir()
    kwargs: dict[str, Any] = {"trust_remote_code": trust}
    if folder is None and ref.revision:
        kwargs["revision"] = ref.revision
    try:
        return AutoTokenizer.from_pretrained(str(folder) if folder is not None else ref.source, **kwargs)
    except Exception:
        return None


def _given_tokenizer(name: str, trust: bool) -> Any:
    """The tokenizer ``--tokenizer`` names: ``minilm``, a hub id, or a folder."""
    from transformers import AutoTokenizer

    where = str(bundled_minilm_dir()) if name == "minilm" else name
    try:
        return AutoTokenizer.from_pretrained(where, trust_remote_code=trust)
    except Exception as exc:
        raise IsotuiError(
            f"--tokenizer {name}: could not load it ({_short(exc)}); give a hub id, minilm, or a folder "
            "with tokenizer files"
        ) from None


def _fix_advice(loaded: LoadedModel) -> str:
    return (
        "pass the tokenizer it was trained with as --tokenizer NAME_OR_DIR"
        if loaded.own_tokenizer
        else "pass another one as --tokenizer NAME_OR_DIR"
    )


def check_tokenizer(loaded: LoadedModel) -> None:
    """Refuse a text model whose tokenizer cannot be the right one: its vocabulary covers less
    than half of the model's embedding table (transformers builds a 5-token tokenizer for a
    folder without tokenizer files, which turns every word into the unknown token)."""
    try:
        rows = getattr(loaded.model.get_input_embeddings(), "num_embeddings", None)
    except (AttributeError, NotImplementedError):  # CANINE hashes characters: no table to compare
        rows = None
    size = len(loaded.tokenizer)
    if isinstance(rows, int) and size < TOKENIZER_MIN_SHARE * rows:
        whose = "its tokenizer" if loaded.own_tokenizer else "the tokenizer given"
        raise IsotuiError(
            f"model {loaded.name!r} has {rows:,} token embeddings but {whose} knows only {size:,} tokens, "
            f"so most words would be fed as unknown; {_fix_advice(loaded)}"
        )


PLAIN_TEXT = "the cat sat on the mat and looked at the door"  # words any text tokenizer knows


def check_unknown_share(loaded: LoadedModel, ids: Any, special: Any) -> None:
    """Refuse a tokenizer that makes most of the first samples' tokens its unknown token."""
    unk = getattr(loaded.tokenizer, "unk_token_id", None)
    if not isinstance(unk, int):
        return
    words = ids[~special]
    if len(words) and (words == unk).mean() > UNKNOWN_MAX_SHARE:
        token = getattr(loaded.tokenizer, "unk_token", "unknown")
        try:  # a tokenizer that reads plain words: the data is what it cannot read
            probe = list(loaded.tokenizer(PLAIN_TEXT, add_special_tokens=False)["input_ids"])
        except Exception:
            probe = []
        if probe and sum(i == unk for i in probe) / len(probe) <= UNKNOWN_MAX_SHARE:
            limit = getattr(
                getattr(loaded.tokenizer, "wordpiece_tokenizer", None), "max_input_chars_per_word", 0
            )
            longest = f" (a word longer than its {limit} characters is one {token})" if limit else ""
            raise IsotuiError(
                f"{(words == unk).mean():.0%} of the first samples' tokens are the unknown token {token}, "
                f"though the tokenizer of model {loaded.name!r} reads plain words{longest}: the data is not "
                "text it can read (one huge word, a line of one repeated character, binary data?); "
                "check --data"
            )
        raise IsotuiError(
            f"the tokenizer of model {loaded.name!r} turns {(words == unk).mean():.0%} of the first "
            f"samples' tokens into the unknown token {token}; {_fix_advice(loaded)}"
        )


def _modality(model: Any, name: str) -> str:
    main = getattr(model, "main_input_name", "input_ids")
    if main not in MODALITY_OF_INPUT:
        raise IsotuiError(
            f"model {name!r} ({type(model).__name__}) takes {main!r}, which isotui cannot feed yet "
            "(it feeds input_ids, pixel_values, input_values and input_features)"
        )
    return MODALITY_OF_INPUT[main]


def _attach_processor(loaded: LoadedModel, where: Any, kwargs: dict[str, Any]) -> None:
    """The checkpoint's own image processor / feature extractor, or isotui's stand-in."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    auto = AutoImageProcessor if loaded.modality == "image" else AutoFeatureExtractor
    if where is not None:
        try:
            loaded.processor = auto.from_pretrained(where, **kwargs)
            return
        except Exception:
            pass
    from isotui.models.processors import default_processor

    loaded.processor, note = default_processor(loaded.model)
    loaded.notes.append(note)


def _load_timm(ref: ModelRef, *, device: str, torch_dtype: Any, seed: int) -> LoadedModel:
    """A timm model: pretrained (``timm:NAME``, weights from the hub cache) or untrained."""
    import torch

    try:
        import timm
    except ImportError:
        raise IsotuiError(f"model {ref.name!r} needs the timm package: pip install timm") from None
    pretrained = ref.kind == "timm"
    arch = ref.source if pretrained else ref.source[len("timm:") :]
    overrides = {k: _parse_value(v) for k, v in ref.overrides}
    if pretrained:
        ref.timm_hub_id()  # one sentence if there are no weights; resolve_commit already said offline
    elif not timm.models.is_model(arch.partition(".")[0]):
        raise IsotuiError(f"model {ref.name!r}: timm has no architecture {arch!r}")
    torch.manual_seed(seed)
    try:
        model = timm.create_model(arch, pretrained=pretrained, **overrides)
    except Exception as exc:
        raise IsotuiError(f"could not build timm model {ref.name!r}: {_short(exc)}") from None
    family = "timm"
    if getattr(model, "num_prefix_tokens", None) is not None and len(getattr(model, "blocks", ())) > 0:
        family = "timm-blocks"  # a ViT: tokens with their prefix (CLS...) and the embedding output
    elif not hasattr(model, "forward_intermediates"):  # older architectures: timm's stage hooks
        try:
            torch.manual_seed(seed)
            model = timm.create_model(arch, pretrained=pretrained, features_only=True, **overrides)
        except Exception as exc:
            raise IsotuiError(
                f"timm model {ref.name!r} offers neither forward_intermediates nor features_only "
                f"({_short(exc)}), so isotui cannot read its stages; pick another timm model"
            ) from None
        family = "timm-features"
    data_cfg = timm.data.resolve_data_config({}, model=model)
    transform = timm.data.create_transform(**data_cfg)
    notes = [] if pretrained else [f"untrained: random initialisation with seed {seed}"]
    return LoadedModel(
        model.to(device=device, dtype=torch_dtype).eval(),
        None,
        notes,
        modality="image",
        processor=transform,
        family=family,
    )


def _load_random(
    ref: ModelRef,
    *,
    device: str,
    torch_dtype: Any,
    seed: int,
    trust: bool,
    head: str | None = None,
    tokenizer: str | None = None,
    placement: Placement | None = None,
) -> LoadedModel:
    from transformers import AutoModel

    notes: list[str] = []
    kind = ref.random_source_kind
    config = _random_config(ref, trust)
    model_cls = lm_class(config, ref.name) if head else _model_class(config)
    modality = MODALITY_OF_INPUT.get(getattr(model_cls, "main_input_name", "input_ids"), "text")
    own_tokenizer = True
    tok: Any = None  # the tokenizer object (``tokenizer`` is --tokenizer's name)
    if modality == "text":
        if tokenizer is not None:
            tok, own_tokenizer = _given_tokenizer(tokenizer, trust), False
            notes.append(f"untrained model fed the tokenizer {tok.name_or_path} (--tokenizer)")
        else:
            tok, own_tokenizer = _random_tokenizer(ref, config, trust, notes)
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, int) and vocab < len(tok):
            config.vocab_size = len(tok)
            notes.append(f"vocab_size raised from {vocab} to {len(tok)} to fit the tokenizer")
    from isotui.models.untrained import build_untrained

    def factory() -> Any:
        return model_cls(config) if head else AutoModel.from_config(config, trust_remote_code=trust)

    try:  # built where it runs, in its dtype; the same weights for a seed on every device
        model = build_untrained(
            factory,
            device="cpu" if placement is not None else device,
            dtype=torch_dtype,
            seed=seed,
            name=ref.name,
        )
    except IsotuiError:
        raise
    except Exception as exc:
        raise IsotuiError(f"could not build untrained model {ref.name!r}: {_short(exc)}") from None
    if placement is not None:
        model = placement.dispatch(model, ref.name)
    loaded = LoadedModel(_placed(model, device, placement, dtype=torch_dtype), tok, notes)
    loaded.device_map = getattr(model, "hf_device_map", None) if placement is not None else None
    loaded.own_tokenizer = own_tokenizer
    loaded.modality = _modality(model, ref.name)
    if loaded.modality != "text":
        where = ref.source if kind != "type" else None
        _attach_processor(loaded, where, {"trust_remote_code": trust})
    notes.append(f"untrained: random initialisation with seed {seed}")
    return loaded


def model_config(ref: ModelRef, trust: bool) -> Any:
    """``ref``'s transformers config, without reading or downloading any weights (a dry run)."""
    from transformers import AutoConfig

    if ref.kind == "timm" or (ref.kind == "random" and ref.random_source_kind == "timm"):
        raise IsotuiError(f"--dry-run plans transformers models; {ref.name!r} is a timm model")
    if ref.kind == "random":
        return _random_config(ref, trust)
    folder = ref.local_dir()
    where: Any = str(folder) if folder is not None else ref.source
    kwargs: dict[str, Any] = {"revision": ref.revision} if folder is None and ref.revision else {}
    try:
        return AutoConfig.from_pretrained(where, trust_remote_code=trust, **kwargs)
    except Exception as exc:
        raise IsotuiError(f"could not read the config of model {ref.name!r}: {_short(exc)}") from None


def check_model_type(ref: ModelRef) -> None:
    """``random:TYPE``: one sentence when transformers has no model type TYPE, with the nearest
    one (``random:gtp2`` -> gpt2), not the hundreds it knows."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from isotui.suggest import did_you_mean

    if ref.source in CONFIG_MAPPING:
        return
    guess = did_you_mean(ref.source, CONFIG_MAPPING.keys(), spell="random:{}")
    takes = (
        "random:TYPE takes a transformers model_type such as bert, gpt2, gpt_neox or llama, or a "
        "config folder"
    )
    raise IsotuiError(
        f"model {ref.name!r}: transformers has no model type {ref.source!r}; "
        + (f"{guess} ({takes})" if guess else takes)
    )


def _random_config(ref: ModelRef, trust: bool) -> Any:
    """An untrained model's config: its model type's or source's, with the name's overrides."""
    from transformers import AutoConfig

    overrides = {k: _parse_value(v) for k, v in ref.overrides}
    kind = ref.random_source_kind
    if kind == "type":
        check_model_type(ref)
    try:
        if kind == "type":
            config = AutoConfig.for_model(ref.source)
        else:
            kwargs = {"revision": ref.revision} if ref.revision else {}
            config = AutoConfig.from_pretrained(ref.source, trust_remote_code=trust, **kwargs)
    except Exception as exc:
        raise IsotuiError(
            f"model {ref.name!r}: no configuration for {ref.source!r} ({_short(exc)}); use a "
            "transformers model_type such as bert, gpt2, gpt_neox or llama, or a config folder"
        ) from None
    unknown = [key for key in overrides if not hasattr(config, key)]
    if unknown:
        raise IsotuiError(
            f"model {ref.name!r}: {type(config).__name__} has no setting {unknown[0]!r}; "
            "check the spelling against the model's config.json"
        )
    try:
        if kind == "type":  # through the constructor, so derived settings follow (T5's num_decoder_layers)
            config = AutoConfig.for_model(ref.source, **overrides)
        else:
            for key, value in overrides.items():
                setattr(config, key, value)
    except Exception as exc:  # a value of the wrong type (hidden_size=abc): transformers validates it
        given = ", ".join(f"{k}={v}" for k, v in ref.overrides)
        raise IsotuiError(
            f"model {ref.name!r}: {type(config).__name__} refuses the settings {given} "
            f"({' '.join(str(exc).split())[:300]})"
        ) from None
    return config


def lm_class(config: Any, name: str) -> Any:
    """The language-model class for ``config``: masked LM for encoders (BERT, RoBERTa...), causal
    LM for decoders (GPT-2, Llama...); one sentence for anything else."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    if getattr(config, "is_encoder_decoder", False):
        raise IsotuiError(
            f"model {name!r} is an encoder-decoder; isotui's loss experiments (gradients, ablate) read "
            "single-stack language models (masked LM encoders or causal LM decoders)"
        )
    masked, causal = AutoModelForMaskedLM._model_mapping, AutoModelForCausalLM._model_mapping
    if type(config) in masked and not getattr(config, "is_decoder", False):
        return masked[type(config)]
    if type(config) in causal:
        return causal[type(config)]
    base = _model_class(config)
    main = getattr(base, "main_input_name", "input_ids") if base is not None else "input_ids"
    if main != "input_ids":
        raise NoHeadError(
            f"model {name!r} takes {main!r}, not text: a loss needs a language model (masked or causal LM)"
        )
    raise NoHeadError(
        f"model {name!r} ({type(config).__name__}) has no masked or causal language-model class in "
        "transformers, so it has no loss"
    )


def _check_head(model: Any, info: dict[str, Any], name: str) -> None:
    """Refuse a checkpoint whose language-model head would be freshly initialised (a base model)."""
    base = getattr(model, "base_model_prefix", "") or ""
    missing = sorted(k for k in info.get("missing_keys", ()) if not k.startswith(f"{base}."))
    if missing:
        raise NoHeadError(
            f"model {name!r} has no trained language-model head (its checkpoint lacks {missing[0]}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + f"); give the {type(model).__name__} checkpoint, or random:TYPE for an untrained one"
        )


def _model_class(config: Any) -> Any:
    """The AutoModel class for ``config`` (to learn its input before building it)."""
    from transformers import AutoModel

    mapping = AutoModel._model_mapping
    try:
        return mapping[type(config)]
    except KeyError:
        return None


def _random_tokenizer(ref: ModelRef, config: Any, trust: bool, notes: list[str]) -> tuple[Any, bool]:
    """(tokenizer, whether it is the model's own): the source's own tokenizer; a vocabulary-free
    one for byte/character models; else MiniLM's, a stand-in."""
    from transformers import AutoTokenizer

    if ref.random_source_kind != "type":
        try:
            return AutoTokenizer.from_pretrained(ref.source, trust_remote_code=trust), True
        except Exception:
            pass
    if getattr(config, "model_type", "") == "canine":
        from transformers import CanineTokenizer

        notes.append("untrained CANINE fed with its own character tokenizer (Unicode code points)")
        return CanineTokenizer(), True
    notes.append("untrained model fed with the bundled MiniLM tokenizer (WordPiece, 30,522 ids)")
    return AutoTokenizer.from_pretrained(str(bundled_minilm_dir())), False


def final_norm_modules(model: Any) -> list[tuple[str, Any]]:
    """Candidate final norms: modules named like one, at most one level below the top
    (``ln_f``, ``model.norm``, ``decoder.final_layer_norm``), never inside the block stack."""
    found = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) <= 2 and parts[-1] in FINAL_NORM_NAMES:
            found.append((name, module))
    return found
