"""The memory plans of ``isotui run --dry-run`` for the Pythia sizes and Llama 7B/70B on 1, 2, 4
and 8 GPUs of 80 GB: configs written from the models' published dimensions (no weights), placed
by accelerate's ``infer_auto_device_map`` (``--device-map auto``), accumulator budgets what each
GPU has left after its weights, the first batch's activations and the margin.

    PYTHONPATH=$PWD python benchmarks/memory_plan.py
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


def main() -> None:
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
