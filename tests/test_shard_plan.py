"""One plan for every shard of a run (issue 24): the first shard's memory plan is recorded beside
the shard states and every later shard follows it, so shards made on machines with different free
memory merge to the one-pass numbers (checked against a one-pass run made under the first shard's
memory, and avg_cos against numpy over all pairs); a shard that cannot hold that plan is refused
in one sentence; the merge reads one shard state at a time."""

from __future__ import annotations

import json
import weakref

import numpy as np
import pytest

from isotui.cli import main

from .conftest import corpus
from .reference import hidden_vectors
from .test_shards import MAX_LENGTH, N, _assert_rows_equal, _rows, _run

TIGHT = 80_000  # bytes of accumulator room: a mixed plan for the tiny models (asserted below)


@pytest.fixture
def texts(tmp_path):
    lines = corpus(N)
    (tmp_path / "texts.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return lines, f"text:{tmp_path / 'texts.txt'}"


@pytest.fixture
def float64_products(monkeypatch):
    from isotui.core import products

    monkeypatch.setattr(products, "FLOAT64_PRODUCTS", True)


def _budget(monkeypatch, size: int | None) -> None:
    """This "machine's" free memory after the margin, for the run's plan (None: the real one)."""
    from isotui.extract import memory_plan, runner

    budget = memory_plan.measured_memory if size is None else lambda d: (None, size)
    monkeypatch.setattr(runner, "measured_memory", budget)


def _plan_file(cache, count: int = 2):
    found = list((cache / "shards").glob(f"*-of-{count}.plan.json"))
    assert len(found) <= 1
    return found[0] if found else None


def test_shards_under_different_free_memory_merge_to_the_one_pass_run(
    tiny_models, texts, tmp_path, float64_products, monkeypatch, capsys
):
    lines, data = texts
    model = tiny_models["bert"]
    _budget(monkeypatch, TIGHT)
    assert _run(model, data, tmp_path / "one", "--csv", str(tmp_path / "one.csv")) == 0
    shared = tmp_path / "shared"
    assert _run(model, data, shared, "--shard", "0/2") == 0
    plan = json.loads(_plan_file(shared).read_text())
    exact = [layer["exact_cov"] for layer in plan["layers"]]
    assert any(exact) and not all(exact), "the tight budget should give a mixed plan"
    assert max(layer["reservoir"] for layer in plan["layers"]) < 40
    _budget(monkeypatch, None)  # shard 1 on a machine with all the memory it wants
    assert _run(model, data, shared, "--shard", "1/2", "--csv", str(tmp_path / "merged.csv")) == 0
    assert "merged from 2 shards" in capsys.readouterr().out
    _assert_rows_equal(_rows(tmp_path / "one.csv"), _rows(tmp_path / "merged.csv"))
    assert _plan_file(shared) is None  # merged: the plan went with the shard states
    layers, _ = hidden_vectors(model, lines, max_length=MAX_LENGTH)
    for row, x in zip(_rows(tmp_path / "merged.csv"), layers, strict=True):
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        n = len(x)
        assert float(row["avg_cos"]) == pytest.approx(((u @ u.T).sum() - n) / (n * (n - 1)), rel=1e-9)


def test_a_shard_that_cannot_hold_the_recorded_plan_is_refused_and_nothing_is_lost(
    tiny_models, texts, tmp_path, float64_products, monkeypatch, capsys
):
    _, data = texts
    model = tiny_models["gpt2"]
    shared = tmp_path / "shared"
    assert _run(model, data, shared, "--shard", "0/2") == 0
    recorded = _plan_file(shared).read_text()
    capsys.readouterr()
    _budget(monkeypatch, TIGHT)
    assert _run(model, data, shared, "--shard", "1/2") == 2
    err = capsys.readouterr().err
    assert "shard 1/2 follows the plan its run was started with" in err
    assert "left here" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    from isotui.experiments.shards import partial_runs

    (partial,) = partial_runs(shared)
    assert partial.have == (0,)  # shard 0's state is kept, and so is the plan
    assert _plan_file(shared).read_text() == recorded
    _budget(monkeypatch, None)
    assert _run(model, data, shared, "--shard", "1/2") == 0
    assert partial_runs(shared) == [] and _plan_file(shared) is None


def test_two_first_shards_at_once_record_one_plan(tmp_path):
    """The plan file is claimed (first writer wins); the loser follows the winner's plan."""
    from isotui.errors import IsotuiError
    from isotui.experiments.shards import _settle_plan, recorded_plan
    from isotui.extract.memory_plan import MemoryPlan, plan_layers

    def plan(budget: int) -> MemoryPlan:
        layers = plan_layers([(f"layer {i}", 32, "cpu", 10) for i in range(3)], {"cpu": budget}, 40)
        return MemoryPlan(layers, {"cpu": budget}, reservoir_asked=40, types_asked=10)

    small, large = plan(40_000), plan(10**9)
    assert [p.exact_cov for p in small.layers] != [p.exact_cov for p in large.layers]
    first = _settle_plan(tmp_path, "k" * 32, 0, 2, small)
    assert first is small
    second = _settle_plan(tmp_path, "k" * 32, 1, 2, large)  # a machine with more memory follows
    assert [(p.exact_cov, p.reservoir, p.types) for p in second.layers] == [
        (p.exact_cov, p.reservoir, p.types) for p in small.layers
    ]
    assert second.budgets == large.budgets
    again = recorded_plan(tmp_path, "k" * 32, 2)
    assert again is not None and again.to_json() == small.to_json()
    # the other way round: a machine with less room than the recorded plan needs
    said = r"shard 1/3 follows the plan .* need .* on cpu.*`isotui cache rm jjjjjj"
    with pytest.raises(IsotuiError, match=said):
        _settle_plan(tmp_path, "j" * 32, 0, 3, large)
        _settle_plan(tmp_path, "j" * 32, 1, 3, small)
    # a damaged plan file is one sentence naming `cache rm`
    (tmp_path / "shards" / f"{'k' * 32}-of-2.plan.json").write_text("{not json")
    with pytest.raises(IsotuiError, match="is damaged: remove the run's shards with `isotui cache rm kkkk"):
        recorded_plan(tmp_path, "k" * 32, 2)


def test_the_merge_reads_one_shard_state_at_a_time(tiny_models, texts, tmp_path, monkeypatch, capsys):
    """Four shards: when each state is read, no earlier state is still alive (the running sum is
    a copy of its own), so the merge holds one state beside the sum, not all four."""
    from isotui.experiments import shards

    _, data = texts
    model = tiny_models["gpt2"]
    shared = tmp_path / "shared"
    real_merge = shards.merge_cached
    monkeypatch.setattr(shards, "merge_cached", lambda *a, **k: None)
    for i in range(4):
        assert _run(model, data, shared, "--shard", f"{i}/4") == 0
    monkeypatch.setattr(shards, "merge_cached", real_merge)
    read = shards.state_from_payload
    alive: list[weakref.ref] = []
    held_at_read: list[int] = []

    def tracked(*args):
        held_at_read.append(sum(r() is not None for r in alive))
        state = read(*args)
        layer = state["components"]["model"][0]
        alive.append(weakref.ref(next(v for v in layer.values() if hasattr(v, "numel"))))
        return state

    monkeypatch.setattr(shards, "state_from_payload", tracked)
    assert _run(model, data, shared, "--csv", str(tmp_path / "merged.csv")) == 0
    assert "merged from 4 shards" in capsys.readouterr().out
    assert held_at_read == [0, 0, 0, 0]


def test_cache_rm_of_the_last_shard_removes_the_plan(tiny_models, texts, tmp_path, capsys):
    _, data = texts
    shared = tmp_path / "shared"
    assert _run(tiny_models["gpt2"], data, shared, "--shard", "1/2") == 0
    assert _plan_file(shared) is not None
    from isotui.experiments.shards import partial_runs

    (partial,) = partial_runs(shared)
    assert main(["cache", "rm", partial.key[:12], "--cache-dir", str(shared)]) == 0
    assert partial_runs(shared) == [] and _plan_file(shared) is None
    # a plan whose first shard failed after recording it: `cache rm --all` takes it too
    assert _run(tiny_models["gpt2"], data, shared, "--shard", "1/2") == 0
    (shared / "shards" / f"{partial.key}-1-of-2.safetensors").unlink()
    assert _plan_file(shared) is not None
    assert main(["cache", "rm", "--all", "--cache-dir", str(shared)]) == 0
    assert _plan_file(shared) is None


@pytest.mark.parametrize("budget", [TIGHT, 2 * TIGHT, 4 * TIGHT, 8 * TIGHT])
def test_a_first_shard_plans_as_the_one_pass_run_on_its_machine(
    tiny_models, texts, tmp_path, monkeypatch, budget
):
    """Issue 36: a first shard bounded its layers' vectors by its own slice's tokens, so on a
    small corpus it planned larger reservoirs (or exact covariances) than a one-pass run on the
    same machine would. Its recorded plan is now that run's plan, layer by layer."""
    from .test_offload_peak import _plan_of

    _, data = texts
    model = tiny_models["bert"]
    _budget(monkeypatch, budget)
    flags = ("--reservoir", "256")  # more than a shard's slice holds, less than the corpus
    assert _run(model, data, tmp_path / "one", *flags, "--json", str(tmp_path / "one.json")) == 0
    one = _plan_of(json.loads((tmp_path / "one.json").read_text()))
    assert _run(model, data, tmp_path / "shared", *flags, "--shard", "0/2") == 0
    shard = json.loads(_plan_file(tmp_path / "shared").read_text())
    fields = ("exact_cov", "reservoir", "types", "vectors", "bytes")
    assert [[p[f] for f in fields] for p in shard["layers"]] == [
        [p[f] for f in fields] for p in one["layers"]
    ]
    assert min(p["vectors"] for p in one["layers"]) > 256  # the corpus fills the reservoirs asked


def _merge_free_more(err: str) -> tuple[int, int]:
    """(bytes to free, bytes free) from a merge refusal's words."""
    import re

    scale = {"GB": 10**9, "MB": 10**6, "kB": 10**3, "B": 1}
    m = re.search(r"the CPU has (\S+) (GB|MB|kB|B) free here: free (\S+) (GB|MB|kB|B) more", err)
    assert m, err
    return round(float(m.group(3)) * scale[m.group(4)]), round(float(m.group(1)) * scale[m.group(2)])


def test_the_merge_plans_its_own_memory_on_the_machine_that_merges(
    tiny_models, texts, tmp_path, monkeypatch, capsys
):
    """Issue 36: the final merge was not checked against the memory of the machine doing it. It
    is refused in one sentence before any state is read when the CPU there cannot hold it,
    nothing is lost (both states and the plan stay cached), the stated amount merges, and 1%
    less of the free memory it asks for is refused."""
    from isotui.experiments.shards import partial_runs
    from isotui.extract import memory_plan

    _, data = texts
    model, shared = tiny_models["gpt2"], tmp_path / "shared"
    _budget(monkeypatch, 10**9)  # the shards' own plans: plenty of room
    assert _run(model, data, shared, "--shard", "0/2") == 0
    capsys.readouterr()
    monkeypatch.setattr(memory_plan, "available_memory", lambda _d: 4_000)  # the merging machine
    assert _run(model, data, shared, "--shard", "1/2") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("isotui: error: merging the 2 shards of this run") and len(err.splitlines()) == 1
    (partial,) = partial_runs(shared)
    assert partial.have == (0, 1) and _plan_file(shared) is not None  # nothing lost
    more, free = _merge_free_more(err)
    assert free == 4_000 and more > 256 << 20  # its sums, twice, and the margin kept free
    monkeypatch.setattr(memory_plan, "available_memory", lambda _d: free + int(more * 0.99))
    assert _run(model, data, shared) == 2  # a plain run merges the cached shards: still short
    capsys.readouterr()
    monkeypatch.setattr(memory_plan, "available_memory", lambda _d: free + more)
    assert _run(model, data, shared) == 0
    assert "merged from 2 shards" in capsys.readouterr().out
    assert partial_runs(shared) == [] and _plan_file(shared) is None


def test_a_shard_short_of_the_recorded_plan_is_told_the_memory_that_runs_it(
    tiny_models, texts, tmp_path, monkeypatch, capsys
):
    """Issue 36: a shard that cannot follow its run's plan said the sums' bytes less a budget
    already short of its margin. It now says the free memory that holds them beside the margin:
    that much more runs the shard, 1% less than that is refused."""
    import re

    from isotui.extract import memory_plan

    _, data = texts
    model, shared = tiny_models["gpt2"], tmp_path / "shared"
    assert _run(model, data, shared, "--shard", "0/3") == 0
    capsys.readouterr()
    short = memory_plan.MARGIN_MIN + TIGHT  # room for the floor, not for the recorded plan
    monkeypatch.setattr(memory_plan, "available_memory", lambda _d: short)
    assert _run(model, data, shared, "--shard", "1/3") == 2
    err = capsys.readouterr().err.strip()
    assert "shard 1/3 follows the plan its run was started with" in err and len(err.splitlines()) == 1
    m = re.search(r"run it where cpu has (\S+) (MB|kB) more free", err)
    assert m, err
    more = round(float(m.group(1)) * {"MB": 10**6, "kB": 10**3}[m.group(2)])
    for free, code in ((short + int(more * 0.99), 2), (short + more, 0)):  # 1% less of it is short
        monkeypatch.setattr(memory_plan, "available_memory", lambda _d, f=free: f)
        assert _run(model, data, shared, "--shard", "1/3") == code, free
        capsys.readouterr()


def test_a_damaged_plan_file_does_not_stop_the_merge(tiny_models, texts, tmp_path, monkeypatch, capsys):
    """The merge checks its memory against the recorded plan when it can read it; the states
    merge without it (as before the check), so a damaged plan file costs no shard's work."""
    from isotui.experiments.shards import partial_runs
    from isotui.extract import memory_plan

    _, data = texts
    model, shared = tiny_models["gpt2"], tmp_path / "shared"
    _budget(monkeypatch, 10**9)  # the shards' own plans: plenty of room
    assert _run(model, data, shared, "--shard", "0/2") == 0
    monkeypatch.setattr(memory_plan, "available_memory", lambda _d: 4_000)  # the merge is refused
    assert _run(model, data, shared, "--shard", "1/2") == 2
    (partial,) = partial_runs(shared)
    assert partial.have == (0, 1)
    _plan_file(shared).write_text("{not json")
    capsys.readouterr()
    assert _run(model, data, shared) == 0  # a plain run merges the cached shards
    assert "merged from 2 shards" in capsys.readouterr().out
    assert partial_runs(shared) == [] and _plan_file(shared) is None
