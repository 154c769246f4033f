"""``isotui models``: bundled models, presets and models in the local Hugging Face cache."""

from __future__ import annotations

from rich.console import Console

from isotui.models.hub import cached_models, hub_cache_dir
from isotui.paths import BUNDLED, resource_dir
from isotui.presets import presets
from isotui.render import Table


def print_models(console: Console) -> None:
    bundled = Table(title="bundled models", title_justify="left")
    bundled.add_column("name")
    bundled.add_column("what")
    for name, what in BUNDLED.items():
        bundled.add_row(name, what)
    bundled.add_row(
        "random:TYPE[:k=v,...]",
        "untrained model of a transformers model_type (seeded), e.g. random:gpt2:n_layer=2",
    )
    bundled.add_row("timm:NAME", "a timm model with its pretrained weights, e.g. timm:resnet50")
    bundled.add_row("random:timm:NAME", "an untrained timm model (seeded), e.g. random:timm:convnext_tiny")
    console.print(bundled)

    # Folder paths are printed as lines, not titles: a title wraps to the table's width.
    console.print(f"presets (isotui run PRESET), from {resource_dir('sample_configs')}", soft_wrap=True)
    table = Table()
    table.add_column("preset", no_wrap=True)
    for col in ("models", "data", "description"):
        table.add_column(col)
    for p in presets():
        table.add_row(p.path.stem, ", ".join(p.models), p.data, p.description)
    console.print(table)

    found = cached_models()
    console.print(f"models in the local Hugging Face cache, {hub_cache_dir()}", soft_wrap=True)
    cached = Table()
    for col in ("model", "revisions", "size"):
        cached.add_column(col)
    for m in found:
        cached.add_row(m.repo_id, ", ".join(m.revisions) or "-", f"{m.size_bytes / 2**20:.0f} MiB")
    if not found:
        cached.add_row("(none)", "", "")
    console.print(cached)
