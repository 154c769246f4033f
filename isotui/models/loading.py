"""Load a model and its tokenizer through transformers (imported here, lazily, never at start-up)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isotui.errors import IsotuiError
from isotui.models.naming import ModelRef, bundled_minilm_dir

# Modules that some architectures apply to the last hidden state before returning it.
FINAL_NORM_NAMES = ("ln_f", "norm", "norm_f", "final_layer_norm", "final_layernorm", "ln_final", "final_norm")


@dataclass
class LoadedModel:
    """A model in eval mode on its device, with its tokenizer and what the user should know."""

    model: Any
    tokenizer: Any
    notes: list[str] = field(default_factory=list)


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


def _short(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return first if len(first) < 300 else first[:297] + "..."


def load_model(ref: ModelRef, *, device: str, dtype: str, seed: int, trust_remote_code: bool) -> LoadedModel:
    """Load ``ref`` onto ``device`` in ``dtype``; every failure becomes one :class:`IsotuiError`."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    _quiet_transformers()
    torch_dtype = getattr(torch, dtype)
    if ref.kind == "random":
        return _load_random(ref, device=device, torch_dtype=torch_dtype, seed=seed, trust=trust_remote_code)
    folder = ref.local_dir()
    if folder is not None and ref.kind == "hub" and not _has_weights(folder):
        folder = None  # a partial download: let transformers fetch the rest of that commit
    where: Any = str(folder) if folder is not None else ref.source
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if folder is None and ref.revision:
        kwargs["revision"] = ref.revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    except Exception as exc:
        raise IsotuiError(f"could not load the tokenizer of model {ref.name!r}: {_short(exc)}") from None
    try:
        model = AutoModel.from_pretrained(where, dtype=torch_dtype, **kwargs)
    except Exception as exc:
        hint = "" if trust_remote_code else " (if it needs its own code, pass --trust-remote-code)"
        raise IsotuiError(f"could not load model {ref.name!r}: {_short(exc)}{hint}") from None
    return LoadedModel(model.to(device).eval(), tokenizer)


def _load_random(ref: ModelRef, *, device: str, torch_dtype: Any, seed: int, trust: bool) -> LoadedModel:
    import torch
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    notes: list[str] = []
    overrides = {k: _parse_value(v) for k, v in ref.overrides}
    kind = ref.random_source_kind
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
    for key, value in overrides.items():
        setattr(config, key, value)
    tokenizer = None
    if kind != "type":
        try:
            tokenizer = AutoTokenizer.from_pretrained(ref.source, trust_remote_code=trust)
        except Exception:
            tokenizer = None
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(bundled_minilm_dir()))
        notes.append("untrained model fed with the bundled MiniLM tokenizer (WordPiece, 30,522 ids)")
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab < len(tokenizer):
        config.vocab_size = len(tokenizer)
        notes.append(f"vocab_size raised from {vocab} to {len(tokenizer)} to fit the tokenizer")
    torch.manual_seed(seed)
    try:
        model = AutoModel.from_config(config, trust_remote_code=trust)
    except Exception as exc:
        raise IsotuiError(f"could not build untrained model {ref.name!r}: {_short(exc)}") from None
    notes.append(f"untrained: random initialisation with seed {seed}")
    return LoadedModel(model.to(device=device, dtype=torch_dtype).eval(), tokenizer, notes)


def final_norm_modules(model: Any) -> list[tuple[str, Any]]:
    """Candidate final norms: modules named like one, at most one level below the top
    (``ln_f``, ``model.norm``, ``decoder.final_layer_norm``), never inside the block stack."""
    found = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) <= 2 and parts[-1] in FINAL_NORM_NAMES:
            found.append((name, module))
    return found
