"""Untrained ``random:`` models (issue 26, item 2): built where they run in their dtype, the same
weights for a seed whatever the device, the dtype's route, the thread count or torch's global
generator, never through a float32 CPU copy of the whole model, and initialised as transformers
initialises them (checked against ``from_config``'s own build)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from isotui.models.naming import parse_model

SMALL = {
    "gpt2": "n_layer=2,n_embd=32,n_head=4",
    "bert": "hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64",
    "llama": "hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64",
    # truncated normal (ViT), weight norm (wav2vec2's positional convolution)
    "vit": "hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64",
    "t5": "d_model=32,num_layers=2,num_heads=4,d_ff=64,d_kv=8",
    "wav2vec2": "hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64",
}


def _load(name: str, *, dtype: str = "float32", seed: int = 0, device: str = "cpu", head: str | None = None):
    from isotui.models.loading import load_model

    return load_model(
        parse_model(name), device=device, dtype=dtype, seed=seed, trust_remote_code=False, head=head
    ).model


def _weights(model) -> dict:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _name(kind: str) -> str:
    return f"random:{kind}:{SMALL[kind]}"


@pytest.mark.parametrize("kind", ["gpt2", "vit"])
def test_a_seed_gives_the_same_weights_whatever_the_global_generator_and_threads(kind):
    import torch

    threads = torch.get_num_threads()
    torch.manual_seed(123)
    first = _weights(_load(_name(kind), seed=7))
    try:
        torch.set_num_threads(1)  # the chunks are drawn on other threads, or on this one
        torch.manual_seed(999)
        torch.rand(1000)
        second = _weights(_load(_name(kind), seed=7))
    finally:
        torch.set_num_threads(threads)
    other = _weights(_load(_name(kind), seed=8))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    random = [k for k, v in first.items() if v.is_floating_point() and v.numel() > 1 and v.std() > 0]
    assert random and all(not torch.equal(first[k], other[k]) for k in random)


def test_the_global_generator_is_left_alone():
    """Building draws nothing from torch's global generator (a user's seeded script goes on)."""
    import torch

    torch.manual_seed(5)
    state = torch.random.get_rng_state()
    _load(_name("gpt2"))
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama", "vit", "t5"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_model_is_the_float32_one_rounded(kind, dtype):
    """Built in its dtype, yet its weights are the float32 model's rounded: one seed, one model."""
    import torch

    full = _weights(_load(_name(kind)))
    half = _weights(_load(_name(kind), dtype=dtype))
    assert full.keys() == half.keys()
    for k, v in full.items():
        want = v.to(getattr(torch, dtype)) if v.is_floating_point() else v
        assert half[k].dtype == want.dtype, k
        assert torch.equal(half[k], want), k


def test_a_long_tensor_is_drawn_in_chunks_with_the_same_values_on_any_thread_count():
    """Past one chunk the draws go to threads; the values are the chunks' own generators'."""
    import torch

    from isotui.models import untrained

    n = untrained.CHUNK * 2 + 5
    values = []
    for threads in (1, 3):
        draws = untrained.SeededDraws(11)
        draws.workers = threads
        x = torch.empty(n)
        with draws:
            x.normal_(0.0, 2.0)
        values.append(x)
    assert torch.equal(values[0], values[1])
    # each chunk is its own generator's stream: an independent draw of the same seeds
    for j, start in enumerate(range(0, n, untrained.CHUNK)):
        g = torch.Generator().manual_seed(untrained._stream_seed(11, 1, j))
        part = torch.empty(min(untrained.CHUNK, n - start)).normal_(0.0, 2.0, generator=g)
        assert torch.equal(values[0][start : start + len(part)], part)
    assert abs(float(values[0].std()) - 2.0) < 0.01


def test_draws_into_another_dtype_are_the_float32_draws_rounded():
    """A draw handed to the mode whole into a bfloat16 tensor is the CPU's float32 draw, rounded
    (the copy's cast). trunc_normal_ is left out here: torch 2.11 runs it op by op (its uniform_
    then erfinv_ in the tensor's dtype), so only the build's float32 shadows make it dtype-free:
    the product's route, tested with ViT's truncated normal init above."""
    import torch

    from isotui.models.untrained import SeededDraws

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.empty(3, 1000, dtype=dtype)
        with SeededDraws(2):
            torch.nn.init.normal_(x[:, :], std=0.5)  # a view, by name: torch.nn.init's route
            torch.nn.init.kaiming_uniform_(x[1:], a=2.0)
        out.append(x)
    assert torch.equal(out[0].to(torch.bfloat16), out[1])


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama", "vit", "t5", "wav2vec2"])
def test_initialised_as_from_config_initialises(kind):
    """Against transformers' own build (from_config on the CPU): the same buffers exactly, the
    same constants (norms' ones, zero biases) exactly, and each random weight with from_config's
    scale (std within 25%, means near zero as in from_config)."""
    import torch
    from transformers import AutoModel

    from isotui.models.loading import model_config

    torch.manual_seed(0)
    reference = AutoModel.from_config(model_config(parse_model(_name(kind)), False)).eval()
    model = _load(_name(kind))
    ours, theirs = dict(model.named_buffers()), dict(reference.named_buffers())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    ours, theirs = _weights(model), _weights(reference)
    assert ours.keys() == theirs.keys()
    for k, want in theirs.items():
        got = ours[k]
        if not want.is_floating_point():
            assert torch.equal(got, want), k
        elif want.numel() < 2 or float(want.std()) == 0.0:
            assert torch.equal(got, want), k  # ones and zeros
        else:
            assert not torch.isnan(got).any(), k
            assert 0.75 < float(got.std() / want.std()) < 1.33, k


def test_tied_weights_stay_tied():
    model = _load(_name("gpt2"), head="lm")
    assert model.lm_head.weight is model.transformer.wte.weight


def test_a_new_init_scheme_changes_the_cache_key(monkeypatch):
    """Results cached for an older init's weights are never read as the new weights' results."""
    from isotui.models import untrained

    before = parse_model(_name("gpt2")).fingerprint()
    assert parse_model(_name("gpt2")).fingerprint() == before
    monkeypatch.setattr(untrained, "INIT_SCHEME", "another")
    assert parse_model(_name("gpt2")).fingerprint() != before


@pytest.mark.parametrize("kind", ["gpt2", "timm:resnet18"])
def test_another_torch_changes_a_random_models_key_but_not_its_build(monkeypatch, kind):
    """torch's generator and init functions make the draws (trunc_normal_ changed between 2.11
    and 2.14): another torch release is another model; a CUDA or CPU build of one release is not."""
    from importlib import metadata

    from isotui.models import naming

    name = _name(kind) if kind in SMALL else f"random:{kind}"
    real = metadata.version

    def version(torch_as: str):
        return lambda dist: torch_as if dist == "torch" else real(dist)

    monkeypatch.setattr(naming.metadata, "version", version("2.14.1+cu130"))
    cuda = parse_model(name).fingerprint()
    monkeypatch.setattr(naming.metadata, "version", version("2.14.1+cpu"))
    assert parse_model(name).fingerprint() == cuda
    monkeypatch.setattr(naming.metadata, "version", version("2.11.0"))
    assert parse_model(name).fingerprint() != cuda


_PEAK = r"""
import json, resource, sys, torch
from isotui.models.loading import load_model
from isotui.models.naming import parse_model
torch.set_num_threads(1)
ref = parse_model(sys.argv[1])
warm = parse_model("random:gpt2:n_layer=1,n_embd=32,n_head=4,vocab_size=1000")
load_model(warm, device="cpu", dtype="bfloat16", seed=0, trust_remote_code=False)  # imports, tokenizer
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
import gc; gc.collect()
model = load_model(ref, device="cpu", dtype="bfloat16", seed=0, trust_remote_code=False).model
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
f32 = sum(p.numel() for p in model.state_dict().values()) * 4
print(json.dumps({"grew": (after - before) * 1024, "float32_bytes": f32}))
"""


def test_a_bfloat16_build_never_holds_a_float32_copy_of_the_model(tmp_path):
    """Peak memory of a bfloat16 build (in a fresh process, after a tiny build loaded the
    libraries and the tokenizer): the bfloat16 model (half the float32 size) and one module's
    float32 shadow. Building in float32 and casting (the old route) peaks at the float32 model."""
    name = "random:gpt2:n_layer=16,n_embd=512,n_head=8,vocab_size=1000,n_positions=64"
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, name], capture_output=True, text=True, timeout=600, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["grew"] < 0.75 * seen["float32_bytes"], seen


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_seed_gives_the_same_weights_on_cuda_as_on_the_cpu(dtype):
    """Built on the GPU (in its dtype, never on the CPU first), bit for bit the CPU's build."""
    import torch

    for kind in ("gpt2", "vit", "wav2vec2"):
        on_gpu = _load(_name(kind), dtype=dtype, device="cuda")
        assert {p.device.type for p in on_gpu.parameters()} == {"cuda"}
        gpu, cpu = _weights(on_gpu), _weights(_load(_name(kind), dtype=dtype))
        assert gpu.keys() == cpu.keys()
        assert all(torch.equal(gpu[k], cpu[k]) for k in cpu), kind
