"""Issue 24: what offloading adds on the CPU beside the weights kept there (``offload_bytes``),
checked against the weight file's own header and against what a loaded model really maps.

A 12-block GPT-2 (d = 128, ``n_inner`` 512: MLP matrices of 256 kB) saved to ``tmp_path`` and
loaded by transformers with blocks 5-11 and the final norm on disk, the rest in memory. By hand,
from ``model.safetensors``' header: the largest module among those on disk (its own tensors) and,
for each tensor on disk, 64 KiB and a page (Linux maps 64 KiB around a read of a mapped file:
``fault_around_bytes``), at most the disk tensors' own pages and one window. Then the model runs
one batch, and the pages of the weight file that the process maps (``/proc/self/pagemap``), less
those of the tensors kept in memory, may not exceed what the plan counts for them (here they are
4.4 of the 5.4 MB on disk: tensors of 64-256 kB lie in a few 64 KiB windows each)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from .conftest import _bpe_tokenizer

PAGE = 4096
DISK_BLOCKS = range(5, 12)


def _device_map() -> dict[str, str]:
    return {
        "wte": "cpu",
        "wpe": "cpu",
        **{f"h.{i}": "disk" if i in DISK_BLOCKS else "cpu" for i in range(12)},
        "ln_f": "disk",
    }


def _header(path: Path) -> tuple[int, dict[str, dict]]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return 8 + n, header


def _on_disk(name: str) -> bool:
    return name.startswith("ln_f.") or any(name.startswith(f"h.{i}.") for i in DISK_BLOCKS)


@pytest.fixture
def offloaded(tmp_path):
    import torch
    from transformers import GPT2Config, GPT2Model

    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=600, n_embd=128, n_layer=12, n_head=4, n_inner=512, n_positions=64)
    GPT2Model(config).save_pretrained(folder)
    _bpe_tokenizer(folder)
    model = GPT2Model.from_pretrained(
        folder, device_map=_device_map(), offload_folder=str(tmp_path / "offload"), use_cache=False
    )
    return folder, model


def test_offload_bytes_is_the_largest_module_on_disk_and_its_tensors_first_pages(offloaded):
    from isotui.extract.memory_plan import offload_bytes

    folder, model = offloaded
    _, header = _header(folder / "model.safetensors")
    sizes = {k: (v["data_offsets"][1] - v["data_offsets"][0]) for k, v in header.items()}
    disk = {k: b for k, b in sizes.items() if _on_disk(k)}
    modules: dict[str, int] = {}
    for name, size in disk.items():
        owner = name.rpartition(".")[0]
        modules[owner] = modules.get(owner, 0) + size
    largest = max(modules.values())
    assert largest == 128 * 512 * 4 + 512 * 4  # an MLP matrix and its bias
    mapped = min(len(disk) * ((64 << 10) + PAGE), -(-sum(disk.values()) // PAGE) * PAGE + (64 << 10))
    assert offload_bytes(model, model.hf_device_map, "cpu") == {"cpu": largest + mapped}
    assert offload_bytes(model, None, "cpu") == {}  # not offloaded: nothing added
    # on a GPU run, every module kept off it comes to the GPU one at a time (here the CPU's
    # embedding, 600 x 128 float32, is the largest), the disk's through the CPU
    embedding = sizes["wte.weight"]
    assert embedding > largest
    assert offload_bytes(model, model.hf_device_map, "cuda:0") == {
        "cuda:0": embedding,
        "cpu": largest + mapped,
    }


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux's /proc/self/pagemap")
def test_the_weight_file_pages_a_run_maps_beyond_the_kept_weights_are_within_the_count(offloaded):
    import torch

    from isotui.extract.memory_plan import offload_bytes

    folder, model = offloaded
    with torch.no_grad():
        model(torch.randint(0, 600, (2, 16)), output_hidden_states=True)
    path = str((folder / "model.safetensors").resolve())
    base, header = _header(folder / "model.safetensors")
    maps = [
        line.split() for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(" " + path)
    ]
    assert maps, "the weight file is not mapped: the loader has changed how it reads it"
    kept: set[int] = set()  # file pages of the tensors kept in memory
    for name, info in header.items():
        if not _on_disk(name):
            start, end = (base + o for o in info["data_offsets"])
            kept.update(range(start // PAGE, -(-end // PAGE)))
    extra = 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        for fields in maps:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            offset = int(fields[2], 16) // PAGE
            pagemap.seek(low // PAGE * 8)
            entries = struct.unpack(f"<{(high - low) // PAGE}Q", pagemap.read((high - low) // PAGE * 8))
            extra += sum(PAGE for i, e in enumerate(entries) if e >> 63 and offset + i not in kept)
    counted = offload_bytes(model, model.hf_device_map, "cpu")["cpu"]
    largest = 128 * 512 * 4 + 512 * 4
    assert 0 < extra <= counted - largest, (extra, counted - largest)
