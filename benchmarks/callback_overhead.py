"""Overhead of isotui's training callbacks on train-tiny's model: the same training with
train-tiny's loss (train-tiny's defaults: BERT, 4 layers, d=128, 4 heads, 64 tokens, batch 32,
400 steps, lr 1e-3, on the built-in corpus) without, then with the callback at its defaults (every
100 steps and at step 0, 256 samples of the built-in corpus), in one process, one thread. Prints
both wall times and CPU times (this process's), their ratios, the seconds of each probe and the
1-minute load before and after.

``--framework trainer`` (default): the transformers ``Trainer`` and :class:`IsotuiCallback`
(AdamW, linear warmup schedule); ``--framework lightning``: a ``LightningModule`` on Lightning's
``Trainer`` (CPU, AdamW at the same rate, no schedule, no checkpoints, no logger) and
:class:`IsotuiLightningCallback`.

    python benchmarks/callback_overhead.py [--framework trainer|lightning] [--steps 400] [--every 100]
        [--threads 1] [--gradients] [--probed-first]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    from isotui.callbacks import DEFAULT_EVERY

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("trainer", "lightning"), default="trainer")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=DEFAULT_EVERY)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gradients", action="store_true", help="probe the gradients too")
    parser.add_argument("--probed-first", action="store_true", help="train with the callback first")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from isotui.callbacks import IsotuiCallback
    from isotui.data.sources import load_samples, parse_data
    from isotui.experiments.train_tiny import DEFAULTS, Settings, build_model, pack_rows
    from isotui.experiments.train_tiny import _loss as tiny_loss
    from isotui.models.naming import bundled_minilm_dir

    hf_logging.set_verbosity_error()
    experiments = ("layers", "gradients") if args.gradients else ("layers",)
    torch.set_num_threads(args.threads)
    d = DEFAULTS
    settings = Settings(
        "bert", args.steps, (), d["hidden"], d["layers"], d["heads"], d["seq_len"],
        d["batch_size"]["bert"], d["lr"], d["dropout"], d["seed"],
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(bundled_minilm_dir()))
    tok.model_max_length = settings.seq_len
    ids = tok(load_samples(parse_data("builtin")), add_special_tokens=False)["input_ids"]
    rows = pack_rows(ids, settings.seq_len, tok.cls_token_id, tok.sep_token_id, tok.pad_token_id)
    dataset = [{"input_ids": r} for r in rows]

    class TinyTrainer(Trainer):
        """train-tiny's loss: the vocabulary head only where there is a label (as its own loop)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs.setdefault("token_type_ids", torch.zeros_like(inputs["input_ids"]))
            return tiny_loss(model, "bert", inputs)

    def train_lightning(out: Path, with_callback: bool) -> tuple[float, float]:
        import lightning as L

        from isotui.callbacks import IsotuiLightningCallback

        class TinyModule(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model, self.tokenizer = build_model(settings, tok), tok

            def training_step(self, batch, batch_idx):
                batch.setdefault("token_type_ids", torch.zeros_like(batch["input_ids"]))
                return tiny_loss(self.model, "bert", batch)

            def configure_optimizers(self):
                return torch.optim.AdamW(self.model.parameters(), lr=settings.lr)

        torch.manual_seed(settings.seed)
        module = TinyModule()
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=settings.batch_size, shuffle=True,
            collate_fn=DataCollatorForLanguageModeling(tok, mlm_probability=0.15),
        )  # fmt: skip
        callbacks = (
            [IsotuiLightningCallback("builtin", every=args.every, experiments=experiments)]
            if with_callback
            else []
        )
        trainer = L.Trainer(
            max_steps=settings.steps, accelerator="cpu", devices=1, default_root_dir=str(out),
            logger=False, callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        started, cpu = time.perf_counter(), time.process_time()
        trainer.fit(module, loader)
        return time.perf_counter() - started, time.process_time() - cpu

    def train(out: Path, with_callback: bool) -> tuple[float, float]:
        if args.framework == "lightning":
            return train_lightning(out, with_callback)
        torch.manual_seed(settings.seed)
        model = build_model(settings, tok)
        targs = TrainingArguments(
            output_dir=str(out), max_steps=settings.steps, per_device_train_batch_size=settings.batch_size,
            learning_rate=settings.lr, warmup_steps=max(1, settings.steps // 10), save_strategy="no",
            logging_steps=50, report_to=[], use_cpu=True, seed=settings.seed, disable_tqdm=True,
        )  # fmt: skip
        collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15)
        trainer = TinyTrainer(
            model=model, args=targs, train_dataset=dataset, data_collator=collator, processing_class=tok
        )
        if with_callback:
            IsotuiCallback("builtin", every=args.every, experiments=experiments).attach(trainer)
        started, cpu = time.perf_counter(), time.process_time()
        trainer.train()
        return time.perf_counter() - started, time.process_time() - cpu

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        if args.probed_first:  # the other order, to see the drift of a shared machine's load
            probed_times = train(Path(tmp) / "probed", True)
            bare_times = train(Path(tmp) / "bare", False)
        else:
            bare_times = train(Path(tmp) / "bare", False)
            probed_times = train(Path(tmp) / "probed", True)
        record = json.loads((Path(tmp) / "probed" / "isotui" / "isotui_series.json").read_text())
    probes = [s["seconds"] for s in record["steps"]]
    load_after = os.getloadavg()[0]
    print(
        f"{args.framework}: steps {settings.steps}, every {args.every}, threads {args.threads}, "
        f"experiments {', '.join(experiments)}"
    )
    print(f"1-minute load: {load_before:.2f} before, {load_after:.2f} after")
    (bare, bare_cpu), (probed, probed_cpu) = bare_times, probed_times
    print(f"without the callback: {bare:.1f} s wall, {bare_cpu:.1f} s CPU")
    each = ", ".join(f"{p:.2f}" for p in probes)
    print(
        f"with the callback:    {probed:.1f} s wall, {probed_cpu:.1f} s CPU  ({len(probes)} probes: {each} s)"
    )
    overhead, share = 100 * (probed / bare - 1), 100 * sum(probes) / bare
    print(f"ratio {probed / bare:.3f} wall (overhead {overhead:.1f}%, the probes' own seconds {share:.1f}%)")
    print(f"ratio {probed_cpu / bare_cpu:.3f} CPU time (this process's: less sensitive to other jobs' load)")


if __name__ == "__main__":
    main()
