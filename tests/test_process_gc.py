"""The whole process's garbage-collector costs (issue 15): no collection while a model loads, and
no walk over the whole heap at exit."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest


def test_model_load_pauses_the_collector_and_restores_it(tiny_models, monkeypatch):
    """Importing torch/transformers and building a model triggered ~1,100 collections (7 full)
    of a million long-lived objects; while a model loads, the collector is off, and afterwards
    it is as it was, also when the load fails."""
    from isotui.experiments import layer_pass
    from isotui.spec import make_spec

    real = layer_pass.parse_model  # called inside the load (after prepare)
    seen: list[bool] = []

    def watching(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(layer_pass, "parse_model", watching)
    prepared = layer_pass.prepare(make_spec(str(tiny_models["bert"]), max_samples=5))
    seen.clear()
    assert gc.isenabled()
    loaded, _ = layer_pass.load_prepared(prepared)
    assert loaded.model is not None
    assert seen == [False]
    assert gc.isenabled()

    def failing(*args, **kwargs):
        raise RuntimeError("no weights")

    monkeypatch.setattr(layer_pass, "parse_model", failing)
    with pytest.raises(RuntimeError):
        layer_pass.load_prepared(prepared)
    assert gc.isenabled()
    gc.disable()  # a caller that turned it off keeps it off
    try:
        monkeypatch.setattr(layer_pass, "parse_model", watching)
        layer_pass.load_prepared(prepared)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.slow
def test_the_command_freezes_the_heap_before_the_interpreter_shuts_down():
    """The shutdown's collections walked every object torch and transformers made (1-4 s per
    command): the CLI freezes them at exit. The check below is registered first, so runs last."""
    code = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0, flush=True))\n"
        "from isotui.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "frozen True"
