"""isotui.callbacks.IsotuiLightningCallback: the model a LightningModule trains, measured in training.

A tiny BERT (train-tiny's model on small sizes, dropout on, the collator masking with torch's
global generator) inside a LightningModule trains 6 steps, once without and once with the
callback probing every 3 steps, a test callback saving the model at steps 3 and 6: the losses
are the same bit for bit, the numbers at a step are ``isotui.run`` on the model saved at that
step, the scalars are in the CSVLogger's metrics.csv at the probe's steps, and the series opens
as a checkpoint series.
"""

from __future__ import annotations

import csv
import math
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest

import isotui
from isotui.errors import IsotuiError
from isotui.results import LayerRow
from tests.reference import step_gradients_by_hand

# a long run (`make test-fast` leaves it out)
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning")

STEPS, EVERY, SAMPLES = 6, 3, 48
FLOATS = [f.name for f in fields(LayerRow) if f.type in ("float", float)]


def _tokenizer():
    from transformers import AutoTokenizer

    from isotui.models.naming import bundled_minilm_dir

    tok = AutoTokenizer.from_pretrained(str(bundled_minilm_dir()))
    tok.model_max_length = 32
    return tok


class TinyBert(L.LightningModule):
    """train-tiny's BERT, its masked-LM loss; every training loss kept."""

    def __init__(self, model, tokenizer) -> None:
        super().__init__()
        self.model, self.tokenizer, self.losses = model, tokenizer, []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.detach().item())
        self.log("loss", loss)  # the trainer's own logging, beside the callback's
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)


class SaveAt(L.Callback):
    """Saves the model (transformers' format) after the optimizer step of the steps given."""

    def __init__(self, root: Path, steps: tuple[int, ...]) -> None:
        self.root, self.steps = root, steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (
            trainer.global_step in self.steps
            and not (self.root / f"checkpoint-{trainer.global_step}").exists()
        ):
            pl_module.model.save_pretrained(self.root / f"checkpoint-{trainer.global_step}")
            pl_module.tokenizer.save_pretrained(self.root / f"checkpoint-{trainer.global_step}")


class Capture(L.Callback):
    """Before the batch of a step: the weights, the batch and torch's generator (a recomputation)."""

    def __init__(self, step: int) -> None:
        self.step, self.seen = step, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.step:
            weights = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
            self.seen = {"weights": weights, "batch": {k: v.clone() for k, v in batch.items()}}
            self.seen["rng"] = torch.get_rng_state()


def _fit(root: Path, probe: bool, tok, accumulate: int = 1, steps: int = STEPS) -> TinyBert:
    from lightning.pytorch.loggers import CSVLogger
    from transformers import DataCollatorForLanguageModeling

    from isotui.callbacks import IsotuiLightningCallback
    from isotui.data.sources import load_samples, parse_data
    from isotui.experiments.train_tiny import Settings, build_model, pack_rows

    settings = Settings("bert", STEPS, (), 32, 2, 2, 32, 8, 1e-3, 0.1, 0)
    ids = tok(load_samples(parse_data("builtin"))[:400], add_special_tokens=False)["input_ids"]
    rows = pack_rows(ids, 32, tok.cls_token_id, tok.sep_token_id, tok.pad_token_id)
    torch.manual_seed(0)
    module = TinyBert(build_model(settings, tok), tok)
    loader = torch.utils.data.DataLoader(
        [{"input_ids": r} for r in rows], batch_size=8, collate_fn=DataCollatorForLanguageModeling(tok)
    )
    callbacks: list = [SaveAt(root, (EVERY, 2 * EVERY)), Capture(EVERY)]
    if probe:
        callbacks.append(
            IsotuiLightningCallback(
                "builtin", every=EVERY, max_samples=SAMPLES, experiments=("layers", "gradients")
            )
        )
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, default_root_dir=str(root),
        logger=CSVLogger(str(root), name="csv"), log_every_n_steps=1, callbacks=callbacks,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, loader)
    module.captured = callbacks[1].seen
    return module


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    tok = _tokenizer()
    bare = _fit(root / "bare", False, tok)
    probed = _fit(root / "probed", True, tok)
    return {"bare": bare, "probed": probed, "out": root / "probed", "tok": tok}


def test_training_with_the_callback_is_the_training_without_it(fitted):
    assert len(fitted["bare"].losses) == STEPS
    assert fitted["probed"].losses == fitted["bare"].losses  # bit for bit


def _recorded(out: Path) -> dict[int, object]:
    from isotui.experiments.recorded import read_step, recorded_series

    return {c.step: read_step(c) for c in recorded_series(out / "isotui")}


def _differences(a, b, tol: float) -> list[str]:
    bad = []
    assert [(r.component, r.layer) for r in a.rows] == [(r.component, r.layer) for r in b.rows]
    for ra, rb in zip(a.rows, b.rows, strict=True):
        for name in FLOATS:
            x, y = getattr(ra, name), getattr(rb, name)
            if not (math.isnan(x) and math.isnan(y)) and not abs(x - y) <= tol:
                bad.append(f"layer {ra.layer} {name}: {x!r} != {y!r}")
    return bad


@pytest.mark.parametrize("step", [EVERY, 2 * EVERY])
def test_numbers_at_a_step_are_the_run_on_the_model_saved_at_that_step(fitted, step):
    recorded = _recorded(fitted["out"])
    assert sorted(recorded) == [0, EVERY, 2 * EVERY]
    saved = fitted["out"] / f"checkpoint-{step}"
    posthoc = isotui.run(str(saved), "builtin", max_samples=SAMPLES, cache=False, progress=False).result
    assert posthoc.meta["n_samples"] == recorded[step].meta["n_samples"] == SAMPLES
    assert _differences(recorded[step], posthoc, 1e-9) == []
    assert _differences(recorded[0], posthoc, 1e-9) != []  # the steps differ: the comparison can tell


def test_scalars_are_in_the_csv_loggers_metrics(fitted):
    recorded = _recorded(fitted["out"])
    (metrics,) = (fitted["out"] / "csv").glob("version_*/metrics.csv")
    with metrics.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("isotui/avg_cos/layer_1")]
    assert [int(r["step"]) for r in rows] == [0, EVERY, 2 * EVERY]
    for row in rows:
        for layer in recorded[int(row["step"])].rows:
            assert float(row[f"isotui/avg_cos/layer_{layer.layer}"]) == layer.avg_cos
            assert float(row[f"isotui/eff_rank/layer_{layer.layer}"]) == layer.eff_rank
    (bare,) = (fitted["out"].parent / "bare" / "csv").glob("version_*/metrics.csv")
    assert "isotui/" not in bare.read_text()

    def losses(path: Path) -> list[tuple[str, str]]:  # the module's own logging is unchanged
        with path.open(newline="") as f:
            return [(r["step"], r["loss"]) for r in csv.DictReader(f) if r.get("loss")]

    assert [s for s, _ in losses(bare)] == [str(s) for s in range(STEPS)]  # the weights' step
    assert losses(metrics) == losses(bare)


def test_the_series_opens_as_a_checkpoint_series(fitted, tmp_path, monkeypatch):
    from isotui.cli import main

    monkeypatch.setenv("ISOTUI_CACHE_DIR", str(tmp_path / "cache"))
    series = fitted["out"] / "isotui"
    recorded = _recorded(fitted["out"])
    found = isotui.experiment("checkpoints", checkpoints=[str(series)], progress=False).result
    assert found.steps() == [0, EVERY, 2 * EVERY]
    _, grid = found.grid("avg_cos")
    for j, step in enumerate(found.steps()):
        assert list(grid[:, j]) == [r.avg_cos for r in recorded[step].rows]
    assert main(["experiment", "checkpoints", "-c", str(series), "--csv", str(tmp_path / "s.csv")]) == 0


def _model(tok):
    from isotui.experiments.train_tiny import Settings, build_model

    return build_model(Settings("bert", STEPS, (), 32, 2, 2, 32, 8, 1e-3, 0.1, 0), tok)


def test_gradients_from_the_steps_own_backward(fitted):
    """At step 3 the callback's gradients are the step's own backward's: equal to autograd.grad of
    the same loss on the same batch, measured with numpy; step 0 (before any step) on the probe set."""
    from isotui.experiments.recorded import recorded_gradients

    found = recorded_gradients(fitted["out"] / "isotui")
    assert sorted(found) == [0, EVERY, 2 * EVERY]
    assert [found[s].meta["source"] for s in sorted(found)] == ["probe-set", "own-backward", "own-backward"]
    assert "no training step ran before it" in found[0].meta["why"]
    expected, loss = step_gradients_by_hand(_model(fitted["tok"]), fitted["probed"].captured, fitted["tok"])
    assert loss == fitted["probed"].losses[EVERY - 1]  # the recomputation is the step's forward
    rows = found[EVERY].rows
    assert len(rows) == len(expected) == 3
    for row, want in zip(rows, expected, strict=True):
        assert (row.n_vectors, row.n_zero) == (want["n_vectors"], want["n_zero"])
        assert row.grad_avg_cos == pytest.approx(want["grad_avg_cos"], abs=1e-9)
        assert row.grad_mean_norm == pytest.approx(want["grad_mean_norm"], rel=1e-9)
        assert row.top_share == pytest.approx(want["top_share"], abs=1e-6)  # float32 products
    assert rows[-1].n_zero > 0  # the last layer: only the masked positions have a gradient
    (metrics,) = (fitted["out"] / "csv").glob("version_*/metrics.csv")
    with metrics.open(newline="") as f:
        logged = {r["step"]: r for r in csv.DictReader(f) if r.get("isotui/gradients_own_backward")}
    assert {s: logged[s]["isotui/gradients_own_backward"] for s in logged} == {
        "0": "0.0",
        "3": "1.0",
        "6": "1.0",
    }
    assert float(logged["3"]["isotui/grad_avg_cos/layer_1"]) == rows[1].grad_avg_cos


def test_gradient_accumulation_falls_back_to_the_probe_set(tmp_path):
    """Two batches per step: no own backward; the probe set's gradients, equal to the gradients
    experiment on the model saved at that step."""
    tok = _tokenizer()
    module = _fit(tmp_path, True, tok, accumulate=2, steps=EVERY)
    from isotui.experiments.recorded import recorded_gradients

    found = recorded_gradients(tmp_path / "isotui")
    assert sorted(found) == [0, EVERY]
    assert found[EVERY].meta["source"] == "probe-set"
    assert "gradient accumulation (accumulate_grad_batches=2)" in found[EVERY].meta["why"]
    assert len(module.losses) == 2 * EVERY
    posthoc = isotui.experiment(
        "gradients", model=str(tmp_path / f"checkpoint-{EVERY}"), data="builtin", max_samples=SAMPLES,
        cache=False, progress=False,
    ).result  # fmt: skip
    for got, want in zip(found[EVERY].rows, posthoc.rows, strict=True):
        for name in ("grad_avg_cos", "grad_mean_norm", "top_share", "random_share", "act_avg_cos"):
            assert getattr(got, name) == pytest.approx(getattr(want, name), abs=1e-9), name


@pytest.mark.parametrize(
    ("limits", "at_end", "probed", "sources"),
    [
        ({"max_steps": 4}, True, [0, 4], {0: "probe-set", 4: "own-backward"}),
        ({"max_epochs": 1, "limit_train_batches": 3}, True, [0, 3], {0: "probe-set", 3: "probe-set"}),
        ({"max_steps": 4}, False, [0], {0: "probe-set"}),
    ],
    ids=["max-steps", "max-epochs", "at-end-off"],
)
def test_the_last_step_is_probed_by_default(limits, at_end, probed, sources, tmp_path):
    """At ``every=100`` a short fit is probed at its last step, as the Trainer's callback: the batch
    reaching ``max_steps`` (its own backward's gradients), or at the end of a fit bounded otherwise
    (``max_epochs``: ``on_train_end``, the probe set's gradients), the scalars in the CSV logger's
    file at that step; ``at_end=False``: step 0 only."""
    from lightning.pytorch.loggers import CSVLogger
    from transformers import DataCollatorForLanguageModeling

    from isotui.callbacks import IsotuiLightningCallback
    from isotui.data.sources import load_samples, parse_data
    from isotui.experiments.recorded import recorded_gradients
    from isotui.experiments.train_tiny import pack_rows

    tok = _tokenizer()
    ids = tok(load_samples(parse_data("builtin"))[:200], add_special_tokens=False)["input_ids"]
    rows = pack_rows(ids, 32, tok.cls_token_id, tok.sep_token_id, tok.pad_token_id)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(
        [{"input_ids": r} for r in rows], batch_size=8, collate_fn=DataCollatorForLanguageModeling(tok)
    )
    callback = IsotuiLightningCallback(max_samples=16, at_end=at_end, experiments=("layers", "gradients"))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, default_root_dir=str(tmp_path),
        logger=CSVLogger(str(tmp_path), name="csv"), callbacks=[callback], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **limits,
    )  # fmt: skip
    trainer.fit(TinyBert(_model(tok), tok), loader)
    assert trainer.global_step == (3 if "max_epochs" in limits else 4)
    found = recorded_gradients(tmp_path / "isotui")
    assert {s: g.meta["source"] for s, g in found.items()} == sources
    if "max_epochs" in limits:
        assert "probed at the end of training" in found[3].meta["why"]
    (metrics,) = (tmp_path / "csv").glob("version_*/metrics.csv")
    with metrics.open(newline="") as f:
        logged = [int(r["step"]) for r in csv.DictReader(f) if r.get("isotui/avg_cos/layer_1")]
    assert logged == probed


def test_only_rank_zero_probes(tmp_path):
    from isotui.callbacks import IsotuiLightningCallback

    logged = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append(step))
    callback = IsotuiLightningCallback(every=1, out=tmp_path / "series")
    other = SimpleNamespace(
        is_global_zero=False, global_step=0, default_root_dir=str(tmp_path), loggers=[logger]
    )
    callback.on_train_start(other, None)  # a module of None: reading it would fail
    callback.on_train_batch_end(other, None, None, None, 0)
    assert logged == [] and not (tmp_path / "series").exists()


def test_bad_settings_are_one_sentence(fitted, tmp_path):
    """Refused when training starts, before its first step (a probe after it never ends the
    training: tests/test_catalogue_training.py)."""
    from isotui.callbacks import IsotuiLightningCallback

    trainer = SimpleNamespace(
        is_global_zero=True, global_step=0, current_epoch=0, loggers=[], default_root_dir=str(tmp_path)
    )
    module = SimpleNamespace(model=fitted["probed"].model)  # no tokenizer attribute
    with pytest.raises(IsotuiError, match="give tokenizer= "):
        IsotuiLightningCallback(every=1).on_train_start(trainer, module)
    with pytest.raises(IsotuiError, match="model='net': the SimpleNamespace has no attribute 'net'"):
        IsotuiLightningCallback(every=1, model="net", tokenizer=fitted["tok"]).on_train_start(trainer, module)
    with pytest.raises(IsotuiError, match="model= is the LightningModule's attribute"):
        IsotuiLightningCallback(model=3)


def test_the_docs_example_runs(tmp_path):
    """docs/callbacks.md's Lightning example, as written, then the command it names."""
    import os
    import subprocess
    import sys

    from tests.test_callbacks import ROOT, _page_python

    env = {**os.environ, "ISOTUI_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = _page_python(ROOT / "docs" / "callbacks.md", "IsotuiLightningCallback(")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split()[:2] for line in proc.stdout.splitlines()]
    assert lines == [["0", "probe-set"], ["10", "own-backward"], ["20", "own-backward"]]
    assert (
        "isotui/avg_cos/layer_1"
        in (tmp_path / "runs/lightning/lightning_logs/version_0/metrics.csv").read_text()
    )
    argv = ["experiment", "checkpoints", "-c", "runs/lightning/isotui"]
    ran = subprocess.run(
        [sys.executable, "-m", "isotui", *argv], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
