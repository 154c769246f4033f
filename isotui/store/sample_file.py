"""The reservoir sample of a layer run as a file for analysis elsewhere (``--save-sample PATH``,
``save_sample=``): safetensors, the token texts in its header's metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from isotui.extract.sample import Sample
from isotui.store.files import write_output_bytes


def save_sample(sample: Sample, path: str | Path, meta: dict[str, Any], flag: str = "") -> Path:
    """Write ``sample`` as safetensors at ``path`` (written whole, then renamed into place):
    tensors ``{component}.{layer}.vectors`` (n x d float32), ``.token_ids``, ``.sample_index``
    and ``.position`` (int64); the header's metadata holds ``isotui`` (JSON: ``meta``, the
    components and their layer counts) and ``token_text`` (JSON: each token id present -> its
    text, as the tokenizer writes it)."""
    from safetensors.numpy import save

    arrays: dict[str, np.ndarray] = {}
    text: dict[str, str] = {}
    for component, layers in sample.items():
        for i, layer in enumerate(layers):
            arrays[f"{component}.{i}.vectors"] = np.ascontiguousarray(layer.vectors, dtype=np.float32)
            arrays[f"{component}.{i}.token_ids"] = layer.token_ids.astype(np.int64)
            arrays[f"{component}.{i}.sample_index"] = layer.sample_index.astype(np.int64)
            arrays[f"{component}.{i}.position"] = layer.position.astype(np.int64)
            text |= {str(int(t)): s for t, s in zip(layer.token_ids, layer.tokens, strict=True) if t >= 0}
    header = {**meta, "components": {c: len(layers) for c, layers in sample.items()}}
    metadata = {"isotui": json.dumps(header), "token_text": json.dumps(text, ensure_ascii=False)}
    return write_output_bytes(path, save(arrays, metadata=metadata), flag)
