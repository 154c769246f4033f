"""``isotui train-tiny``: its flags and command (the training itself is
:mod:`isotui.experiments.train_tiny`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from isotui.errors import IsotuiError
from isotui.experiments.train_tiny import (
    ARCHS,
    DEFAULTS,
    RUN_FILE,
    Settings,
    default_schedule,
    default_threads,
    prepare_out,
    real_number,
    train,
    whole_number,
)
from isotui.experiments.train_tiny import HELP as TRAIN_TINY_HELP
from isotui.extract.threads import check_threads

HELP = TRAIN_TINY_HELP


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the checkpoints (new or empty)")
    p.add_argument("--arch", choices=ARCHS, default="bert", help="bert: masked LM (default); gpt2: causal LM")
    p.add_argument("--steps", help=f"optimizer steps (default {d['steps']})")
    p.add_argument("--save-every", metavar="K", help="save every K steps (plus step 0 and the last)")
    p.add_argument(
        "--save-at",
        metavar="S,S,...",
        help="save at these steps, e.g. 0,10,50,100 (step 0 and the last are always saved); "
        "default: 0, 10, 20, 50, 100, 200, 500... and the last",
    )
    p.add_argument("--hidden", help=f"hidden size (default {d['hidden']}; feed-forward 4x)")
    p.add_argument("--layers", help=f"Transformer layers (default {d['layers']})")
    p.add_argument("--heads", help=f"attention heads (default {d['heads']})")
    p.add_argument(
        "--seq-len", help=f"tokens per packed row, also the model's positions (default {d['seq_len']})"
    )
    p.add_argument("--batch-size", help="rows per step (default 32 for bert, 8 for gpt2)")
    p.add_argument(
        "--lr", help=f"peak learning rate: 10%% warmup, then linear decay to 0 (default {d['lr']:g})"
    )
    p.add_argument("--dropout", help="dropout in the model (default 0, as in Pythia)")
    p.add_argument("--seed", help="seed for the init, batch order and masking (default 0)")
    p.add_argument("--device", default="auto", help="auto (cuda, mps, cpu), cpu, cuda, cuda:N, mps")
    p.add_argument(
        "--threads",
        help="CPU threads for torch (default: half the cores, at most 8; tiny models gain little from "
        "more, and an oversubscribed CPU makes them many times slower)",
    )
    p.add_argument(
        "--force", action="store_true", help="overwrite an earlier train-tiny run in the same --out folder"
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines")


def _schedule(args: argparse.Namespace, steps: int) -> tuple[int, ...]:
    if args.save_every is not None and args.save_at is not None:
        raise IsotuiError("--save-every and --save-at both say when to save; give only one of them")
    if args.save_every is not None:
        every = whole_number(args.save_every, "--save-every", 1, minimum=1)
        return tuple(sorted({*range(0, steps + 1, every), steps}))
    if args.save_at is None:
        return tuple(default_schedule(steps))
    chosen = set()
    for item in str(args.save_at).split(","):
        if not item.strip():
            continue
        try:
            step = int(item.strip())
        except ValueError:
            raise IsotuiError(
                f"--save-at {args.save_at!r}: {item.strip()!r} is not a step number; "
                "give whole numbers separated by commas, e.g. --save-at 0,10,50"
            ) from None
        if step < 0 or step > steps:
            raise IsotuiError(
                f"--save-at step {step} is outside the run (0 to --steps {steps}); drop it or raise --steps"
            )
        chosen.add(step)
    return tuple(sorted({0, *chosen, steps}))


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validate the flags; raise :class:`IsotuiError` with one sentence on the first bad one."""
    d = DEFAULTS
    steps = whole_number(args.steps, "--steps", d["steps"], minimum=1)
    hidden = whole_number(args.hidden, "--hidden", d["hidden"], minimum=1)
    heads = whole_number(args.heads, "--heads", d["heads"], minimum=1)
    if hidden % heads:
        raise IsotuiError(
            f"--hidden {hidden} does not split into --heads {heads} equal heads; "
            "choose a hidden size that is a multiple of the number of heads"
        )
    seed = whole_number(args.seed, "--seed", d["seed"], minimum=0)
    return Settings(
        arch=args.arch,
        steps=steps,
        save_at=_schedule(args, steps),
        hidden=hidden,
        layers=whole_number(args.layers, "--layers", d["layers"], minimum=1),
        heads=heads,
        seq_len=whole_number(args.seq_len, "--seq-len", d["seq_len"], minimum=8),
        batch_size=whole_number(args.batch_size, "--batch-size", d["batch_size"][args.arch], minimum=1),
        lr=real_number(args.lr, "--lr", d["lr"], low=0.0),
        dropout=real_number(args.dropout, "--dropout", d["dropout"], low=0.0, high=1.0),
        seed=seed,
    )


def main(args: argparse.Namespace, err: Any) -> int:
    from isotui.extract.device import resolve_device, validate_device

    settings = settings_from_args(args)
    threads = check_threads(
        whole_number(args.threads, "--threads", default_threads(), minimum=1), "--threads"
    )
    device = resolve_device(validate_device(str(args.device)))
    out = Path(args.out).expanduser()
    prepare_out(out, settings, args.force)
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        payload = train(settings, out, device=device, err=err, quiet=args.quiet)
    finally:
        torch.set_num_threads(before)  # in-process callers (tests, the app) keep their setting
    if not args.quiet:
        err.print(
            f"train-tiny: {len(payload['checkpoints'])} checkpoints in {out} "
            f"({payload['seconds']:.0f} s); the run is described in {out / RUN_FILE}",
            highlight=False,
        )
    for c in payload["checkpoints"]:
        print(out / c["path"])
    return 0
