"""``isotui train-tiny``: checkpoints on disk, loadable by isotui, deterministic, and learning.

Tiny sizes throughout (d=32, 2 layers, 2 heads, 32 tokens). The loss decrease is checked with a
loss computed here by hand (full logits, plain cross-entropy on a fixed batch), not with the
training code's own loss.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from isotui.cli import main
from isotui.experiments.train_tiny import checkpoint_dirs, pack_rows

from .conftest import corpus

TINY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--quiet"]


def train(out: Path, *extra: str) -> tuple[int, list[str]]:
    """Run ``isotui train-tiny`` in-process; the exit code and the lines it printed on stdout."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["train-tiny", "--out", str(out), *TINY, *extra])
    return code, buf.getvalue().splitlines()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One 40-step BERT and one 40-step GPT-2 run, shared by the tests below."""
    root = tmp_path_factory.mktemp("train-tiny")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        for arch in ("bert", "gpt2"):
            code, lines = train(root / arch, "--arch", arch, "--steps", "40", "--save-at", "10,20")
            assert code == 0
            assert lines == [str(root / arch / f"step_{s:06d}") for s in (0, 10, 20, 40)]
            out[arch] = root / arch
    return out


def safetensors_of(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_checkpoints_and_run_file(runs):
    for arch, out in runs.items():
        names = sorted(p.name for p in out.iterdir())
        assert names == ["step_000000", "step_000010", "step_000020", "step_000040", "train_tiny.json"]
        run = json.loads((out / "train_tiny.json").read_text())
        assert run["command"] == "train-tiny" and run["complete"] and not run["interrupted"]
        assert run["args"]["arch"] == arch and run["args"]["steps"] == 40
        assert [c["step"] for c in run["checkpoints"]] == [0, 10, 20, 40]
        assert [c["path"] for c in run["checkpoints"]] == [f"step_{s:06d}" for s in (0, 10, 20, 40)]
        assert all(c["train_loss"] > 0 for c in run["checkpoints"])
        assert run["seconds"] > 0 and {"torch", "transformers", "isotui"} <= set(run["versions"])
        for c in run["checkpoints"]:
            files = {p.name for p in (out / c["path"]).iterdir()}
            assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= files
        assert checkpoint_dirs(out) == [out / c["path"] for c in run["checkpoints"]]
        # the dynamics and checkpoints experiments take the run folder as a series
        from isotui.experiments.series import resolve_checkpoints

        series = resolve_checkpoints(None, [str(out)])
        assert [c.model for c in series] == [str(p) for p in checkpoint_dirs(out)]


def test_pack_rows():
    rows = pack_rows([[5, 6, 7], [8, 9], list(range(20, 33)), [40]], 8, bos=1, sep=2, pad=0)
    assert rows == [
        [1, 5, 6, 7, 2, 8, 9, 2],
        [1, 20, 21, 22, 23, 24, 25, 2],  # a sentence longer than a row: cut into row-sized pieces
        [1, 26, 27, 28, 29, 30, 31, 2],
        [1, 32, 2, 40, 2, 0, 0, 0],
    ]


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_checkpoints_load_through_isotui(runs, arch):
    from isotui.models.loading import load_model
    from isotui.models.naming import parse_model

    for step in ("step_000000", "step_000040"):
        ref = parse_model(str(runs[arch] / step))
        assert ref.kind == "local"
        loaded = load_model(ref, device="cpu", dtype="float32", seed=0, trust_remote_code=False)
        assert loaded.model_type == arch and loaded.modality == "text"
        assert loaded.tokenizer is not None and len(loaded.tokenizer) == 30522
        assert loaded.model.config.hidden_size == 32 and loaded.model.config.num_hidden_layers == 2


def fixed_batch(tokenizer):
    """32 corpus sentences as ``[CLS] s [SEP]``, padded to 32 tokens, with an attention mask."""
    return tokenizer(corpus(32), padding="max_length", truncation=True, max_length=32, return_tensors="pt")


def mlm_loss(folder: Path) -> float:
    """Masked-LM loss by hand: every 5th real token replaced by [MASK], full logits, plain CE."""
    import torch
    from transformers import AutoTokenizer, BertForMaskedLM

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = BertForMaskedLM.from_pretrained(str(folder)).eval()
    batch = fixed_batch(tok)
    ids, attention = batch["input_ids"], batch["attention_mask"]
    real = attention.bool() & (ids != tok.cls_token_id) & (ids != tok.sep_token_id)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    masked = real & (positions % 5 == 1)
    inputs = ids.masked_fill(masked, tok.mask_token_id)
    with torch.no_grad():
        logits = model(input_ids=inputs, attention_mask=attention).logits
    return float(torch.nn.functional.cross_entropy(logits[masked], ids[masked]))


def causal_loss(folder: Path) -> float:
    """Next-token loss by hand: full logits, targets shifted by one, padding out by the mask."""
    import torch
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = GPT2LMHeadModel.from_pretrained(str(folder)).eval()
    batch = fixed_batch(tok)
    ids, attention = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
    keep = attention[:, 1:].bool()
    return float(torch.nn.functional.cross_entropy(logits[:, :-1][keep], ids[:, 1:][keep]))


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_loss_goes_down(runs, arch):
    loss = mlm_loss if arch == "bert" else causal_loss
    first, last = loss(runs[arch] / "step_000000"), loss(runs[arch] / "step_000040")
    assert first == pytest.approx(10.33, abs=0.3)  # ~log(30522): an untrained model guesses uniformly
    assert last < first - 0.3


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    import torch

    threads = torch.get_num_threads()
    runs = {}
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        code, _ = train(tmp_path / name, "--steps", "6", "--seed", seed)
        assert code == 0
        runs[name] = safetensors_of(tmp_path / name / "step_000006")
    a, b, c = runs["a"], runs["b"], runs["c"]
    assert a.keys() == b.keys() == c.keys()
    assert all((a[k] == b[k]).all() for k in a)
    assert any(not (a[k] == c[k]).all() for k in a)
    losses = [
        [ck["train_loss"] for ck in json.loads((tmp_path / n / "train_tiny.json").read_text())["checkpoints"]]
        for n in "ab"
    ]
    assert losses[0] == losses[1]
    assert torch.get_num_threads() == threads  # --threads is undone for in-process callers


def test_isotui_run_on_a_checkpoint(runs):
    assert main(["run", "--model", str(runs["bert"] / "step_000040"), "--max-samples", "20", "-q"]) == 0


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("isotui: error:") and "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--steps", "0"], "--steps 0"),
        (["--steps", "-5"], "--steps -5"),
        (["--steps", "many"], "--steps 'many'"),
        (["--steps", "40", "--save-at", "0,10,50"], "--save-at step 50"),
        (["--save-at", "0,x"], "--save-at"),
        (["--save-every", "5", "--save-at", "0,10"], "only one"),
        (["--hidden", "30", "--heads", "4"], "--hidden 30"),
        (["--lr", "0"], "--lr"),
        (["--batch-size", "100000"], "--batch-size 100000"),
        (["--threads", "0"], "--threads 0"),
    ],
)
def test_bad_flags_are_one_sentence(tmp_path, capsys, extra, says):
    code, lines = train(tmp_path / "out", *extra)
    assert code == 2 and lines == []
    assert says in one_error(capsys)
    assert not any((tmp_path / "out").glob("step_*"))


def test_refuses_a_foreign_folder(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, _ = train(out, "--steps", "2")
    assert code == 2
    assert "not empty" in one_error(capsys)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    file_out = tmp_path / "a-file"
    file_out.write_text("x")
    assert train(file_out, "--steps", "2")[0] == 2
    assert "is a file" in one_error(capsys)


def test_earlier_run_needs_force(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "2")[0] == 0
    capsys.readouterr()
    assert train(out, "--steps", "2")[0] == 2
    err = one_error(capsys)
    assert "same settings" in err and "--force" in err
    assert train(out, "--steps", "3")[0] == 2
    assert "other settings" in one_error(capsys)
    code, lines = train(out, "--steps", "3", "--force")
    assert code == 0 and lines == [str(out / "step_000000"), str(out / "step_000003")]
    # the old step_000002 is gone, not left beside the new run
    assert sorted(p.name for p in out.iterdir()) == ["step_000000", "step_000003", "train_tiny.json"]


def test_interrupt_keeps_whole_checkpoints(tmp_path, monkeypatch, capsys):
    from isotui.experiments import train_tiny

    real_loss, calls = train_tiny._loss, []

    def loss_then_interrupt(*a, **k):
        calls.append(1)
        if len(calls) == 5:  # the init's loss, then steps 1-3; Ctrl-C during step 4
            raise KeyboardInterrupt
        return real_loss(*a, **k)

    monkeypatch.setattr(train_tiny, "_loss", loss_then_interrupt)
    out = tmp_path / "run"
    assert train(out, "--steps", "10", "--save-every", "2")[0] == 130
    assert sorted(p.name for p in out.iterdir()) == ["step_000000", "step_000002", "train_tiny.json"]
    run = json.loads((out / "train_tiny.json").read_text())
    assert run["interrupted"] and not run["complete"]
    assert [c["step"] for c in run["checkpoints"]] == [0, 2]
    assert "2 checkpoints" in capsys.readouterr().err
    monkeypatch.undo()
    assert train(out, "--steps", "10", "--save-every", "2")[0] == 2  # ours, but --force to redo it


def test_no_torch_at_import():
    code = (
        "import sys, isotui.experiments.train_tiny as t, isotui.cli.experiments; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'; "
        "print(t.HELP)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_default_schedule():
    from isotui.experiments.train_tiny import default_schedule

    assert default_schedule(400) == [0, 10, 20, 50, 100, 200, 400]
    assert default_schedule(10) == [0, 10]
    assert default_schedule(1) == [0, 1]
    assert default_schedule(1000) == [0, 10, 20, 50, 100, 200, 500, 1000]
