"""Overhead of ``IsotuiCallback`` at its defaults on docs/callbacks.md's example: the whole training.

The training of the page's "Example" (train-tiny's BERT on small sizes: 2 layers, d=32, 32 tokens,
batch 8, the built-in corpus, transformers' ``Trainer`` on the CPU, its defaults otherwise, the
checkpoint it saves at the end included), timed from building the model, the callback and the
``Trainer`` to the end of ``train()``, without and with ``Trainer(callbacks=[IsotuiCallback()])``
at its defaults (every 100 steps, step 0 and the last step: 256 built-in sentences each), in one
process. A bare training runs first, untimed (the process's first training pays torch's and the
Trainer's first-call costs, which a later one does not); then ``--repeats`` pairs, the order
alternating (bare first, then probed first, ...) so that a drift of the machine's load falls on
both sides. The first probed training pays isotui's imports of its measurement (once per
process, as the page's script does). Prints each pair (wall and this process's CPU time, the
median step's wall time: whether the machine moved between the two), the probes' own seconds,
the seconds spent in the callback (its import and construction, its events: the probes, the check
before the first step, the logging) against the training without it, the ratio of the totals and
the median pair's (the overhead of the whole training), the load (1, 5 and 15 minutes) before and
after and the device. On a machine that other jobs share, a training's time swings by 10 to 30%
from one run to the next: the callback's own seconds are the steadier measure.

    python benchmarks/callback_example.py [--steps 120] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

EXAMPLE_STEPS = 120  # the page's max_steps


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=EXAMPLE_STEPS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch
    import transformers
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from isotui.data.sources import load_samples, parse_data
    from isotui.experiments.train_tiny import Settings, build_model, pack_rows
    from isotui.models.naming import bundled_minilm_dir

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    tok = AutoTokenizer.from_pretrained(str(bundled_minilm_dir()))
    tok.model_max_length = 32
    ids = tok(load_samples(parse_data("builtin")), add_special_tokens=False)["input_ids"]
    rows = pack_rows(ids, 32, tok.cls_token_id, tok.sep_token_id, tok.pad_token_id)
    probes: list[float] = []

    class Steps(transformers.TrainerCallback):
        """Each step's wall time (both trainings): whether the machine, not the callback, moved."""

        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, *args: object, **kwargs: object) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, *args: object, **kwargs: object) -> None:
            self.seconds.append(time.perf_counter() - self.started)

    def timed(callback_class: type) -> type:
        """The callback, the seconds (wall) spent in its events counted in ``spent``."""

        class Timed(callback_class):  # type: ignore[misc,valid-type]
            spent = 0.0

        for event in ("on_train_begin", "on_step_begin", "on_step_end", "on_epoch_end"):

            def wrapper(self: object, *a: object, _event: str = event, **k: object) -> object:
                started = time.perf_counter()
                try:
                    return getattr(callback_class, _event)(self, *a, **k)
                finally:
                    Timed.spent += time.perf_counter() - started

            setattr(Timed, event, wrapper)
        return Timed

    def train(out: Path, probed: bool) -> dict[str, float]:
        """The page's example, timed whole: wall and CPU seconds, the median step's, the callback's."""
        torch.manual_seed(0)
        steps = Steps()
        started, cpu = time.perf_counter(), time.process_time()
        callbacks: list[Any] = [steps]
        spent = 0.0
        if probed:
            from isotui.callbacks import IsotuiCallback  # its first import counts, as in the page's script

            callback_class: Any = timed(IsotuiCallback)
            callbacks.append(callback_class())
            spent = time.perf_counter() - started  # the import and the callback's construction
        model = build_model(Settings("bert", args.steps, (), 32, 2, 2, 32, 8, 1e-3, 0.1, 0), tok)
        targs = TrainingArguments(
            output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=8, logging_steps=20,
            report_to=[], use_cpu=True, disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(
            model=model, args=targs, train_dataset=[{"input_ids": r} for r in rows],
            data_collator=DataCollatorForLanguageModeling(tok), processing_class=tok, callbacks=callbacks,
        )  # fmt: skip
        trainer.train()
        wall, used = time.perf_counter() - started, time.process_time() - cpu
        if probed:
            from isotui.experiments.recorded import read_record

            spent += callback_class.spent
            record = read_record(out / "isotui")
            assert record is not None
            probes.extend(s["seconds"] for s in record["steps"])
        step = statistics.median(steps.seconds)
        return {"wall": wall, "cpu": used, "step": step, "callback": spent}

    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        train(Path(tmp) / "warm-up", False)
        for i in range(args.repeats):
            order = (False, True) if i % 2 == 0 else (True, False)
            runs = {p: train(Path(tmp) / f"{i}-{'probed' if p else 'bare'}", p) for p in order}
            pairs.append((runs[False], runs[True], order[0]))
    load_after = os.getloadavg()

    print(
        f"docs/callbacks.md's example: {args.steps} steps, IsotuiCallback() at its defaults; "
        f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} thread(s)"
    )
    print(f"device: cpu, {cpu_name()} ({os.cpu_count()} cores)")
    before, after = (" ".join(f"{v:.2f}" for v in load) for load in (load_before, load_after))
    print(f"load (1, 5, 15 min): {before} before, {after} after")
    for i, (b, p, first) in enumerate(pairs):
        print(
            f"pair {i + 1} ({'probed' if first else 'bare'} first): without {b['wall']:.2f} s wall "
            f"{b['cpu']:.2f} s CPU (median step {1000 * b['step']:.0f} ms), with {p['wall']:.2f} s wall "
            f"{p['cpu']:.2f} s CPU (median step {1000 * p['step']:.0f} ms, the callback "
            f"{p['callback']:.2f} s): ratio {p['wall'] / b['wall']:.3f} wall, {p['cpu'] / b['cpu']:.3f} CPU"
        )
    each = ", ".join(f"{p:.2f}" for p in probes)
    print(f"probes: {len(probes)}, {sum(probes):.2f} s ({each})")
    bare = statistics.mean(b["wall"] for b, _, _ in pairs)
    own = statistics.mean(p["callback"] for _, p, _ in pairs)
    imports = pairs[0][1]["callback"]  # the first probed training
    print(
        f"the callback's own time: {own:.2f} s a training (the first, with isotui's imports, "
        f"{imports:.2f} s), "
        f"{100 * own / bare:.1f}% of the training without it ({bare:.2f} s): ratio {1 + own / bare:.3f}"
    )
    total = {k: sum(p[k] for _, p, _ in pairs) / sum(b[k] for b, _, _ in pairs) for k in ("wall", "cpu")}
    median = {k: statistics.median(p[k] / b[k] for b, p, _ in pairs) for k in ("wall", "cpu")}
    print(
        f"the whole training: ratio {total['wall']:.3f} wall, {total['cpu']:.3f} CPU (totals of {len(pairs)} "
        f"pairs); median pair {median['wall']:.3f} wall, {median['cpu']:.3f} CPU"
    )


if __name__ == "__main__":
    main()
