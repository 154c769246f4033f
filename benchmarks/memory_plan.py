"""The memory plans of ``isotui run --dry-run`` for the Pythia sizes and Llama 7B/70B on 1, 2, 4
and 8 GPUs of 80 GB: configs written from the models' published dimensions (no weights), placed
by accelerate's ``infer_auto_device_map`` (``--device-map auto``), accumulator budgets what each
GPU has left after its weights, the first batch's activations and the margin.

``--times``: for the runs the issues ask about (Pythia-12B over its 154 checkpoints on 8 GPUs,
Llama-3-70B on 2 and 4), the plan's time per phase (:mod:`isotui.extract.phase_time`: absent
GPUs at an H100's nominal rates), memory per device and disk, for ``--samples`` samples of 512
tokens.

    PYTHONPATH=$PWD python benchmarks/memory_plan.py [--times] [--samples 1000]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from isotui.extract.memory_plan import dry_run
from isotui.models.naming import parse_model

NEOX = {"model_type": "gpt_neox", "rotary_pct": 0.25, "max_position_embeddings": 2048, "dtype": "float16"}
PYTHIA = {  # name: (d, layers, heads, vocab); intermediate 4d
    "pythia-70m": (512, 6, 8, 50304),
    "pythia-160m": (768, 12, 12, 50304),
    "pythia-410m": (1024, 24, 16, 50304),
    "pythia-1b": (2048, 16, 8, 50304),
    "pythia-1.4b": (2048, 24, 16, 50304),
    "pythia-2.8b": (2560, 32, 32, 50304),
    "pythia-6.9b": (4096, 32, 32, 50432),
    "pythia-12b": (5120, 36, 40, 50688),
}
LLAMA = {  # name: (d, layers, heads, kv heads, intermediate, vocab)
    "llama-2-7b": (4096, 32, 32, 32, 11008, 32000),
    "llama-3-70b": (8192, 80, 64, 8, 28672, 128256),
}


def configs() -> dict[str, dict]:
    out = {}
    for name, (d, n, h, v) in PYTHIA.items():
        out[name] = NEOX | {
            "hidden_size": d,
            "num_hidden_layers": n,
            "num_attention_heads": h,
            "intermediate_size": 4 * d,
            "vocab_size": v,
        }
    for name, (d, n, h, kv, inter, v) in LLAMA.items():
        out[name] = {
            "model_type": "llama",
            "hidden_size": d,
            "num_hidden_layers": n,
            "num_attention_heads": h,
            "num_key_value_heads": kv,
            "intermediate_size": inter,
            "vocab_size": v,
            "max_position_embeddings": 4096,
            "dtype": "bfloat16",
        }
    return out


def gb(n: int) -> str:
    return f"{n / 1e9:6.1f}"


def plan_of(folder: Path, gpus: int, samples: int | None = None):
    """The plan ``isotui run --dry-run`` prints for the model in ``folder`` on ``gpus`` GPUs of
    80 GB (with its time per phase when ``samples`` is given)."""
    from isotui.data.sources import parse_data
    from isotui.experiments.layerwise import LayersRequest
    from isotui.experiments.plans import layers
    from isotui.spec import RunSpec

    spec = RunSpec(
        model=str(folder),
        data=parse_data("builtin"),
        device_map="auto",
        max_memory=tuple((i, 80 * 10**9) for i in range(gpus)),
        reservoir=4096,
        max_length=512,
        max_samples=samples,
    )
    return layers(LayersRequest(spec))


def times(samples: int) -> None:
    from isotui.extract.phase_time import duration

    runs = [("pythia-12b", 8, 154), ("pythia-12b", 1, 154), ("llama-3-70b", 2, 1), ("llama-3-70b", 4, 1)]
    with tempfile.TemporaryDirectory() as tmp:
        for name, gpus, checkpoints in runs:
            folder = Path(tmp) / name
            folder.mkdir(exist_ok=True)
            (folder / "config.json").write_text(json.dumps(configs()[name]), encoding="utf-8")
            plan = plan_of(folder, gpus, samples)
            phases = plan.phases
            assert phases is not None
            each = "; ".join(f"{k} {duration(v)}" for k, v in phases.seconds.items())
            total = phases.total() * checkpoints
            print(
                f"\n{name} on {gpus} x 80 GB, {samples:,} samples of 512 tokens, {checkpoints} checkpoint(s)"
            )
            print(f"  time per checkpoint: {each}; in all {duration(phases.total())}")
            if checkpoints > 1:
                print(f"  {checkpoints} checkpoints one after another: {duration(total)}")
            exact = sum(p.exact_cov for p in plan.layers)
            res = sorted({p.reservoir for p in plan.layers})
            print(f"  plan: {exact}/{len(plan.layers)} exact covariances, reservoirs {res}, {plan.batch}")
            batch, final, per = plan.batch_workspace(), plan.finalisation(), plan.per_device()
            peaks = plan.peaks()
            for dev in sorted({*plan.weights, *per, *plan.offload}):
                print(
                    f"  {dev:<7} weights {gb(plan.weights.get(dev, 0))} GB, "
                    f"offloading {gb(plan.offload.get(dev, 0))} GB, sums {gb(per.get(dev, 0))} GB, "
                    f"a batch {gb(batch.get(dev, 0))} GB, finalising {gb(final.get(dev, 0))} GB"
                    + (f"; at most {gb(peaks[dev])} GB" if dev in peaks else "")
                )
            weights = sum(plan.weights.values())
            state = sum(per.values())
            print(
                f"  disk: the weights {gb(weights)} GB per checkpoint in the hub cache "
                f"({gb(weights * checkpoints)} GB for {checkpoints}), {gb(plan.weights.get('disk', 0))} GB "
                f"offloaded, a shard state {gb(state)} GB per shard"
            )
            for line in plan.rank_deficient():
                print(f"  {line}")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--times", action="store_true", help="the issues' runs: time, memory, disk")
    parser.add_argument("--samples", type=int, default=1000)
    args = parser.parse_args()
    if args.times:
        times(args.samples)
        return
    print(
        f"{'model':<13} {'GPUs':>4} {'weights GB (per GPU max, disk)':>31} {'exact cov':>9} "
        f"{'cov GB':>7} {'reservoir':>9} {'accum GB (per GPU max)':>23}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in configs().items():
            folder = Path(tmp) / name
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
            for gpus in (1, 2, 4, 8):
                plan = dry_run(
                    parse_model(str(folder)),
                    device_map="auto",
                    max_memory=tuple((i, 80 * 10**9) for i in range(gpus)),
                    device="auto",
                    dtype="auto",
                    reservoir=4096,
                    batch_size=None,
                    max_length=512,
                )
                w = plan.weights
                on_gpu = max((b for dev, b in w.items() if dev.startswith("cuda")), default=0)
                acc = plan.per_device()
                exact = sum(p.exact_cov for p in plan.layers)
                res = min(p.reservoir for p in plan.layers)
                print(
                    f"{name:<13} {gpus:>4} {gb(sum(w.values()))} ({gb(on_gpu)}, disk {gb(w.get('disk', 0))}) "
                    f"{exact:>4}/{len(plan.layers):<4} {gb(plan.cov_total())}  {res:>9,} "
                    f"{gb(sum(acc.values()))} ({gb(max(acc.values()))})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
