"""The dry run is the run (issue 24): over six (model, limits) pairs, the plan JSON of
``isotui run --dry-run --json`` equals the plan the run records in its result, field by field,
except the fields the dry run itself lists as estimates (``estimates``: a device's budget that
``--max-memory`` does not set, measured by the run after its first batch; the most vectors a
layer sees, counted by the run in its corpus) and the words naming the source. Tiny random-init
models saved to temporary folders; this machine's free memory is patched to a fixed 64 GiB.
Under ``--max-memory`` the budgets are compared too, and the test checks them against the
plan's own arithmetic by hand: what was typed, less the weights placed there, the workspace
and the margin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isotui.cli import main
from isotui.extract.memory_plan import CORPUS_GUESSES
from isotui.spec import make_spec

from .conftest import corpus
from .test_offload_peak import _plan_of

# a long run (`make test-fast` leaves it out)
pytestmark = pytest.mark.slow

PLENTY = 64 << 30
# samples: more tokens than any reservoir asked below; 1,000 samples hold 1,348 token types of
# BERT's tokenizer in two samples or more, 1,631 of the wide GPT-2's (the run follows 1,000, as
# the dry run plans)
N = {"bert": 1000, "gpt2": 100, "gpt_neox": 100, "gpt2_wide": 1000}


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """The tests' tiny models and a wider GPT-2 (d = 256, 12 blocks, 40.1 MB) whose tensors
    (0.26-1 MB) are large enough for disk offload to save memory: offloading a tensor of 64 KiB
    or less maps as much of the weight file as it saves (see ``offload_bytes``)."""
    import torch
    from transformers import GPT2Config, GPT2Model

    from .conftest import _bpe_tokenizer

    root = tmp_path_factory.mktemp("wide")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=2000, n_embd=256, n_layer=12, n_head=4, n_inner=1024, n_positions=128)
    GPT2Model(config).save_pretrained(root / "gpt2_wide")
    _bpe_tokenizer(root / "gpt2_wide", 2000)  # 1,631 token types in the 1,000 samples
    return {**tiny_models, "gpt2_wide": root / "gpt2_wide"}


def _texts(tmp_path: Path, n: int) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(corpus(n)) + "\n", encoding="utf-8")
    return f"text:{path}"


def _without(plan: dict, estimates: list[str]) -> dict:
    """``plan`` less its source, its estimates list, the dry run's time per phase (a forecast
    only the dry run makes) and the fields that list names."""
    out = {k: v for k, v in plan.items() if k not in ("source", "estimates", "notes", "phases")}
    for path in estimates:
        head, _, tail = path.partition(".")
        if not tail:
            out.pop(head, None)
        elif head == "layers":
            out["layers"] = [{k: v for k, v in p.items() if k != tail} for p in out["layers"]]
        else:
            out[head] = {k: v for k, v in out[head].items() if k != tail}
    return out


# (model, flags): plain CPU, --batch-size and --reservoir, device maps under --max-memory with
# everything in memory, with part of the model offloaded to disk, and with sums the limit cuts;
# "cpu=+N" is N bytes more than isotui keeps for itself beside the weights (see _limit)
PAIRS = [
    ("gpt2", ["--reservoir", "256"], None, "whole"),
    ("gpt_neox", ["--batch-size", "4", "--reservoir", "64"], None, "whole"),
    ("bert", ["--device-map", "auto", "--reservoir", "200"], 600_000_000, "whole"),
    ("gpt2", ["--device-map", "auto", "--reservoir", "100"], 300_000_000, "whole"),
    ("gpt2_wide", ["--device-map", "sequential", "--batch-size", "2", "--reservoir", "400"], 20e6, "offload"),
    ("gpt2_wide", ["--device-map", "balanced", "--reservoir", "300"], 5e6, "cut"),
]


def _limit(folder: Path, flags: list[str], extra: float, *, floor: bool = False) -> int:
    """A --max-memory for the CPU ``extra`` bytes above what isotui takes out of it before
    accelerate places the weights: its whole plan's sums with their margin and a batch (``floor``:
    its sums at the floor, which is what it takes when the whole plan does not fit), or ``extra``
    itself when that is larger (a plain limit)."""
    from isotui.extract.memory_plan import placement_memory
    from isotui.models.loading import model_config
    from isotui.models.naming import parse_model

    options = dict(zip(flags[::2], flags[1::2], strict=True))

    def kept(given: int) -> int:
        handed = placement_memory(
            model_config(parse_model(str(folder)), False),
            {"cpu": given},
            dtype="float32",
            batch_size=int(options.get("--batch-size", 0)) or None,
            max_length=64,
            reservoir=int(options.get("--reservoir", 4096)),
        )
        assert handed is not None
        return given - handed["cpu"]

    whole = kept(10**12)
    held = kept(whole - 1) if floor else whole
    assert held <= whole
    return int(extra if extra > 10 * held else held + extra)


@pytest.mark.parametrize(("name", "flags", "extra", "kind"), PAIRS, ids=[f"{n}-{k}" for n, *_, k in PAIRS])
def test_the_dry_run_plan_is_the_runs_recorded_plan(models, tmp_path, monkeypatch, name, flags, extra, kind):
    from isotui.experiments.layerwise import measure
    from isotui.extract import device, memory_plan, memory_values

    monkeypatch.setattr(memory_plan, "available_memory", lambda _d: PLENTY)
    monkeypatch.setattr(device, "available_memory", lambda _d: PLENTY)
    if extra is not None:
        limit = _limit(models[name], flags, extra, floor=kind == "cut")
        flags = [*flags, "--max-memory", f"cpu={limit}"]
    folder, data = str(models[name]), _texts(tmp_path, N[name])
    common = ["--data", data, "--max-length", "64", *flags]
    out = tmp_path / "plan.json"
    assert main(["run", "-m", folder, *common, "--dry-run", "--json", str(out)]) == 0
    dry = json.loads(out.read_text())[folder]
    options = dict(zip(flags[::2], flags[1::2], strict=True))
    spec = make_spec(
        folder,
        data,
        max_length=64,
        device="auto" if "--device-map" in options else "cpu",
        batch_size=int(options.get("--batch-size", 0)) or None,
        reservoir=int(options.get("--reservoir", 4096)),
        device_map=options.get("--device-map"),
        max_memory=options.get("--max-memory"),
    )
    run = measure(spec, None).meta["memory_plan"]
    assert run["estimates"] == []  # the run's plan is what it followed
    # issue 36: the dry run reads and counts the corpus as the run does (types, vectors): none
    # of those fields is a guess any more, and each equals the run's
    assert not set(CORPUS_GUESSES) & set(dry["estimates"])
    assert _without(dry, dry["estimates"]) == _without(run, dry["estimates"])
    if N[name] == 1000:  # more token types in two samples or more than the run follows
        assert run["types_asked"] == 1000
    assert all(p["reservoir"] <= p["vectors"] for p in run["layers"])  # the reservoirs fill
    asked = int(options.get("--reservoir", 4096))
    whole = all(p["exact_cov"] and p["reservoir"] == asked for p in run["layers"])
    # the pair is what it says: the whole plan with all weights in memory, the whole plan with
    # weights offloaded to disk, or a plan the limit cuts (to its floor: weights on disk too)
    assert whole == (kind != "cut")
    assert ("disk" in run["weights_bytes"]) == (kind != "whole")
    assert ("cpu" in run["weights_bytes"]) == (kind != "cut")
    given = options.get("--max-memory")
    if given is None:
        assert "budget_bytes.cpu" in dry["estimates"]
        return
    assert "budget_bytes.cpu" not in dry["estimates"]  # --max-memory sets it: compared above
    limit = memory_values.parse_size(given.split("=")[1])
    assert limit is not None
    # by hand: the typed limit less the weights accelerate kept in memory, the workspace (the
    # larger of a batch and finalisation, at their most) and the margin (10% of what is left,
    # at least 256 MiB)
    weights = dry["weights_bytes"].get("cpu", 0)
    # what offloading adds (tests/test_offload_bytes.py checks it against the weight file)
    work = _workspace_by_hand(models[name], dry["batch_tokens"], dry["reservoir_asked"])
    work += run["offload_bytes"].get("cpu", 0)
    assert (run["offload_bytes"] != {}) == (kind != "whole")
    room = limit - weights - work
    assert run["budget_bytes"]["cpu"] == max(0, room - max(256 << 20, room // 10))
    # and everything isotui places on the CPU stays within what was typed
    assert weights + run["accumulator_bytes"]["cpu"] + work <= limit
    assert work >= max(run["transient_bytes"]["cpu"], run["finalisation_bytes"]["cpu"])
    # the plan's own peak on the CPU: the weights, offloading, the sums, the larger workspace
    batch = run["forward_bytes"]["cpu"] + run["transient_bytes"]["cpu"]
    assert run["peak_bytes"]["cpu"] == weights + run["offload_bytes"].get("cpu", 0) + run[
        "accumulator_bytes"
    ]["cpu"] + max(batch, run["finalisation_bytes"]["cpu"])
    assert run["peak_bytes"]["cpu"] <= limit


def _workspace_by_hand(folder: Path, m: int, k: int) -> int:
    """A float32 model's workspace on the CPU at ``m`` tokens a batch and a reservoir of ``k``,
    from the shapes of what the forward and LayerAccumulator.partial allocate: the forward's
    hidden states (embeddings and every block) and three intermediate-wide tensors; the fold's
    live copies (the gathered float32 vectors, float64, unit and shifted: 4 + 24 bytes a value,
    per-sample sums with at most m samples: 8, norms) and its largest phase (1,000 tracked types:
    their sums and two m x d float64; or the filling reservoir: float32 vectors, their
    concatenation with k held ones and the k kept); finalising an exact layer: 56 d^2 bytes and
    LAPACK's syevd workspace beyond its 2 d^2 doubles beside the reservoir's float64 copy, then
    its metrics: the two eigenvector matrices and four float64 copies of the reservoir."""
    config = json.loads((folder / "config.json").read_text())
    d = config.get("hidden_size") or config["n_embd"]
    states = (config.get("num_hidden_layers") or config["n_layer"]) + 1
    inter = config.get("intermediate_size") or config.get("n_inner") or 4 * d
    forward = m * (4 * d * states + 3 * 4 * inter)
    alive = (4 + 24 + 8) * m * d + 8 * m
    phase = max(
        8 * m * d,
        8 * m * d + 4 * d * d,
        16 * m * d,
        8 * 1001 * d + 16 * m * d + 40 * m,
        4 * m * d + 4 * (k + m) * d + 4 * k * d,
    )
    final = max(56 * d * d + 8 * (1 + 6 * d) + 8 * k * d, 2 * 8 * d * d + 4 * 8 * k * d)
    return max(forward + alive + phase, final)


def _short_sentences(path: Path, n: int) -> str:
    """``n`` short sentences over a 20-word vocabulary (few token types: far under the 1,000 the
    dry run guessed before it counted)."""
    import random

    rng = random.Random(0)
    words = [
        "the",
        "a",
        "model",
        "layer",
        "vector",
        "space",
        "token",
        "attention",
        "head",
        "mean",
        "drift",
        "rogue",
        "dimension",
    ]
    words += ["isotropy", "cosine", "similarity", "sentence", "corpus", "train", "test"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f"text:{path}"


def test_a_small_corpus_plans_as_it_runs(tmp_path, monkeypatch):
    """Issue 36's pair: MiniLM on 120 of 300 short sentences under --max-memory cpu=400MB. The dry
    run planned 1,000 token types (the corpus follows 20-odd), so 0 of 7 exact covariances and
    200-vector reservoirs, where the run kept 7 of 7 and 500; counted, the two plans are one."""
    from isotui.experiments.layerwise import measure
    from isotui.extract import device, memory_plan

    monkeypatch.setattr(memory_plan, "available_memory", lambda _d: PLENTY)
    monkeypatch.setattr(device, "available_memory", lambda _d: PLENTY)
    data = _short_sentences(tmp_path / "short.txt", 300)
    flags = ["--data", data, "--max-samples", "120", "--max-length", "64", "--device-map", "auto"]
    flags += ["--max-memory", "cpu=400MB", "--reservoir", "500"]
    out = tmp_path / "plan.json"
    assert main(["run", "-m", "minilm", *flags, "--dry-run", "--json", str(out)]) == 0
    dry = json.loads(out.read_text())["minilm"]
    spec = make_spec(
        "minilm",
        data,
        max_samples=120,
        max_length=64,
        device="auto",
        reservoir=500,
        device_map="auto",
        max_memory="cpu=400MB",
    )
    run = measure(spec, None).meta["memory_plan"]
    # nothing but the time is a guess, and the fixed cost each process measures of itself
    assert dry["estimates"] == ["resident_before_bytes", "phases"]
    assert _without(dry, ["resident_before_bytes"]) == _without(run, ["resident_before_bytes"])
    assert all(p["exact_cov"] and p["reservoir"] == 500 for p in run["layers"])
    assert 0 < run["types_asked"] < 1000


def test_the_corpus_is_counted_as_the_run_counts_it(tmp_path):
    """corpus_counts by hand: the ids of kept tokens (special ones out unless included) that
    occur in two samples or more, and every token of every sample."""
    import numpy as np

    from isotui.extract.runner import corpus_counts
    from isotui.extract.tokens import tokenize
    from isotui.models.loading import text_tokenizer
    from isotui.models.naming import parse_model

    tok = text_tokenizer(parse_model("minilm"), tokenizer=None, trust=False)
    texts = ["the cat sat", "the dog sat down", "a bird", "cat cat cat"]
    tokens = tokenize(tok, texts, 16, with_types=False)
    for include in (False, True):
        per_sample = []
        for text in texts:
            enc = tok(text, truncation=True, max_length=16, return_special_tokens_mask=True)
            keep = [
                i
                for i, s in zip(enc["input_ids"], enc["special_tokens_mask"], strict=True)
                if include or not s
            ]
            per_sample.append(set(keep))
        seen = np.bincount([i for ids in per_sample for i in ids])
        total = sum(len(tok(t, truncation=True, max_length=16)["input_ids"]) for t in texts)
        assert corpus_counts(tokens, include_special=include) == (int((seen >= 2).sum()), total)
    # "the", "sat" and "cat" (twice in one sample counts once), and with specials [CLS] and [SEP]
    assert corpus_counts(tokens, include_special=False)[0] == 3
    assert corpus_counts(tokens, include_special=True)[0] == 5


def test_an_untrained_model_wholly_on_disk_is_refused_alike_by_the_dry_run_and_the_run(capsys):
    """Issue 36's second pair: an untrained model is built in memory, then dispatched, and
    accelerate cannot run one whose every part is on disk (a checkpoint it can). The dry run
    planned it; the run refused it. Both now refuse it, in one sentence, before any work."""
    model = "random:gpt_neox:hidden_size=256,num_hidden_layers=4,num_attention_heads=4,intermediate_size=1024"
    flags = ["-m", model, "--max-samples", "8", "--device-map", "sequential", "--batch-size", "4"]
    flags += ["--max-memory", "cpu=391MB", "--no-cache"]
    said = []
    for extra in (["--dry-run"], []):
        assert main(["run", *flags, *extra]) == 2
        said.append([line for line in capsys.readouterr().err.splitlines() if "error" in line])
    assert said[0] == said[1] and len(said[0]) == 1
    assert "leaves no room in memory for any part of model" in said[0][0]


_IMPORTS_ONLY = (
    "import re, torch, transformers.modeling_utils, accelerate\n"
    "text = open('/proc/self/status').read()\n"
    "print(int(re.search(r'VmRSS:\\s+(\\d+) kB', text).group(1)) * 1024)\n"
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_the_plan_states_the_fixed_cost_of_the_process_beside_the_budget(tmp_path):
    """Issue 36: the ~0.9 GB a process holds before any work (Python, torch, transformers) was
    outside every limit and unsaid. The dry run states it beside the plan, with the CPU's total;
    the run records its own in its JSON. Both near a fresh process that only imports the three
    libraries' model code (isotui's own modules add little beside them), each in a fresh process."""
    import subprocess
    import sys

    base = int(
        subprocess.run(
            [sys.executable, "-c", _IMPORTS_ONLY], capture_output=True, text=True, check=True, timeout=300
        ).stdout
    )
    out, env = tmp_path / "plan.json", {**__import__("os").environ, "ISOTUI_CACHE_DIR": str(tmp_path)}
    flags = ["-m", "minilm", "--max-samples", "20", "--max-length", "16", "--max-memory", "cpu=2GB"]
    said = subprocess.run(
        [sys.executable, "-m", "isotui", "run", *flags, "--dry-run", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert said.returncode == 0, said.stderr[-2000:]
    dry = next(iter(json.loads(out.read_text()).values()))
    line = next(n for n in dry["notes"] if n.startswith("beside the plan: this process holds"))
    assert "outside the plan and --max-memory" in line and "on cpu at most" in line
    assert "resident_before_bytes" in dry["estimates"]  # the run's process measures its own
    ran = subprocess.run(
        [sys.executable, "-m", "isotui", "run", *flags, "--no-cache", "-q", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    run = _plan_of(json.loads(out.read_text()))
    assert run is not None
    for plan in (dry, run):
        assert 0.9 * base <= plan["resident_before_bytes"] <= base + 200 * 10**6, (plan, base)
    total = dry["resident_before_bytes"] + dry["peak_bytes"]["cpu"]
    words = f"{total / 1e9:.1f} GB" if total >= 10**9 else f"{total / 1e6:.1f} MB"
    assert f"on cpu at most {words} resident in all" in line, line
