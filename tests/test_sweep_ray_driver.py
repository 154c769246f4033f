"""``isotui sweep`` on Ray when the workers do not see the driver's cache (``shared_cache =
false``, issue 24 item 5): each task measures with its node's own cache (``worker_cache_dir``,
set through the task's ``runtime_env``) and sends its shard state back through Ray's object
store; the driver keeps the states in its own cache and merges.

A local Ray cluster stands in for the machines: its workers get another ``ISOTUI_CACHE_DIR``
than the driver's (the driver's is the config's ``cache_dir``). The merged table is compared
with the whole run measured in this process (another cache folder) to 1e-9 relative, and avg_cos
of every layer with numpy over all pairs of that layer's vectors (``tests/reference.py``).
Batches of one sample and float64 batch products, as in ``test_shards.py`` (float32 products
round by which vectors share a batch, ~1e-8 on the spectrum): in the cluster's processes too,
through a ``sitecustomize`` on their ``PYTHONPATH``.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from isotui.cli import main

from .conftest import corpus
from .reference import hidden_vectors

# a long run (`make test-fast` leaves it out)
pytestmark = pytest.mark.slow

N = 11  # samples: the three shards differ in size
MAX_LENGTH = 16
SHARDS = 3
TIMINGS = ("time_s", "tokens_per_s", "load_s", "forward_s", "tokenise_s", "metrics_s", "write_s")


SITECUSTOMIZE = """\
# this test's Ray processes: isotui's batch products in float64 (tests/test_sweep_ray_driver.py)
try:
    import isotui.core.products

    isotui.core.products.FLOAT64_PRODUCTS = True
except ImportError:
    pass
"""


@pytest.fixture
def float64_products(monkeypatch, tmp_path):
    """Products in float64 here and in every process the local Ray cluster starts."""
    import os

    from isotui.core import products

    monkeypatch.setattr(products, "FLOAT64_PRODUCTS", True)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    root = str(Path(__file__).resolve().parents[1])  # this isotui, importable by sitecustomize
    rest = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), root, rest) if p))


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _config(folder: Path, model: Path, data: Path, sweep: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sweep.toml"
    path.write_text(
        f'models = ["{model}"]\ndata = "text:{data}"\nmax_length = {MAX_LENGTH}\nreservoir = 20\n'
        f'batch_size = 1\ncache_dir = "cache"\ncsv = "out.csv"\n\n[sweep]\n{sweep}\n',
        encoding="utf-8",
    )
    return path


def _assert_same_rows(one: list[dict[str, str]], merged: list[dict[str, str]]) -> None:
    """Same columns; text and counts exactly, numbers to 1e-9 relative."""
    assert [list(r) for r in one] == [list(r) for r in merged]
    for a, b in zip(one, merged, strict=True):
        for k, x in a.items():
            if k in TIMINGS:
                continue
            y = b[k]
            try:
                fx, fy = float(x), float(y)
            except ValueError:
                assert x == y, k
                continue
            if x.lstrip("-").isdigit():
                assert x == y, (k, x, y)
            elif math.isnan(fx):
                assert math.isnan(fy), k
            else:
                assert fy == pytest.approx(fx, rel=1e-9, abs=1e-12), (a["layer"], k)


def test_ray_workers_without_the_drivers_cache_send_states_and_the_driver_merges(
    tiny_models, float64_products, tmp_path, capsys
):
    """The sweep starts a local cluster (as ``test_sweep.py``'s Ray test: its CPUs, at most 3
    tasks at once here) with this isotui shipped as the job's ``py_modules``; the cluster's
    processes inherit this test's environment, so without the task's ``runtime_env`` the
    workers would use the test's ``ISOTUI_CACHE_DIR``."""
    pytest.importorskip("ray")
    from isotui.experiments.layer_pass import read
    from isotui.experiments.shards import FOLDER, partial_runs
    from isotui.store.cache import ResultCache

    lines = corpus(N)
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    model = tiny_models["gpt2"]
    workers = tmp_path / "worker-cache"  # the nodes' own cache
    config = _config(
        tmp_path / "sweep",
        model,
        data,
        f'executor = "ray"\nshards = {SHARDS}\nshared_cache = false\nretries = 0\n'
        f'worker_cache_dir = "{workers}"',
    )
    assert main(["sweep", str(config), "-q"]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert f"{SHARDS} of {SHARDS} tasks to run on Ray" in err and "failed" not in err

    # the whole run in this process, in another cache folder
    one_csv = tmp_path / "one.csv"
    argv = ["run", str(config), "--cache-dir", str(tmp_path / "one"), "--csv", str(one_csv), "-q"]
    assert main(argv) == 0
    merged_rows = _rows(tmp_path / "sweep" / "out.csv")
    _assert_same_rows(_rows(one_csv), merged_rows)

    # the driver's cache holds the merged entry (the one-process run's key), no shard is left over
    driver = tmp_path / "sweep" / "cache"
    (one_entry,) = ResultCache(tmp_path / "one").entries()
    (entry,) = ResultCache(driver).entries()
    assert entry.key == one_entry.key
    merged = read(ResultCache(driver), entry.key)
    assert merged is not None and f"merged from {SHARDS} shards" in merged.meta["notes"]
    assert partial_runs(driver) == [] and not list((driver / FOLDER).glob("*.plan.json"))
    # the workers used their own cache (local weights' digests), and kept no state or result there
    assert workers.is_dir() and any(p.is_file() for p in workers.rglob("*"))
    assert not list(workers.rglob("*.safetensors"))
    # the test's own cache (the environment the cluster's processes started with) was not used
    test_cache = Path(str(tmp_path / "cache"))
    assert not list(test_cache.rglob("*.safetensors")) if test_cache.exists() else True

    # avg_cos of every layer against numpy over all pairs of its vectors, in one process
    layers, _ = hidden_vectors(model, lines, max_length=MAX_LENGTH)
    assert len(layers) == len(merged_rows)
    for row, x in zip(merged_rows, layers, strict=True):
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        g = u @ u.T
        n = len(x)
        assert int(row["n_vectors"]) == n
        assert float(row["avg_cos"]) == pytest.approx((g.sum() - np.trace(g)) / (n * (n - 1)), rel=1e-9)


def test_the_driver_keeps_only_a_whole_state_of_the_shard_it_asked_for(tiny_models, tmp_path):
    """What a worker sends is checked before the driver keeps it: a damaged state, or the state
    of another shard, is one sentence and nothing is kept; a whole one is kept with its plan."""
    from isotui.errors import IsotuiError
    from isotui.experiments.layerwise import measure_for_driver
    from isotui.experiments.shards import FOLDER, keep_from_worker, partial_key, plan_name
    from isotui.spec import make_spec

    data = tmp_path / "texts.txt"
    data.write_text("\n".join(corpus(N)) + "\n", encoding="utf-8")
    spec = make_spec(str(tiny_models["bert"]), data=f"text:{data}", max_length=MAX_LENGTH, reservoir=20)
    key, sent = measure_for_driver(spec, 0, 2, None, tmp_path / "worker")
    driver = tmp_path / "driver"
    shards = driver / FOLDER

    damaged = bytearray(sent)
    damaged[-5] ^= 0xFF  # one byte of the arrays flipped: the checksum no longer holds
    with pytest.raises(IsotuiError, match=r"the state of shard 0/2 sent by its Ray worker is damaged"):
        keep_from_worker(driver, key, 0, 2, bytes(damaged))
    assert not list(shards.glob("*.safetensors"))
    with pytest.raises(IsotuiError, match=r"shard 1/2 .* damaged \(it is shard 0/2 of run"):
        keep_from_worker(driver, key, 1, 2, sent)
    assert not list(shards.glob("*.safetensors"))

    plan = keep_from_worker(driver, key, 0, 2, sent)
    assert (shards / f"{partial_key(key, 0, 2)}.safetensors").is_file()
    assert plan is not None and (shards / plan_name(key, 2)).is_file()
    # the plan goes with the next shard, which follows it: its state records the same plan
    key1, sent1 = measure_for_driver(spec, 1, 2, plan, tmp_path / "worker")
    assert key1 == key and keep_from_worker(driver, key, 1, 2, sent1) == plan
    # a whole run (shards = 1): the worker's result entry, kept under the run's key
    from isotui.experiments.layer_pass import read
    from isotui.store.cache import ResultCache

    whole_key, whole = measure_for_driver(spec, 0, 1, None, tmp_path / "worker")
    assert whole_key == key and keep_from_worker(driver, key, 0, 1, whole) is None
    kept = read(ResultCache(driver), key)
    assert kept is not None and kept.meta["n_samples"] == N
