"""The fault catalogue, training: a probe never ends the training it measures (issue 35).

A tiny random-init GPT-2 (dropout on, so the random number generators matter) trains a few steps
with the transformers ``Trainer``, once bare and once with the callback probing every step while a
fault strikes a probe after the first: a plug-in metric raising (with the gradients' own-backward
hooks armed for that step), a full disk, a series folder replaced by a file, NaN hidden states, out
of memory (with the fault drawing random numbers, changing torch's threads and the train/eval
flags first). Each time the training reaches its last
step, its final weights equal the bare training's bit for bit, the failure is said once through
the trainer's logger and the step is skipped; a configuration error (``out=`` that cannot be
written, a bad run option, a plug-in failing at the first probe) is refused in one sentence
before the first step. Lightning's callback: the same for a plug-in failing at its second probe.
"""

from __future__ import annotations

import errno
import logging
import random
import warnings
from pathlib import Path

import numpy as np
import pytest

import isotui
from isotui.errors import IsotuiError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

STEPS, LENGTH, SAMPLES = 4, 16, 8
PLUGIN = "catalogue_fault"


def _tokenizer():
    from transformers import AutoTokenizer

    from isotui.models.naming import bundled_minilm_dir

    return AutoTokenizer.from_pretrained(str(bundled_minilm_dir()))


def _model(vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab, n_layer=2, n_embd=32, n_head=2, n_positions=LENGTH,
        bos_token_id=None, eos_token_id=None,  # GPT-2's 50256 is outside this vocabulary
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _rows() -> list[dict]:
    ids = np.random.default_rng(0).integers(1000, 3000, (32, LENGTH)).tolist()
    return [{"input_ids": r, "labels": r} for r in ids]


def _train(out: Path, tok, callback=None, *extra_callbacks) -> object:
    """The trainer, after training (``callback`` attached when given)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    model = _model(len(tok))
    args = TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=_rows(), data_collator=default_data_collator,
        processing_class=tok, callbacks=list(extra_callbacks),
    )  # fmt: skip
    if callback is not None:
        callback.attach(trainer)
    trainer.train()
    return trainer


def _callback(**kwargs):
    from isotui.callbacks import IsotuiCallback

    return IsotuiCallback(
        **{"data": "builtin", "every": 1, "max_samples": SAMPLES, "max_length": LENGTH, **kwargs}
    )


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _hooks(model) -> int:
    """Forward hooks on the model but transformers' own (its output capture, installed once at the
    first call that asks for hidden states, and kept)."""
    return sum(
        not getattr(h, "__module__", "").startswith("transformers.")
        for m in model.modules()
        for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
    )


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.fixture(scope="module")
def bare(tok, tmp_path_factory):
    """The training without the callback: its final weights and losses."""
    trainer = _train(tmp_path_factory.mktemp("bare"), tok)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"weights": _weights(trainer.model), "losses": losses}


class Said(logging.Handler):
    """What isotui says through the logger of transformers' callbacks."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("isotui:"):
            self.lines.append(record.getMessage())


@pytest.fixture
def said():
    """What the callback says through transformers' logger, at transformers' default verbosity
    (warnings) whatever an earlier test in this process set (``set_verbosity_error``)."""
    handler = Said()
    logger = logging.getLogger("transformers.trainer_callback")
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def probes(monkeypatch):
    """The number of the probe under way (1 at step 0): faults strike by it."""
    from isotui.callbacks import Probe

    count = {"n": 0}
    real = Probe.measure

    def counted(self, *args, **kwargs):
        count["n"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Probe, "measure", counted)
    return count


class Fault:
    """A plug-in metric that raises in batch() while ``on()`` says so."""

    name, version, columns = PLUGIN, "1", ("catalogue_mean",)

    def __init__(self, on) -> None:
        self.on = on

    def empty(self, dim, device):
        return {"s": torch.zeros((), dtype=torch.float64, device=device)}

    def batch(self, x):
        if self.on():
            raise ValueError("the plug-in's own bug")
        return {"s": x.sum().reshape(())}

    def merge(self, a, b):
        return {"s": a["s"] + b["s"]}

    def finalize(self, state):
        return (float(state["s"]),)


@pytest.fixture
def plugin():
    """Register a failing plug-in: ``plugin(on)``; unregistered after the test."""
    registered = []

    def register(on):
        isotui.register_metric(Fault(on))
        registered.append(PLUGIN)

    yield register
    for name in registered:
        isotui.unregister_metric(name)


def _went_on(trainer, bare, out: Path, probed: list[int]) -> None:
    """The training reached its last step, as the bare one: same weights bit for bit, same losses,
    no hook left; the series holds the probes that worked."""
    from isotui.experiments.recorded import recorded_series

    assert trainer.state.global_step == STEPS
    weights = _weights(trainer.model)
    assert weights.keys() == bare["weights"].keys()
    assert [k for k in weights if not torch.equal(weights[k], bare["weights"][k])] == []
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h] == bare["losses"]
    assert _hooks(trainer.model) == 0
    assert trainer.model.training  # the train/eval flags as the training left them
    if out.is_dir():
        assert [c.step for c in recorded_series(out)] == probed
    logged = sorted({h["step"] for h in trainer.state.log_history if "isotui/avg_cos/layer_0" in h})
    assert logged == probed


# --- after the first probe: said once, skipped, the training goes on bit for bit -----------------


@pytest.mark.slow
def test_a_plug_in_failing_at_the_second_probe(tok, bare, tmp_path, said, probes, plugin):
    """With gradients: the step's own-backward hooks, armed before the step, are removed too."""
    plugin(lambda: probes["n"] == 2)
    callback = _callback(out=tmp_path / "series", experiments=("layers", "gradients"), top_k=2)
    trainer = _train(tmp_path, tok, callback)
    _went_on(trainer, bare, tmp_path / "series", [0, 2, 3, 4])
    from isotui.experiments.recorded import recorded_gradients

    sources = {s: g.meta["source"] for s, g in recorded_gradients(tmp_path / "series").items()}
    assert sources == {0: "probe-set", 2: "own-backward", 3: "own-backward", 4: "own-backward"}
    assert callback.probe.skipped.keys() == {1}
    (line,) = said
    assert line.startswith("isotui: the probe at step 1 failed and is skipped, the training goes on")
    assert f"'{PLUGIN}'" in line and "the plug-in's own bug" in line


@pytest.mark.slow
def test_a_full_disk_is_said_once_for_every_later_probe(tok, bare, tmp_path, said, probes, monkeypatch):
    """From the second probe on the disk is full: every later probe is skipped, said once."""
    import isotui.store.cache

    real = isotui.store.cache.write_bytes_atomic

    def full(*args, **kwargs):
        if probes["n"] >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(isotui.store.cache, "write_bytes_atomic", full)
    callback = _callback(out=tmp_path / "series")
    trainer = _train(tmp_path, tok, callback)
    _went_on(trainer, bare, tmp_path / "series", [0])
    assert sorted(callback.probe.skipped) == [1, 2, 3, 4]
    (line,) = said
    assert "could not write to the cache" in line and "No space left on device" in line


@pytest.mark.slow
def test_a_series_folder_replaced_by_a_file(tok, bare, tmp_path, said):
    """A real write failure (root writes through chmod, not into a file): after step 0 the series
    folder becomes a file."""
    from transformers import TrainerCallback

    out = tmp_path / "series"

    class Replace(TrainerCallback):  # runs before the probe of step 1 (added first)
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                for f in sorted(out.rglob("*"), reverse=True):
                    f.rmdir() if f.is_dir() else f.unlink()
                out.rmdir()
                out.write_text("not a folder")

    callback = _callback(out=out)
    trainer = _train(tmp_path, tok, callback, Replace())
    _went_on(trainer, bare, out, [0])  # step 0 logged; no series left to read
    assert sorted(callback.probe.skipped) == [1, 2, 3, 4]
    (line,) = said
    assert "could not write to the cache in" in line


@pytest.mark.slow
def test_nan_hidden_states_at_a_probe(tok, bare, tmp_path, said, probes):
    """A diverging model's states: NaN out of the first block, at the second probe only (in eval
    mode: the training's forwards are untouched)."""
    callback = _callback(out=tmp_path / "series")

    def nan_out(module, args, output):
        if module.training or probes["n"] != 2:
            return None
        if isinstance(output, tuple):
            return (torch.full_like(output[0], float("nan")), *output[1:])
        return torch.full_like(output, float("nan"))

    from transformers import TrainerCallback

    class Hook(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.handle = model.transformer.h[0].register_forward_hook(nan_out)

        def on_train_end(self, args, state, control, **kwargs):
            self.handle.remove()

    trainer = _train(tmp_path, tok, callback, Hook())
    _went_on(trainer, bare, tmp_path / "series", [0, 2, 3, 4])
    assert callback.probe.skipped.keys() == {1}
    (line,) = said
    assert line.startswith("isotui: the probe at step 1 failed and is skipped")
    assert "(the hidden states of layer 1, layer 2 are not finite (NaN or inf))" in line


@pytest.mark.slow
def test_out_of_memory_after_touching_everything(tok, bare, tmp_path, said, probes, monkeypatch):
    """An out-of-memory error reaching the probe after the run drew random numbers, set torch's
    threads and put the model in eval mode: all of it back, the training bit for bit."""
    import isotui.api

    real = isotui.api.run
    threads = torch.get_num_threads()

    def hungry(model, *args, **kwargs):
        if probes["n"] == 3:
            random.random(), np.random.rand(), torch.rand(4)
            torch.set_num_threads(threads + 1)
            model.eval()
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\n(details)")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(isotui.api, "run", hungry)
    callback = _callback(out=tmp_path / "series")
    trainer = _train(tmp_path, tok, callback)
    _went_on(trainer, bare, tmp_path / "series", [0, 1, 3, 4])
    assert torch.get_num_threads() == threads
    (line,) = said
    assert "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)" in line
    assert "(details)" not in line  # the first line of the message


# --- before the first step: configuration refused in one sentence --------------------------------


def _refused(tmp_path, tok, callback, match: str) -> None:
    from transformers import TrainerCallback

    steps = []

    class Count(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    with pytest.raises(IsotuiError, match=match) as caught:
        _train(tmp_path, tok, callback, Count())
    assert steps == []  # no training step ran
    assert len(str(caught.value).splitlines()) == 1


@pytest.mark.slow
def test_configuration_is_refused_before_the_first_step(tok, tmp_path, plugin):
    (tmp_path / "a-file").write_text("mine")
    _refused(tmp_path, tok, _callback(out=tmp_path / "a-file" / "series"), r"out='.*a-file/series' cannot be")
    _refused(tmp_path, tok, _callback(out=tmp_path / "a-file"), "out='.*a-file' is a file")
    assert (tmp_path / "a-file").read_text() == "mine"
    # no probe at step 0 (every=0): the options are checked all the same
    _refused(tmp_path, tok, _callback(every=0, at=[2], nosuch=1), "isotui.run has no option 'nosuch'")
    _refused(tmp_path, tok, _callback(every=0, at=[2], data="no/such/file.txt"), "no/such/file.txt")
    # a plug-in failing at the first probe (step 0, before training): refused, not skipped
    plugin(lambda: True)
    _refused(tmp_path, tok, _callback(out=tmp_path / "s"), f"'{PLUGIN}' failed in batch")


def test_out_with_missing_parents_is_made(tmp_path):
    """A researcher's ``out=runs/today/series``: the folders are made, as the Trainer makes its
    ``output_dir``; a folder that cannot be made is one sentence naming ``out=``."""
    from isotui.callbacks import Probe

    probe = Probe(every=1, out=tmp_path / "runs" / "today" / "series")
    probe.start()
    assert (tmp_path / "runs" / "today" / "series").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(IsotuiError, match=r"^out='.*file/x' cannot be written \(Not a directory\); give"):
        Probe(every=1, out=tmp_path / "file" / "x").start()


def test_a_cache_write_error_is_an_isotui_error():
    """The sentence of a cache that cannot be written reaches the user as itself (the app, the
    command line and the service catch IsotuiError), not as an internal error."""
    from isotui.backend import failure_sentence
    from isotui.store.cache import CacheWriteError

    exc = CacheWriteError("could not write to the cache in /x (No space left on device); kept")
    assert isinstance(exc, IsotuiError)
    assert failure_sentence(exc) == str(exc)


def test_a_failed_probe_of_a_diverged_model_says_so(tmp_path):
    """Weights holding NaN: the failure's sentence says the training may be diverging; a failure
    before training is raised as one sentence, after it said once per reason and skipped."""
    from isotui.callbacks import Probe

    model = torch.nn.Linear(2, 2)
    probe = Probe(every=1)

    def fail():
        raise RuntimeError("boom\nsecond line")

    lines: list[str] = []
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    assert probe.attempt(5, fail, lines.append, model=model) is None
    assert probe.attempt(6, fail, lines.append, model=model) is None  # the same reason: not said again
    (line,) = lines
    assert "(RuntimeError: boom; the model's weights hold NaN or inf (is the training diverging?))" in line
    assert probe.skipped.keys() == {5, 6} and not probe.due(5)
    before = r"^the probe at step 0, before training, failed: RuntimeError: boom"
    with pytest.raises(IsotuiError, match=before):
        probe.attempt(0, fail, lines.append, before_training=True)

    def refuse():
        raise IsotuiError("a sentence")

    with pytest.raises(IsotuiError, match=r"^a sentence$"):  # a refusal before training: as it is
        probe.attempt(0, refuse, lines.append, before_training=True)


# --- Lightning ------------------------------------------------------------------------------------


def _fit(root: Path, tok, callback=None, tokenizer: bool = True, ran: list | None = None):
    """A Lightning training of the tiny GPT-2: (trainer, module); ``tokenizer=False``: the
    module has no ``tokenizer`` attribute; ``ran``: gets each training step's batch index."""
    L = pytest.importorskip("lightning")
    from transformers import default_data_collator

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model(len(tok))
            if tokenizer:
                self.tokenizer = tok

        def training_step(self, batch, batch_idx):
            (ran if ran is not None else []).append(batch_idx)
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    module = Tiny()
    loader = torch.utils.data.DataLoader(
        _rows(), batch_size=4, shuffle=True, collate_fn=default_data_collator,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, default_root_dir=str(root), logger=False,
        callbacks=[] if callback is None else [callback], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, loader)
    return trainer, module


@pytest.mark.slow
def test_lightning_a_plug_in_failing_at_the_second_probe(tok, tmp_path, probes, plugin):
    from isotui.callbacks import IsotuiLightningCallback
    from isotui.experiments.recorded import recorded_series

    _, bare = _fit(tmp_path / "bare", tok)
    plugin(lambda: probes["n"] == 2)
    callback = IsotuiLightningCallback("builtin", every=1, max_samples=SAMPLES, max_length=LENGTH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, probed = _fit(tmp_path / "probed", tok, callback)
    assert trainer.global_step == STEPS
    before, after = _weights(bare.model), _weights(probed.model)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert _hooks(probed.model) == 0
    said = [w for w in caught if str(w.message).startswith("isotui:")]
    (warning,) = said
    line = str(warning.message)
    assert line.startswith("isotui: the probe at step 1 failed and is skipped") and f"'{PLUGIN}'" in line
    assert warning.category is RuntimeWarning
    assert [c.step for c in recorded_series(tmp_path / "probed" / "isotui")] == [0, 2, 3, 4]


@pytest.mark.slow
def test_lightning_refuses_a_missing_tokenizer_before_the_first_step(tok, tmp_path):
    """No probe at step 0 (every=0): the missing tokenizer is refused at the start all the same."""
    from isotui.callbacks import IsotuiLightningCallback

    callback = IsotuiLightningCallback("builtin", every=0, at=[2], max_samples=SAMPLES)
    ran: list[int] = []
    with pytest.raises(IsotuiError, match="give tokenizer= "):
        _fit(tmp_path, tok, callback, tokenizer=False, ran=ran)
    assert ran == []  # no training step
