"""``isotui train-tiny``: pretrain a small BERT or GPT-2 from scratch on CPU, keeping checkpoints.

Godey et al. (2024, Fig. 11-15) follow queries and keys along pretraining checkpoints. Public
checkpoint series cannot be downloaded offline, so this command makes one in a few minutes: a
model built from a config (transformers' own random init), the bundled MiniLM WordPiece
tokenizer, the built-in corpus packed into fixed-length rows, AdamW with warmup and linear decay.

Output folder::

    DIR/step_000000/   the init (always), then each requested step and the last one; each a
    DIR/step_000010/   save_pretrained folder (safetensors + tokenizer) that `isotui run --model`
    ...                loads like any local model
    DIR/train_tiny.json   settings, per-checkpoint training loss, seconds, versions

Each checkpoint is written to a hidden temporary folder and renamed into place, and the JSON is
rewritten (atomically) after every checkpoint, so an interrupted run leaves only whole checkpoints
and a JSON that lists them (and says ``interrupted``). Deterministic on CPU for a given seed and
thread count (the JSON records both): the init comes from ``torch.manual_seed(seed)``, the batch
order and the masking from their own seeded generators. On a GPU, kernels may not be bitwise
repeatable.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict, cast

from isotui.errors import Cancelled, IsotuiError

if TYPE_CHECKING:
    import torch
    from transformers import (
        BertForMaskedLM,
        DataCollatorForLanguageModeling,
        GPT2LMHeadModel,
        PreTrainedModel,
        PreTrainedTokenizerBase,
    )

HELP = (
    "pretrain a tiny BERT (masked LM) or GPT-2 (causal LM) from scratch on the built-in corpus, "
    "saving checkpoints for the training-dynamics experiments"
)
RUN_FILE = "train_tiny.json"
FORMAT = 1
ARCHS = ("bert", "gpt2")


class _Defaults(TypedDict):
    """The flags' defaults, one type per key (batch size per architecture)."""

    steps: int
    hidden: int
    layers: int
    heads: int
    seq_len: int
    batch_size: dict[str, int]
    lr: float
    seed: int
    dropout: float


DEFAULTS: _Defaults = {
    "steps": 400,
    "hidden": 128,
    "layers": 4,
    "heads": 4,
    "seq_len": 64,
    # Per objective: MLM learns from the 15% masked tokens only, so BERT takes more rows per step
    # (~240 masked targets) than GPT-2 (~420 next-token targets); both runs take ~2.5 min on 2 cores.
    "batch_size": {"bert": 32, "gpt2": 8},
    "lr": 1e-3,
    "seed": 0,
    "dropout": 0.0,
}


class _Printer(Protocol):
    """Where a run's lines go (a rich Console on stderr)."""

    def print(self, *objects: object, highlight: bool | None = None) -> None: ...


class _Saves(Protocol):
    """A model that saves itself (its keywords differ across transformers versions)."""

    @property
    def save_pretrained(self) -> Callable[..., object]: ...


class RunCheckpoint(TypedDict):
    """One checkpoint of ``train_tiny.json``."""

    step: int
    path: str
    train_loss: float
    loss_steps: int
    lr: float
    seconds: float


class RunData(TypedDict):
    """The corpus of ``train_tiny.json``."""

    source: str
    fingerprint: str
    sentences: int
    rows: int
    tokens: int
    padding_fraction: float
    steps_per_epoch: int


RunModel = TypedDict("RunModel", {"class": str, "parameters": int})  # "class": not a Python name


class TrainRun(TypedDict):
    """``train_tiny.json``: a run's settings, corpus, model, checkpoints and state."""

    command: str
    format: int
    args: dict[str, object]
    model: RunModel
    data: RunData
    device: str
    torch_threads: int
    versions: dict[str, str]
    checkpoints: list[RunCheckpoint]
    complete: bool
    interrupted: bool
    seconds: float


class _TrainState(TypedDict):
    """What the checkpoints of a run need from the steps before them."""

    last_saved: int  # the step of the last checkpoint written
    init_loss: float  # the loss of the init, on the first batch
    lr: float  # the learning rate of the last update


WARMUP_FRACTION = 0.1
WEIGHT_DECAY = 0.01
CLIP_NORM = 1.0
MLM_PROBABILITY = 0.15
LOSS_WINDOW = 20  # a checkpoint's training loss: the mean over at most this many steps before it
_STEP_DIR = re.compile(r"^step_\d{6,}$")
_TMP_DIR = re.compile(r"^\.step_\d{6,}\.tmp-\d+$")


@dataclass(frozen=True)
class Settings:
    """Validated settings: everything the checkpoints depend on (device aside)."""

    arch: str
    steps: int
    save_at: tuple[int, ...]
    hidden: int
    layers: int
    heads: int
    seq_len: int
    batch_size: int
    lr: float
    dropout: float
    seed: int

    def as_json(self) -> dict[str, object]:
        return {
            "arch": self.arch,
            "steps": self.steps,
            "save_at": list(self.save_at),
            "hidden": self.hidden,
            "layers": self.layers,
            "heads": self.heads,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "lr": self.lr,
            "dropout": self.dropout,
            "seed": self.seed,
            "data": "builtin",
            "warmup_fraction": WARMUP_FRACTION,
            "weight_decay": WEIGHT_DECAY,
            "clip_norm": CLIP_NORM,
            **({"mlm_probability": MLM_PROBABILITY} if self.arch == "bert" else {}),
        }


def whole_number(value: str | None, flag: str, default: int, *, minimum: int) -> int:
    if value is None:
        return default
    try:
        number = int(str(value).strip())
    except ValueError:
        raise IsotuiError(f"{flag} {value!r} is not a whole number; give e.g. {flag} {default}") from None
    if number < minimum:
        raise IsotuiError(f"{flag} {number} is too small; it must be at least {minimum}")
    return number


def real_number(
    value: str | None, flag: str, default: float, *, low: float, high: float | None = None
) -> float:
    if value is None:
        return default
    try:
        number = float(str(value).strip())
    except ValueError:
        raise IsotuiError(f"{flag} {value!r} is not a number; give e.g. {flag} {default:g}") from None
    if not math.isfinite(number) or number < low or (high is not None and number >= high):
        where = f"at least {low:g}" if high is None else f"in [{low:g}, {high:g})"
        raise IsotuiError(f"{flag} {value} is out of range; it must be {where}")
    if number == 0 and flag == "--lr":
        raise IsotuiError("--lr 0 would not train at all; give a positive learning rate such as 1e-3")
    return number


def default_schedule(steps: int) -> list[int]:
    """0, then 10, 20, 50, 100, 200, 500, ... below ``steps``, then ``steps``: dense early, where
    the geometry moves fastest (like Pythia's log-spaced early checkpoints)."""
    out, scale = [0], 1
    while True:
        for m in (10, 20, 50):
            if m * scale >= steps:
                return [*out, steps]
            out.append(m * scale)
        scale *= 10


def default_threads() -> int:
    """Half the CPU cores (at least 1, at most 8). Measured on a 2-core machine shared with other
    jobs: the default 400-step BERT took 135 s on 1 thread and 875 s on 2, the two threads
    spin-waiting for cores that other processes held; tiny matrices gain little from more threads."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def read_run(out: Path) -> TrainRun | None:
    """The ``train_tiny.json`` of an earlier run in ``out``, or None if there is none (or it is
    not one of ours)."""
    try:
        payload = json.loads((out / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(payload, dict) or payload.get("command") != "train-tiny":
        return None
    return cast("TrainRun", payload)  # a train-tiny run's file, as train() wrote it


def checkpoint_dirs(out: Path) -> list[Path]:
    """The checkpoint folders of a train-tiny run, in step order (for ``--checkpoints``)."""
    payload = read_run(Path(out))
    if payload is None:
        raise IsotuiError(
            f"{out} holds no train-tiny run ({RUN_FILE} is missing); train one with isotui train-tiny"
        )
    return [Path(out) / c["path"] for c in payload.get("checkpoints", [])]


def prepare_out(out: Path, settings: Settings, force: bool) -> None:
    """Refuse a foreign or earlier output (unless --force for ours); clear ours when forced."""
    if out.exists() and not out.is_dir():
        raise IsotuiError(f"--out {out} is a file, not a folder; give a new or empty folder")
    try:
        if not out.exists() or not any(out.iterdir()):
            out.mkdir(parents=True, exist_ok=True)
            return
    except OSError as exc:
        raise IsotuiError(
            f"--out {out} cannot be created or read ({exc.strerror}); give a folder you can write to"
        ) from None
    earlier = read_run(out)
    if earlier is None:
        raise IsotuiError(
            f"--out {out} is not empty and holds no train-tiny run, so isotui will not write into it; "
            "give a new or empty folder"
        )
    if not force:
        same = earlier.get("args") == settings.as_json()
        what = "the same settings" if same else "other settings"
        raise IsotuiError(
            f"--out {out} already holds a train-tiny run with {what}; pass --force to overwrite it, "
            "or give another folder"
        )
    for entry in out.iterdir():  # only what a train-tiny run writes; anything else stays
        if entry.is_dir() and (_STEP_DIR.match(entry.name) or _TMP_DIR.match(entry.name)):
            shutil.rmtree(entry)
    (out / RUN_FILE).unlink(missing_ok=True)


def _write_json(path: Path, payload: TrainRun) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def pack_rows(sentences: list[list[int]], seq_len: int, bos: int, sep: int, pad: int) -> list[list[int]]:
    """Whole sentences packed greedily, in corpus order, into rows ``[bos] s1 [sep] s2 [sep] ...``
    padded to ``seq_len`` (a sentence longer than a row is cut into row-sized pieces). The same
    layout serves both objectives, and matches how the tokenizer frames one sentence
    (``[CLS] s [SEP]``), which is how ``isotui run`` feeds the checkpoints later."""
    piece = seq_len - 2
    rows: list[list[int]] = []
    row = [bos]
    for ids in sentences:
        for start in range(0, len(ids), piece):
            chunk = [*ids[start : start + piece], sep]
            if len(row) + len(chunk) > seq_len:
                rows.append(row + [pad] * (seq_len - len(row)))
                row = [bos]
            row.extend(chunk)
    if len(row) > 1:
        rows.append(row + [pad] * (seq_len - len(row)))
    return rows


def build_model(settings: Settings, tokenizer: PreTrainedTokenizerBase) -> BertForMaskedLM | GPT2LMHeadModel:
    """A randomly initialised BertForMaskedLM or GPT2LMHeadModel (transformers' own init)."""
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    s = settings
    if s.arch == "bert":
        config = BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=s.hidden,
            num_hidden_layers=s.layers,
            num_attention_heads=s.heads,
            intermediate_size=4 * s.hidden,
            max_position_embeddings=s.seq_len,
            hidden_dropout_prob=s.dropout,
            attention_probs_dropout_prob=s.dropout,
            pad_token_id=tokenizer.pad_token_id,
        )
        return BertForMaskedLM(config)
    gpt_config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=s.hidden,
        n_layer=s.layers,
        n_head=s.heads,
        n_positions=s.seq_len,
        resid_pdrop=s.dropout,
        embd_pdrop=s.dropout,
        attn_pdrop=s.dropout,
        bos_token_id=tokenizer.cls_token_id,  # each row and each sentence starts like [CLS] s [SEP]
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(gpt_config)


def _loss(model: PreTrainedModel, arch: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The training loss, with the vocabulary head applied only where there is a label.

    The same mean cross-entropy as ``model(**batch, labels=...)`` (masked tokens for BERT; next
    tokens, padding excluded, for GPT-2), without computing 30k logits for every other position.
    """
    import torch.nn.functional as F

    if arch == "bert":
        bert = cast("BertForMaskedLM", model)  # build_model's model for "bert"
        hidden = bert.bert(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            token_type_ids=batch["token_type_ids"],
        ).last_hidden_state
        labels = batch["labels"]
        keep = labels != -100
        logits = bert.cls(hidden[keep])
        return F.cross_entropy(logits.float(), labels[keep])
    gpt2 = cast("GPT2LMHeadModel", model)  # build_model's model for "gpt2"
    hidden = gpt2.transformer(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    logits = gpt2.lm_head(hidden[:, :-1][keep])
    return F.cross_entropy(logits.float(), targets[keep])


class _Batches:
    """Deterministic batches: a seeded permutation of the rows per epoch (the last partial batch
    of an epoch is dropped), BERT masking from the collator's own seeded generator."""

    def __init__(
        self, rows: torch.Tensor, settings: Settings, tokenizer: PreTrainedTokenizerBase, device: str
    ) -> None:
        import torch

        self.rows = rows  # LongTensor [n, seq_len]
        self.arch = settings.arch
        self.batch_size = settings.batch_size
        self.device = device
        self.pad = tokenizer.pad_token_id
        self.order = torch.Generator().manual_seed(settings.seed)
        self.perm: list[int] = []
        self.collator: DataCollatorForLanguageModeling | None = None
        if self.arch == "bert":
            from transformers import DataCollatorForLanguageModeling

            self.collator = DataCollatorForLanguageModeling(
                tokenizer, mlm=True, mlm_probability=MLM_PROBABILITY, seed=settings.seed
            )
            self.special = torch.isin(rows, torch.tensor(tokenizer.all_special_ids)).long()

    def next(self) -> dict[str, torch.Tensor]:
        import torch

        n = self.rows.shape[0]
        if len(self.perm) < self.batch_size:
            self.perm = torch.randperm(n, generator=self.order).tolist()
        idx, self.perm = self.perm[: self.batch_size], self.perm[self.batch_size :]
        ids = self.rows[idx]
        attention = (ids != self.pad).long()
        if self.collator is not None:
            examples = [
                {"input_ids": i, "special_tokens_mask": m}
                for i, m in zip(ids.tolist(), self.special[idx].tolist(), strict=True)
            ]
            masked = self.collator(examples)
            batch = {
                "input_ids": masked["input_ids"],
                "labels": masked["labels"],
                "attention_mask": attention,
                "token_type_ids": torch.zeros_like(ids),
            }
        else:
            batch = {
                "input_ids": ids,
                "labels": ids.masked_fill(attention == 0, -100),  # padding out by the mask, not the id
                "attention_mask": attention,
            }
        return {k: v.to(self.device) for k, v in batch.items()}


def _optimizer(
    model: torch.nn.Module, settings: Settings
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no decay on biases and norms), linear warmup over 10% of the steps, then linear
    decay to 0 at the last step."""
    import torch

    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        (no_decay if param.ndim < 2 or "LayerNorm" in name or ".ln_" in name else decay).append(param)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.98),
        eps=1e-6,
    )
    warmup = max(1, round(WARMUP_FRACTION * settings.steps))
    steps = settings.steps

    def factor(t: int) -> float:  # t: updates done so far
        if t < warmup:
            return (t + 1) / warmup
        return max(0.0, (steps - t) / max(1, steps - warmup))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _save_checkpoint(model: _Saves, tokenizer: PreTrainedTokenizerBase, out: Path, step: int) -> Path:
    """save_pretrained into a hidden temporary folder, then rename it into place."""
    import inspect

    from isotui.store.files import fix_modes

    final = out / step_dir_name(step)
    tmp = out / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        # safetensors is the only format in transformers 5; 4.x takes the flag (default True there too)
        kwargs = {"safe_serialization": True}
        if "safe_serialization" not in inspect.signature(model.save_pretrained).parameters:
            kwargs = {}
        model.save_pretrained(tmp, **kwargs)
        tokenizer.save_pretrained(tmp)
        fix_modes(tmp)  # safetensors writes 0600; the umask's mode lets a group read the weights
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _versions() -> dict[str, str]:
    from importlib import metadata

    import torch

    from isotui.version import __version__

    return {
        "isotui": __version__,
        "torch": torch.__version__,
        "transformers": metadata.version("transformers"),
        "python": sys.version.split()[0],
    }


def train(
    settings: Settings, out: Path, *, device: str, err: _Printer | None = None, quiet: bool = True
) -> TrainRun:
    """Train and save the checkpoints; return the run's JSON payload (also in ``out/train_tiny.json``).

    ``out`` must be ready (see :func:`prepare_out`). On KeyboardInterrupt or :class:`Cancelled`,
    the checkpoints already written stay, the JSON says ``interrupted``, and the exception goes on.
    """
    import logging

    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from isotui.data.sources import fingerprint, load_samples, parse_data
    from isotui.models.naming import bundled_minilm_dir

    hf_logging.set_verbosity(logging.ERROR)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    started = time.perf_counter()
    s = settings
    tokenizer = AutoTokenizer.from_pretrained(str(bundled_minilm_dir()))
    tokenizer.model_max_length = s.seq_len  # what the checkpoints were trained on; isotui run truncates to it
    samples = load_samples(parse_data("builtin"))
    encoded = tokenizer(samples, add_special_tokens=False)["input_ids"]
    rows = torch.tensor(
        pack_rows(encoded, s.seq_len, tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id),
        dtype=torch.long,
    )
    if rows.shape[0] < s.batch_size:
        raise IsotuiError(
            f"--batch-size {s.batch_size} is more than the {rows.shape[0]} rows the built-in corpus packs "
            f"into at --seq-len {s.seq_len}; use a smaller batch size"
        )
    torch.manual_seed(s.seed)
    built: torch.nn.Module = build_model(s, tokenizer)  # a Module: transformers wraps its .to untyped
    model = cast("PreTrainedModel", built.to(device))  # .to gives the model itself
    n_params = sum(p.numel() for p in model.parameters())
    batches = _Batches(rows, s, tokenizer, device)
    opt, sched = _optimizer(model, s)
    real_tokens = int((rows != tokenizer.pad_token_id).sum())
    payload: TrainRun = {
        "command": "train-tiny",
        "format": FORMAT,
        "args": s.as_json(),
        "model": {"class": type(model).__name__, "parameters": n_params},
        "data": {
            "source": "builtin",
            "fingerprint": fingerprint(samples),
            "sentences": len(samples),
            "rows": int(rows.shape[0]),
            "tokens": real_tokens,
            "padding_fraction": round(1 - real_tokens / rows.numel(), 4),
            "steps_per_epoch": int(rows.shape[0]) // s.batch_size,
        },
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "versions": _versions(),
        "checkpoints": [],
        "complete": False,
        "interrupted": False,
        "seconds": 0.0,
    }
    if not quiet and err is not None:
        err.print(
            f"train-tiny: {s.arch} ({s.layers} layers, d={s.hidden}, {s.heads} heads, "
            f"{n_params / 1e6:.1f}M parameters) on {rows.shape[0]} rows of {s.seq_len} tokens, "
            f"batch {s.batch_size}, {s.steps} steps, {len(s.save_at)} checkpoints, {device}",
            highlight=False,
        )
    _write_json(out / RUN_FILE, payload)  # at once: a run killed before its first checkpoint is still ours
    losses: list[float] = []  # losses[t - 1]: the loss of step t, on the weights after t - 1 updates
    state: _TrainState = {"last_saved": 0, "init_loss": math.nan, "lr": 0.0}

    def checkpoint(step: int) -> None:
        _save_checkpoint(model, tokenizer, out, step)
        window = losses[-min(LOSS_WINDOW, step - state["last_saved"]) :] if step else [state["init_loss"]]
        state["last_saved"] = step
        loss = sum(window) / len(window)
        elapsed = time.perf_counter() - started
        payload["checkpoints"].append(
            {
                "step": step,
                "path": step_dir_name(step),
                "train_loss": round(loss, 6),
                "loss_steps": len(window),
                "lr": state["lr"],  # the learning rate of the update that made this checkpoint
                "seconds": round(elapsed, 2),
            }
        )
        payload["seconds"] = round(elapsed, 2)
        _write_json(out / RUN_FILE, payload)
        if not quiet and err is not None:
            err.print(
                f"step {step:>{len(str(s.steps))}}/{s.steps}  loss {loss:.4f}  {elapsed:6.1f} s",
                highlight=False,
            )

    try:
        batch = batches.next()
        # the init's loss, on the first batch (the same forward step 1 then trains on)
        model.eval()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
        with torch.no_grad():
            state["init_loss"] = float(_loss(model, s.arch, batch))
        checkpoint(0)
        model.train()
        save_at = set(s.save_at)
        for step in range(1, s.steps + 1):
            if step > 1:
                batch = batches.next()
            loss = _loss(model, s.arch, batch)
            if not torch.isfinite(loss):
                raise IsotuiError(
                    f"the training loss became {float(loss)} at step {step}; lower --lr "
                    f"(it is {s.lr:g}) and train again with --force"
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            state["lr"] = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            if step in save_at:
                checkpoint(step)
    except (KeyboardInterrupt, Cancelled):
        payload["interrupted"] = True
        payload["seconds"] = round(time.perf_counter() - started, 2)
        _write_json(out / RUN_FILE, payload)
        if err is not None:
            kept = len(payload["checkpoints"])
            err.print(f"train-tiny: interrupted; the {kept} checkpoints written so far stay in {out}")
        raise
    payload["complete"] = True
    payload["seconds"] = round(time.perf_counter() - started, 2)
    _write_json(out / RUN_FILE, payload)
    return payload
