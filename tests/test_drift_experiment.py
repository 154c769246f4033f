"""drift-block's registry entry (``drift_block.experiment.EXPERIMENT``) against the sweep run
plainly: the same request from the flags, the same rows, and each cache entry read back."""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace

import numpy as np
import pytest

base = pytest.importorskip("isotui.experiments.base")  # the contract (the registry's branch)

from isotui.cli.experiments import add_common, add_param_flags, params_from_args  # noqa: E402
from isotui.experiments.drift_block import DriftBlockConfig, run_drift_block  # noqa: E402
from isotui.experiments.drift_block.experiment import EXPERIMENT  # noqa: E402

FLAGS = [
    *("--hidden", "32", "--heads", "4", "--intermediate", "64", "--vocab", "200"),
    *("--batch", "2", "--seq-len", "16", "--device", "cpu", "--norms", "0,6,12", "--seeds", "0,1"),
]


def test_the_entry_runs_caches_and_reads_back_the_sweep(tmp_path):
    parser = argparse.ArgumentParser()
    add_param_flags(parser, EXPERIMENT.params)  # its flags, as the CLI adds them
    add_common(parser, device_seed=False)  # the shared ones
    request = EXPERIMENT.request(None, params_from_args(EXPERIMENT, parser.parse_args(FLAGS)))
    config = DriftBlockConfig(
        hidden=32, heads=4, intermediate=64, vocab=200, batch=2, seq_len=16, device="cpu",
        norms=(0.0, 6.0, 12.0), seeds=(0, 1),
    )  # fmt: skip
    assert request.config == config and EXPERIMENT.folder == "drift-block"
    context = base.Context(cache_root=tmp_path)
    assert EXPERIMENT.lookup(request, context) is None
    result = EXPERIMENT.run(request, context)
    plain = run_drift_block(config, None)
    assert result.rows == plain.rows and result.from_cache == (False, False)
    assert EXPERIMENT.rows([result]) == [asdict(r) for r in plain.rows]
    assert EXPERIMENT.payload([result])["rows"] == [asdict(r) for r in plain.rows]
    assert EXPERIMENT.lookup(request, context).from_cache == (True, True)
    cache = EXPERIMENT.cache(tmp_path)
    assert EXPERIMENT.decode is not None
    for i, seed in enumerate(config.seeds):
        one = EXPERIMENT.decode(*cache.get_payload(config.key(seed)))
        alone = run_drift_block(replace(config, seeds=(seed,)), None)
        assert one.config == replace(config, seeds=(seed,), device="auto")
        assert one.rows == alone.rows == plain.rows[3 * i : 3 * i + 3]
        np.testing.assert_array_equal(one.score_hist, alone.score_hist)
        np.testing.assert_array_equal(one.score_edges, alone.score_edges)
