"""A text model's token limit, read from its files without loading weights.

The cache key must name the max length a run will actually use, not the one asked for: a default
run and ``--max-length 512`` on MiniLM are the same computation. Extraction resolves the length
from the loaded model (:func:`isotui.extract.runner.resolve_max_length`); this module derives the
same number from ``config.json`` and ``tokenizer_config.json`` (for ``random:`` models, the
config object), so the key is known before anything is loaded. Both use :func:`default_length`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from isotui.models.naming import ModelRef, bundled_minilm_dir

DEFAULT_MAX_LENGTH_CAP = 512
POSITION_ATTRS = ("max_position_embeddings", "n_positions", "max_seq_len")
_TOKENIZER_LIMIT_CEILING = 1_000_000  # transformers' "no limit" is a huge integer


def config_position_limit(config: Any) -> int | None:
    """How many positions the embeddings have, from a config object or a config.json dict."""
    for attr in POSITION_ATTRS:
        value = config.get(attr) if isinstance(config, dict) else getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def tokenizer_limit(value: Any) -> int | None:
    """A tokenizer's ``model_max_length`` when it is a real limit."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < _TOKENIZER_LIMIT_CEILING:
        return value
    return None


def default_length(position_limit: int | None, tok_limit: int | None) -> int:
    """The max length a run uses when none is asked for: the model's and tokenizer's, at most 512."""
    return min([DEFAULT_MAX_LENGTH_CAP] + [v for v in (position_limit, tok_limit) if v])


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _tokenizer_file_limit(folder: Path) -> tuple[bool, int | None]:
    """(known, limit) from a folder's tokenizer_config.json; unknown when there is none."""
    data = _read_json(folder / "tokenizer_config.json")
    if data is None:
        return False, None
    return True, tokenizer_limit(data.get("model_max_length"))


def declared_default_length(ref: ModelRef) -> int | None:
    """The max length a default run of ``ref`` on text uses, or None when it cannot be known
    without loading the model (a hub model not downloaded, a folder without tokenizer_config.json,
    a random model whose tokenizer is not a file). None keeps the key as it was before."""
    try:
        if ref.kind == "random":
            return _random_default(ref)
        if ref.kind == "timm":
            return None
        folder = ref.local_dir()
        if folder is None:
            return None
        config = _read_json(folder / "config.json")
        known, tok = _tokenizer_file_limit(folder)
        if config is None or not known:
            return None
        return default_length(config_position_limit(config), tok)
    except Exception:  # an unreadable model says so when it loads; the key just stays as it was
        return None


def _random_default(ref: ModelRef) -> int | None:
    """For ``random:`` models: the config object (as loading builds it) and the tokenizer they get."""
    from transformers import AutoConfig

    from isotui.models.loading import _parse_value

    overrides = {k: _parse_value(v) for k, v in ref.overrides}
    kind = ref.random_source_kind
    if kind == "type":
        config = AutoConfig.for_model(ref.source, **overrides)
        if getattr(config, "model_type", "") == "canine":
            return None
        known, tok = _tokenizer_file_limit(bundled_minilm_dir())  # the stand-in tokenizer
    elif kind == "dir":
        folder = Path(ref.source).expanduser()
        config = AutoConfig.from_pretrained(str(folder))
        for key, value in overrides.items():
            setattr(config, key, value)
        known, tok = _tokenizer_file_limit(folder)
    else:
        return None
    return default_length(config_position_limit(config), tok) if known else None
