"""isotui.callbacks: the transformers Trainer's callback measures the model in training.

A tiny BERT (train-tiny's model on small sizes, dropout on, so its train/eval mode and the random
numbers matter) trains 6 steps with the Trainer, saving at steps 3 and 6, once without and once
with the callback probing every 3 steps (given as ``Trainer(callbacks=[...])``): the losses are
the same, the numbers at a step are ``isotui.run`` on the checkpoint the Trainer saved at that
step, and the recorded series opens as a checkpoint series (API, CLI, figure). Shorter trainings
at the callback's defaults: given in ``callbacks=[...]`` or attached, the scalars reach the log
history and every reporter's ``on_log`` but not the console (unless ``console=True``), and the
last step is probed (``max_steps``, or the step a callback stopped the training at).
"""

from __future__ import annotations

import math
import random
import re
import shlex
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

import isotui
from isotui.errors import IsotuiError
from isotui.results import LayerRow
from tests.reference import step_gradients_by_hand

# a long run (`make test-fast` leaves it out)
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY, SAMPLES = 6, 3, 48
FLOATS = [f.name for f in fields(LayerRow) if f.type in ("float", float)]


def _tokenizer():
    from transformers import AutoTokenizer

    from isotui.models.naming import bundled_minilm_dir

    tok = AutoTokenizer.from_pretrained(str(bundled_minilm_dir()))
    tok.model_max_length = 32
    return tok


def _train(out: Path, probe: bool, tok, accumulate: int = 1, steps: int = STEPS) -> tuple[list[dict], object]:
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from isotui.callbacks import IsotuiCallback
    from isotui.data.sources import load_samples, parse_data
    from isotui.experiments.train_tiny import Settings, build_model, pack_rows

    settings = Settings("bert", STEPS, (), 32, 2, 2, 32, 8, 1e-3, 0.1, 0)
    ids = tok(load_samples(parse_data("builtin"))[:400], add_special_tokens=False)["input_ids"]
    rows = pack_rows(ids, 32, tok.cls_token_id, tok.sep_token_id, tok.pad_token_id)
    torch.manual_seed(0)
    model = build_model(settings, tok)
    args = TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, save_strategy="steps",
        save_steps=EVERY, logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        gradient_accumulation_steps=accumulate,
    )  # fmt: skip

    callbacks = []
    if probe:  # the Hugging Face way: in the trainer's callbacks
        callbacks.append(
            IsotuiCallback("builtin", every=EVERY, max_samples=SAMPLES, experiments=("layers", "gradients"))
        )

    class Capturing(Trainer):
        """Keeps the weights, the batch, torch's generator and the loss of step EVERY's forward."""

        captured: dict | None = None

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            first = self.state.global_step + 1 == EVERY and self.captured is None
            if first:
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
                batch = {k: v.clone() for k, v in inputs.items()}
                self.captured = {"weights": weights, "batch": batch, "rng": torch.get_rng_state()}
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if first:
                self.captured["loss"] = loss.detach().item()
            return loss

    trainer = Capturing(
        model=model,
        args=args,
        train_dataset=[{"input_ids": r} for r in rows],
        data_collator=DataCollatorForLanguageModeling(tok),  # masks with torch's global generator
        processing_class=tok,
        callbacks=callbacks,
    )
    trainer.train()
    model.captured = trainer.captured
    return trainer.state.log_history, model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("callbacks")
    tok = _tokenizer()
    bare, _ = _train(root / "bare", False, tok)
    probed, model = _train(root / "probed", True, tok)
    return {"bare": bare, "probed": probed, "out": root / "probed", "model": model, "tok": tok}


def _losses(history: list[dict]) -> list[tuple[int, float]]:
    return [(h["step"], h["loss"]) for h in history if "loss" in h]


def test_training_with_the_callback_is_the_training_without_it(trained):
    bare, probed = _losses(trained["bare"]), _losses(trained["probed"])
    assert [s for s, _ in bare] == list(range(1, STEPS + 1))
    assert probed == bare  # bit for bit: dropout's mode and the collator's masking untouched


def _recorded(out: Path) -> dict[int, object]:
    from isotui.experiments.recorded import read_step, recorded_series

    return {c.step: read_step(c) for c in recorded_series(out / "isotui")}


def _same(a, b, tol: float) -> list[str]:
    bad = []
    assert [(r.component, r.layer) for r in a.rows] == [(r.component, r.layer) for r in b.rows]
    for ra, rb in zip(a.rows, b.rows, strict=True):
        for name in FLOATS:
            x, y = getattr(ra, name), getattr(rb, name)
            if not (math.isnan(x) and math.isnan(y)) and not abs(x - y) <= tol:
                bad.append(f"layer {ra.layer} {name}: {x!r} != {y!r}")
    return bad


@pytest.mark.parametrize("step", [EVERY, 2 * EVERY])
def test_numbers_at_a_step_are_the_run_on_that_steps_checkpoint(trained, step):
    recorded = _recorded(trained["out"])
    assert sorted(recorded) == [0, EVERY, 2 * EVERY]
    checkpoint = trained["out"] / f"checkpoint-{step}"
    posthoc = isotui.run(str(checkpoint), "builtin", max_samples=SAMPLES, cache=False, progress=False).result
    assert posthoc.meta["n_samples"] == recorded[step].meta["n_samples"] == SAMPLES
    assert _same(recorded[step], posthoc, 1e-9) == []
    assert _same(recorded[0], posthoc, 1e-9) != []  # the steps differ: the comparison can tell


def test_scalars_go_through_the_trainers_log(trained):
    recorded = _recorded(trained["out"])
    logged = {h["step"]: h for h in trained["probed"] if any(k.startswith("isotui/") for k in h)}
    assert sorted(logged) == [0, EVERY, 2 * EVERY]
    for step, result in recorded.items():
        for row in result.rows:
            assert logged[step][f"isotui/avg_cos/layer_{row.layer}"] == row.avg_cos
            assert logged[step][f"isotui/eff_rank/layer_{row.layer}"] == row.eff_rank
    assert not any(k.startswith("isotui/") for h in trained["bare"] for k in h)


def test_the_recorded_series_opens_as_a_checkpoint_series(trained, tmp_path, monkeypatch):
    from isotui.cli import main

    monkeypatch.setenv("ISOTUI_CACHE_DIR", str(tmp_path / "cache"))
    series = trained["out"] / "isotui"
    recorded = _recorded(trained["out"])
    found = isotui.experiment("checkpoints", checkpoints=[str(series)], progress=False).result
    assert found.steps() == [0, EVERY, 2 * EVERY]
    labels, grid = found.grid("avg_cos")
    for j, step in enumerate(found.steps()):
        assert list(grid[:, j]) == [r.avg_cos for r in recorded[step].rows]
    assert main(["experiment", "checkpoints", "-c", str(series), "--csv", str(tmp_path / "s.csv")]) == 0
    csv_text = (tmp_path / "s.csv").read_text()
    assert csv_text.count("step_000003") == len(labels)
    figure = tmp_path / "heat.png"
    assert main(["figure", "machina2024-heatmap", "-c", str(series), "--out", str(figure)]) == 0
    assert figure.stat().st_size > 0
    with pytest.raises(IsotuiError, match="qk-dynamics needs each checkpoint's weights"):
        isotui.experiment("qk-dynamics", checkpoints=[str(series)], progress=False)


def test_gradients_from_the_steps_own_backward(trained):
    """At step 3 the gradients are the step's own backward's: autograd.grad of the same loss on
    the same batch, measured with numpy; at step 0 (no step before it) the probe set's."""
    from isotui.experiments.recorded import recorded_gradients
    from isotui.experiments.train_tiny import Settings, build_model

    found = recorded_gradients(trained["out"] / "isotui")
    assert [found[s].meta["source"] for s in sorted(found)] == ["probe-set", "own-backward", "own-backward"]
    captured = trained["model"].captured
    fresh = build_model(Settings("bert", STEPS, (), 32, 2, 2, 32, 8, 1e-3, 0.1, 0), trained["tok"])
    expected, loss = step_gradients_by_hand(fresh, captured, trained["tok"])
    assert loss == captured["loss"]  # the recomputation is the step's forward
    for row, want in zip(found[EVERY].rows, expected, strict=True):
        assert (row.n_vectors, row.n_zero) == (want["n_vectors"], want["n_zero"])
        assert row.grad_avg_cos == pytest.approx(want["grad_avg_cos"], abs=1e-9)
        assert row.grad_mean_norm == pytest.approx(want["grad_mean_norm"], rel=1e-9)
        assert row.top_share == pytest.approx(want["top_share"], abs=1e-6)  # float32 products
    logged = {h["step"]: h for h in trained["probed"] if "isotui/gradients_own_backward" in h}
    assert {s: h["isotui/gradients_own_backward"] for s, h in logged.items()} == {0: 0.0, 3: 1.0, 6: 1.0}
    assert logged[EVERY]["isotui/top_share/layer_1"] == found[EVERY].rows[1].top_share


def test_gradient_accumulation_falls_back_to_the_probe_set(tmp_path):
    """Two batches per step: no own backward; the probe set's gradients, equal to the gradients
    experiment on the checkpoint the Trainer saved at that step."""
    from isotui.experiments.recorded import recorded_gradients

    _train(tmp_path, True, _tokenizer(), accumulate=2, steps=EVERY)
    found = recorded_gradients(tmp_path / "isotui")
    assert sorted(found) == [0, EVERY]
    assert found[EVERY].meta["source"] == "probe-set"
    assert "gradient accumulation (2 batches per step" in found[EVERY].meta["why"]
    posthoc = isotui.experiment(
        "gradients", model=str(tmp_path / f"checkpoint-{EVERY}"), data="builtin", max_samples=SAMPLES,
        cache=False, progress=False,
    ).result  # fmt: skip
    for got, want in zip(found[EVERY].rows, posthoc.rows, strict=True):
        for name in ("grad_avg_cos", "grad_mean_norm", "top_share", "random_share", "act_avg_cos"):
            assert getattr(got, name) == pytest.approx(getattr(want, name), abs=1e-9), name


def test_a_probe_keeps_the_mode_and_the_random_states(trained, monkeypatch):
    """A forward that draws random numbers (isotui's own does not: its reservoir has its own
    seeded generator) changes none of the training's."""
    import isotui.api
    from isotui.callbacks import Probe

    real_run = isotui.api.run

    def drawing_run(*args, **kwargs):
        random.random(), np.random.rand(), torch.rand(1)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(isotui.api, "run", drawing_run)
    model, tok = trained["model"], trained["tok"]
    model.train()
    model.bert.encoder.layer[0].eval()  # a mixed state comes back as it was
    before = [(n, m.training) for n, m in model.named_modules()]
    probe = Probe("builtin", every=1, max_samples=8, threads=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def draws():
        return random.random(), np.random.rand(), torch.rand(3).tolist()

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    expected = draws()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    scalars = probe.measure(model, 7, tokenizer=tok)
    assert draws() == expected
    assert torch.get_num_threads() == 1  # the run set 2 for itself
    torch.set_num_threads(threads)
    assert [(n, m.training) for n, m in model.named_modules()] == before
    assert set(scalars) >= {"isotui/avg_cos/layer_0", "isotui/isoscore/layer_2"}


def test_kept_rng_restores_what_was_drawn_inside():
    from isotui.callbacks import kept_rng

    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    with kept_rng():
        inside = (torch.rand(2).tolist(), np.random.rand(), random.random())
    assert (torch.rand(2).tolist(), np.random.rand(), random.random()) == inside


def test_bad_settings_are_one_sentence(tmp_path):
    from isotui.callbacks import IsotuiCallback, Probe
    from isotui.experiments.recorded import prepare_out

    with pytest.raises(IsotuiError, match=r"every= must be a whole number of at least 0 \(got -1\)"):
        Probe(every=-1)
    with pytest.raises(IsotuiError, match="metrics= has 'avg_coss', which is no layer metric"):
        Probe(metrics=["avg_coss"])
    with pytest.raises(IsotuiError, match="every=0 with at_end=False probes only at the steps of at="):
        Probe(every=0, at_end=False)
    with pytest.raises(IsotuiError, match=r"at_end= is True .* or False \(got 1\)"):
        Probe(at_end=1)
    with pytest.raises(IsotuiError, match=r"experiments= must be \('layers',\) or \('layers', 'gradients'\)"):
        Probe(experiments=["gradients"])
    with pytest.raises(IsotuiError, match=r"top_k= must be a whole number of at least 1 \(got 0\)"):
        Probe(experiments=["layers", "gradients"], top_k=0)
    with pytest.raises(IsotuiError, match="cache= is the probe's own to set"):
        Probe(cache=True)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(IsotuiError, match="is not empty and holds no recorded series"):
        prepare_out(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(IsotuiError, match=r"console= is False .* or True \(printed too\), not 'yes'"):
        IsotuiCallback(console="yes")
    callback = IsotuiCallback(every=10)
    with pytest.raises(
        IsotuiError, match=r"found no transformers Trainer calling it: give it to Trainer\(callbacks"
    ):
        callback.on_train_begin(None, None, None)


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


class _Reporter(transformers.TrainerCallback):
    """What a reporter of ``report_to`` receives (TensorBoard's, W&B's, MLflow's are callbacks
    whose ``on_log`` gets every ``trainer.log`` dict): the logs, by step."""

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))


class _StopAt(transformers.TrainerCallback):
    """Stops the training at the end of ``step``, after the callbacks before it saw that step's end."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _short(out: Path, tok, steps: int, callback, how: str = "callbacks", extra=(), disable_tqdm: bool = True):
    """A short training of the tiny BERT, the callback given as ``how`` says; the trainer."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from isotui.data.sources import load_samples, parse_data
    from isotui.experiments.train_tiny import Settings, build_model, pack_rows

    ids = tok(load_samples(parse_data("builtin"))[:200], add_special_tokens=False)["input_ids"]
    rows = pack_rows(ids, 32, tok.cls_token_id, tok.sep_token_id, tok.pad_token_id)
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, save_strategy="no",
        logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=disable_tqdm,
    )  # fmt: skip
    given = [callback] if how in ("callbacks", "both") else []
    trainer = Trainer(
        model=build_model(Settings("bert", steps, (), 32, 2, 2, 32, 8, 1e-3, 0.1, 0), tok), args=args,
        train_dataset=[{"input_ids": r} for r in rows], data_collator=DataCollatorForLanguageModeling(tok),
        processing_class=tok, callbacks=[*given, *extra],
    )  # fmt: skip
    if how in ("attach", "both"):
        assert callback.attach(trainer) is callback
    trainer.train()
    return trainer


def _probed_steps(history: list[dict]) -> list[int]:
    return [h["step"] for h in history if "isotui/avg_cos/layer_0" in h]


@pytest.mark.parametrize("how", ["callbacks", "attach", "both"])
def test_given_in_the_trainers_callbacks_or_attached(how, tok, tmp_path, capsys):
    """``Trainer(callbacks=[IsotuiCallback()])`` finds its trainer when training starts, as
    ``.attach(trainer)`` gives it (both: the callback is held once); at the defaults a 4-step
    training is probed at step 0 and at its last step; the scalars go to the log history and to
    every reporter, not to the console, where the trainer's own loss lines still go."""
    from isotui.callbacks import IsotuiCallback
    from isotui.experiments.recorded import recorded_series

    callback, reporter = IsotuiCallback(max_samples=16), _Reporter()
    trainer = _short(tmp_path, tok, 4, callback, how, extra=[reporter])
    assert callback.trainer is trainer
    assert [c for c in trainer.callback_handler.callbacks if c is callback] == [callback]
    assert _probed_steps(trainer.state.log_history) == [0, 4]
    assert [s for s, logs in reporter.logs if "isotui/avg_cos/layer_0" in logs] == [0, 4]
    assert [c.step for c in recorded_series(tmp_path / "isotui")] == [0, 4]
    printed = capsys.readouterr()
    assert "'loss'" in printed.out  # the trainer's own logs are printed as ever (PrinterCallback)
    assert "isotui/" not in printed.out + printed.err


def test_one_trainer_per_callback(tok, tmp_path):
    from transformers import Trainer, TrainingArguments

    from isotui.callbacks import IsotuiCallback
    from isotui.experiments.train_tiny import Settings, build_model

    model = build_model(Settings("bert", 1, (), 32, 2, 2, 32, 8, 1e-3, 0.1, 0), tok)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    callback = IsotuiCallback()
    first = Trainer(model=model, args=args, processing_class=tok, callbacks=[callback])
    assert callback.attach(first) is callback  # given already: held once
    assert [c for c in first.callback_handler.callbacks if c is callback] == [callback]
    with pytest.raises(IsotuiError, match="belongs to another trainer already; make one per trainer"):
        callback.attach(Trainer(model=model, args=args, processing_class=tok))


@pytest.mark.parametrize(
    ("disable_tqdm", "console"),
    [(False, False), (False, True), (True, True)],
    ids=["bar", "bar-console", "print-console"],
)
def test_the_console_shows_the_scalars_only_when_asked(disable_tqdm, console, tok, tmp_path, capsys):
    """The progress bar's (``ProgressCallback``) and ``PrinterCallback``'s lines hold the probe's
    scalars only with ``console=True``; the reporters get them either way."""
    from isotui.callbacks import IsotuiCallback

    reporter = _Reporter()
    callback = IsotuiCallback(max_samples=16, console=console)
    _short(tmp_path, tok, 2, callback, extra=[reporter], disable_tqdm=disable_tqdm)
    printed = capsys.readouterr()
    assert "'loss'" in printed.out
    assert ("isotui/avg_cos/layer_0" in printed.out) is console
    assert [s for s, logs in reporter.logs if "isotui/avg_cos/layer_0" in logs] == [0, 2]


@pytest.mark.parametrize(
    ("steps", "stop", "at_end", "probed", "sources"),
    [
        (3, None, True, [0, 3], {0: "probe-set", 3: "own-backward"}),
        (6, 2, True, [0, 2], {0: "probe-set", 2: "probe-set"}),
        (3, None, False, [0], {0: "probe-set"}),
    ],
    ids=["max-steps", "stopped-by-a-callback", "at-end-off"],
)
def test_the_last_step_is_probed_by_default(steps, stop, at_end, probed, sources, tok, tmp_path):
    """At ``every=100`` a short training is probed at its last step: ``max_steps`` (its own
    backward's gradients, hooked before that step) or the step a later callback stopped it at
    (probed at the epoch's end, before the trainer loads a best checkpoint or its reporters close;
    the probe set's gradients); ``at_end=False``: step 0 only."""
    from isotui.callbacks import IsotuiCallback
    from isotui.experiments.recorded import recorded_gradients

    callback = IsotuiCallback(max_samples=16, at_end=at_end, experiments=("layers", "gradients"))
    extra = [_StopAt(stop)] if stop is not None else []
    trainer = _short(tmp_path, tok, steps, callback, extra=extra)
    assert trainer.state.global_step == (stop or steps)
    assert _probed_steps(trainer.state.log_history) == probed
    found = recorded_gradients(tmp_path / "isotui")
    assert {s: g.meta["source"] for s, g in found.items()} == sources
    if stop is not None:
        assert "probed at the end of training" in found[stop].meta["why"]


def test_the_last_step_is_due_once():
    from isotui.callbacks import Probe

    probe = Probe(every=100)
    assert probe.due(0) and not probe.due(20) and probe.due(20, last=True) and probe.due(200, last=True)
    assert not Probe(every=100, at_end=False).due(20, last=True)
    probe.done.add(20)
    assert not probe.due(20, last=True)
    assert Probe(every=0).due(7, last=True) and not Probe(every=0).due(0)


def _page_python(page: Path, uses: str = "IsotuiCallback(") -> str:
    """The page's Python example that uses ``uses`` (the Trainer's; the Lightning one has its own)."""
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M)
    (code,) = [b for b in blocks if uses in b]
    return code


def test_the_docs_example_runs(tmp_path):
    """docs/callbacks.md: its Python example, then the commands of its console block, as written."""
    import os

    page = ROOT / "docs" / "callbacks.md"
    env = {**os.environ, "ISOTUI_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _page_python(page)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the probe's scalars are not printed (the trainer's loss lines are); the example's last line is
    # the value at the last step, probed at the defaults
    *lines, last = proc.stdout.strip().splitlines()
    assert last.startswith("120 isotui/avg_cos/layer_1 ")
    assert not any("isotui/" in line for line in lines) and any("'loss'" in line for line in lines)
    text = page.read_text(encoding="utf-8")
    (console,) = re.findall(r"^```console\n(.*?)^```", text, re.S | re.M)
    commands = [shlex.split(line[2:]) for line in console.splitlines() if line.startswith("$ ")]
    assert commands
    for argv in commands:
        assert argv[0] == "isotui"
        ran = subprocess.run(
            [sys.executable, "-m", "isotui", *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert ran.returncode == 0, f"{shlex.join(argv)}\n{ran.stderr[-2000:]}"
