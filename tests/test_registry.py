"""The experiment registry drives the command line, ``cache ls/rm`` and the jobs: a registered
experiment gets its subcommand and its cache folder is listed and cleared without any other edit."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest

from tests.conftest import corpus


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def test_every_registered_experiment_has_its_subcommand_and_flags():
    from isotui.cli import build_parser
    from isotui.experiments.registry import REGISTRY

    top = _subcommands(build_parser())
    experiments = _subcommands(top["experiment"])
    assert [e.name for e in REGISTRY if e.command == "experiment"] == list(experiments)
    for exp in REGISTRY:
        parser = top["run"] if exp.command == "run" else experiments[exp.name]
        flags = _flags(parser)
        assert {"--csv", "--json", "--quiet", "--cache-dir", "--no-cache", "--device", "--seed"} <= flags
        if exp.inputs == "models":
            assert "--model" in flags
        if exp.inputs == "series":
            assert {"--model", "--checkpoints"} <= flags
        if exp.run_flags:
            assert {"--data", "--max-samples", "--max-length", "--batch-size", "--dtype"} <= flags


def _demo(monkeypatch):
    """One more registered experiment (a copy of gradients under a name and folder of its own)."""
    from isotui.experiments import registry

    gradients = registry.EXPERIMENTS["gradients"]
    demo = dataclasses.replace(gradients, name="demo-exp", folder="demo-folder", help="a demo")
    monkeypatch.setattr(registry, "REGISTRY", (*registry.REGISTRY, demo))
    monkeypatch.setattr(registry, "EXPERIMENTS", {**registry.EXPERIMENTS, "demo-exp": demo})
    return demo


def test_a_registered_experiment_gets_a_subcommand(monkeypatch):
    from isotui.cli import build_parser

    _demo(monkeypatch)
    experiments = _subcommands(_subcommands(build_parser())["experiment"])
    assert "demo-exp" in experiments and "--top-k" in _flags(experiments["demo-exp"])
    from isotui.cli.experiments import params_from_args

    demo = _demo(monkeypatch)
    args = build_parser().parse_args(["experiment", "demo-exp", "-m", "x", "--top-k", "3"])
    assert (args.experiment, args.models) == ("demo-exp", ["x"])
    assert params_from_args(demo, args).top_k == 3  # its parameters, parsed as the API's keywords are


def test_cache_ls_and_rm_all_cover_every_registered_folder(monkeypatch, tmp_path, capsys):
    from isotui.cli import main
    from isotui.experiments.registry import cache_folders
    from isotui.store.cache import ResultCache

    _demo(monkeypatch)
    folders = cache_folders()
    assert folders[0] == "runs" and "demo-folder" in folders
    assert {"attention", "final-norm", "gradients", "drift-block"} <= set(folders)
    root = tmp_path / "c"
    for i, folder in enumerate(folders):  # one entry in each, written as the cache writes any
        ResultCache(root, folder=folder, schema=1).put_payload(
            f"{i:032x}", {"model": f"m{i}", "meta": {}}, {"a": np.arange(3.0)}
        )
    assert main(["cache", "--cache-dir", str(root), "ls"]) == 0
    out = capsys.readouterr().out
    for folder in folders[1:]:
        assert f"{folder}: 1 cached result(s)" in out
    assert main(["cache", "--cache-dir", str(root), "rm", "--all"]) == 0
    err = capsys.readouterr().err
    assert f"removed {len(folders) - 1} cached experiment result(s)" in err and "removed 1 cached run" in err
    for folder in folders:
        assert not list((root / folder).glob("*.safetensors")), folder


def test_every_request_type_keeps_the_request_contract():
    from isotui.experiments.base import Request
    from isotui.experiments.registry import REGISTRY

    for exp in REGISTRY:
        for name in ("kind", "model", "device", "keys", "lookup", "compute", "measure"):
            assert hasattr(exp.request_type, name), (exp.name, name)
        assert exp.request_type.kind == exp.name
        for name in Request.__protocol_attrs__ if hasattr(Request, "__protocol_attrs__") else ():
            assert hasattr(exp.request_type, name), (exp.name, name)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(8)) + "\n", encoding="utf-8")
    return path


def test_the_layer_run_is_a_request_like_the_others(tmp_path, tiny_models, data):
    """The backend can run a layer job as it runs every other: lookup, compute (which stores),
    the same numbers as ``layerwise.measure`` and the same cache entry ``isotui run`` reads."""
    from isotui.experiments import layerwise
    from isotui.experiments.base import Context
    from isotui.experiments.layerwise import LayersRequest, request_for
    from isotui.spec import make_spec
    from isotui.store.cache import ResultCache

    spec = make_spec(str(tiny_models["bert"]), f"text:{data}", max_samples=6)
    request = request_for(spec)
    assert request == LayersRequest(spec) and request.kind == "layers" and request.model == spec.model
    root = tmp_path / "c"
    assert request.lookup(root, print) is None
    computed = request.compute(Context(root, notice=print))
    expected = layerwise.measure(spec, None)
    assert [r.avg_cos for r in computed.rows] == [r.avg_cos for r in expected.rows]
    assert request.keys(root)[0] == computed.key
    assert (root / "runs" / f"{computed.key}.safetensors").is_file()
    hit = request.lookup(root, print)
    assert hit.from_cache and [r.avg_cos for r in hit.rows] == [r.avg_cos for r in computed.rows]
    again = layerwise.measure(spec, ResultCache(root))
    assert again.from_cache


def test_load_reopens_any_registered_experiment_by_key(tiny_models, data, tmp_path):
    """``isotui.load`` reads every registered folder through the experiment's decode, and gives
    the rows, JSON and tables the experiment itself gave."""
    import isotui

    root = tmp_path / "c"
    r = isotui.experiment("final-norm", model=str(tiny_models["bert"]), data=f"text:{data}", cache_dir=root)
    (entry,) = (root / "final-norm").glob("*.safetensors")
    loaded = isotui.load(entry.stem[:10], cache_dir=root)
    assert loaded.command == "final-norm" and loaded.rows == r.rows
    assert loaded.payload["results"][0]["verdict"] == r.payload["results"][0]["verdict"]
    assert len(loaded.tables) == len(r.tables) == 1


def test_a_layers_request_resolves_once_and_takes_a_front_ends_steps(tmp_path):
    """The backend's fakes (prepare, compute) run through the request; lookup then compute
    resolve the spec once, as the backend's own layer branch did."""
    from isotui.errors import IsotuiError
    from isotui.experiments.base import Context
    from isotui.experiments.layer_pass import Prepared
    from isotui.experiments.layerwise import LayersRequest
    from isotui.spec import make_spec

    spec = make_spec("minilm", "builtin", max_samples=2)
    prepared: list = []

    def prepare(s):
        prepared.append(s)
        return Prepared(s, "f" * 32, [], "fp", "dfp", "float32", "cpu")

    def compute(p, on_progress, should_stop):
        raise IsotuiError(f"fake compute of {p.key[:4]}")

    request = LayersRequest(spec, compute_fn=compute, prepare_fn=prepare)
    assert request == LayersRequest(spec) and hash(request) == hash(LayersRequest(spec))
    assert request.lookup(tmp_path, print) is None
    with pytest.raises(IsotuiError, match="fake compute of ffff"):
        request.compute(Context(tmp_path, on_progress=print, notice=print))
    assert prepared == [spec]


def test_the_registry_imports_an_experiment_on_first_use_only():
    """Registry entries are ``"module:attr"`` strings: importing the registry imports no
    experiment's module; asking for one entry imports that module (and its request's)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from isotui.experiments import registry\n"
        "print(sorted(m for m in sys.modules if m.startswith('isotui.experiments.')))\n"
        "registry.get('gradients')\n"
        "m = sys.modules\n"
        "print('isotui.experiments.gradients' in m, 'isotui.experiments.attention' in m)\n"
        "print([e.name for e in registry.REGISTRY] == list(registry.TABLE))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    first, loaded, named = out.splitlines()
    assert first == "['isotui.experiments.registry']"
    assert loaded == "True False"
    assert named == "True"  # each entry under its experiment's own name


def test_every_experiment_that_streams_a_model_offers_the_run_options(monkeypatch):
    """Which run options an experiment takes is its own declaration (``run_options``), not a list
    of names elsewhere: a newly registered experiment over models, declaring nothing about them,
    gets --data, --device, --max-samples and --seed like every registered one."""
    from isotui.cli import build_parser
    from isotui.experiments import registry
    from isotui.experiments.base import Experiment

    default = next(f.default for f in dataclasses.fields(Experiment) if f.name == "run_options")
    demo = dataclasses.replace(
        registry.get("attention"), name="demo-mean-norm", folder="demo-mean-norm", run_options=default
    )
    monkeypatch.setattr(registry, "REGISTRY", (*registry.REGISTRY, demo))
    monkeypatch.setattr(registry, "EXPERIMENTS", {**registry.EXPERIMENTS, demo.name: demo})
    top = _subcommands(build_parser())
    experiments = _subcommands(top["experiment"])
    streaming = [e for e in registry.REGISTRY if e.inputs in ("models", "series")]
    assert {  # at least these (an experiment added by its registry line alone is checked too)
        "layers",
        "attention",
        "qk-dynamics",
        "checkpoints",
        "final-norm",
        "gradients",
        "token-types",
        demo.name,
    } <= {e.name for e in streaming}
    for exp in streaming:
        flags = _flags(top["run"] if exp.command == "run" else experiments[exp.name])
        assert {"--data", "--device", "--max-samples", "--seed"} <= flags, exp.name
    assert "--data" not in _flags(experiments["drift-block"])  # its own model, from its own flags
