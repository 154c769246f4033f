"""isotui on a GPU against a bare forward of the same model (issue 26): whole process, build, shares.

Part 1, per case (MiniLM in float32; an untrained Pythia-1.4B-shaped gpt_neox in bfloat16 over
long samples; a two-layer Llama slice at d = 8,192 in bfloat16): a bare forward as a careful user
writes it (tokenise once, sort by length, batches within a token budget, ``from_config`` under
``torch.device(device)`` in the dtype for an untrained model, ``output_hidden_states``, nothing
else) and ``isotui run`` on the same text file, each a whole process, alternating. Rows: both
walls and their ratio (target <= 1.10x for the Pythia case), both builds/loads (an untrained
model: isotui's device-free build against ``from_config`` on the device; target <= 1.5x), both
forwards, and isotui's per-batch metrics and finalisation as shares of the bare forward.

Part 2, per d (1,024 ... 8,192; a two-layer Llama at width d, bfloat16): the same pair; isotui's
per-batch metrics (the accumulation) and finalisation as shares of the bare forward (targets:
accumulation <= 15%, finalisation <= 10%).

Part 0: the untrained Pythia-shaped model's build alone, in one process: isotui's device-free build
(isotui.models.untrained) against ``from_config`` under ``torch.device(device)`` in bfloat16, best
of three, alternating (target <= 1.5x).

Part 3: host syncs per batch, for isotui and for the bare forward of the same model and batches
(``torch.cuda.set_sync_debug_mode("warn")``, warnings counted for 8 and for 32 batches, the
difference over 24 batches: the fixed costs of a run cancel). CUDA only (None on the CPU).

Every row names the device (``torch.cuda.get_device_name()``, or the CPU's model name), the
dtype, ``uptime``'s load and torch's threads. ``--smoke``: the same three parts at tiny sizes on
any device (tests/test_gpu_benchmark.py runs it on the CPU); on a GPU the real sizes:

    python benchmarks/gpu.py [--device cuda] [--out rows.jsonl] [--smoke] [--parts 1,2,3]
                             [--dims 1024,2048,4096,8192] [--samples 1644] [--cases NAME,...]

Each isotui process runs with this checkout first on PYTHONPATH and ``--no-cache``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# -- the cases ------------------------------------------------------------------------------------


def neox(smoke: bool) -> dict[str, int]:
    if smoke:
        return {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256}
    return {
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "intermediate_size": 8192,
    }


def llama(d: int, layers: int = 2) -> dict[str, int]:
    """A Llama slice at width d (Llama-2/3-70B's proportions at d = 8,192: 64 heads, 8 KV heads)."""
    heads = max(4, d // 128)
    return {
        "hidden_size": d,
        "intermediate_size": int(d * 3.5) // 256 * 256 or 4 * d,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": min(8, heads),
    }


def spec(kind: str, settings: dict[str, int]) -> str:
    return f"random:{kind}:" + ",".join(f"{k}={v}" for k, v in settings.items())


def cases(smoke: bool) -> list[dict[str, object]]:
    """(name, isotui model, bare model, dtype, max length, samples' lines joined, token budget)."""
    big = 16 if smoke else 8192
    return [
        {
            "case": "minilm",
            "model": "minilm",
            "dtype": "float32",
            "max_length": 128,
            "join": 1,
            "budget": 16384,
        },
        {
            "case": "pythia-1.4b-shape",
            "model": spec("gpt_neox", neox(smoke)),
            "dtype": "bfloat16",
            "max_length": 64 if smoke else 512,
            "join": 25,
            "budget": 65536,
        },
        {
            "case": f"llama-d{big}-slice",
            "model": spec("llama", llama(big)),
            "dtype": "bfloat16",
            "max_length": 64 if smoke else 128,
            "join": 1,
            "budget": 65536,
        },
    ]


# -- the bare forward (a child process) -----------------------------------------------------------

BARE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer
model, tok_dir, text, max_len, dtype, budget, dev, syncs = sys.argv[1:9]
max_len, budget, syncs = int(max_len), int(budget), int(syncs)
dt = getattr(torch, dtype)
lines = [l.strip() for l in open(text, encoding="utf-8") if l.strip()]
size = budget // max_len  # syncs: isotui's batches (batch_size = size over the first syncs * size lines)
if syncs:
    lines = lines[: syncs * size]
tok = AutoTokenizer.from_pretrained(tok_dir)
cuda = dev.startswith("cuda")
sync = (lambda: torch.cuda.synchronize()) if cuda else (lambda: None)
if model.startswith("random:"):
    kind, _, rest = model[len("random:"):].partition(":")
    settings = {k: int(v) for k, v in (p.split("=") for p in rest.split(",") if p)}
    cfg = AutoConfig.for_model(kind, **settings)
    cfg.vocab_size = max(cfg.vocab_size, len(tok))
else:
    cfg = AutoConfig.from_pretrained(model)
AutoModel._model_mapping[type(cfg)]  # the modeling module imported: load_s is the build alone
t_import = time.perf_counter()
if model.startswith("random:"):
    torch.manual_seed(0)
    with torch.device(dev):
        m = AutoModel.from_config(cfg, dtype=dt).eval()
else:
    m = AutoModel.from_pretrained(model, dtype=dt).to(dev).eval()
sync(); t_load = time.perf_counter()
ids = tok(lines, truncation=True, max_length=max_len)["input_ids"]
order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
batches, cur = [], []
for i in order:
    if cur and (len(ids[i]) * (len(cur) + 1) > budget or (syncs and len(cur) == size)):
        batches.append(cur); cur = []
    cur.append(i)
batches.append(cur)
t_tok = time.perf_counter()
pad = tok.pad_token_id if tok.pad_token_id is not None else 0
warned = 0
import warnings
with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
    warnings.simplefilter("always")
    if syncs and cuda:
        torch.cuda.set_sync_debug_mode("warn")
    for b in batches:
        L = max(len(ids[i]) for i in b)
        x = torch.full((len(b), L), pad, dtype=torch.long)
        a = torch.zeros((len(b), L), dtype=torch.long)
        for r, i in enumerate(b):
            x[r, :len(ids[i])] = torch.tensor(ids[i]); a[r, :len(ids[i])] = 1
        m(input_ids=x.to(dev), attention_mask=a.to(dev), output_hidden_states=True)
    if syncs and cuda:
        torch.cuda.set_sync_debug_mode(0)
    warned = sum("synchroniz" in str(w.message) for w in caught)
sync(); t_end = time.perf_counter()
print(json.dumps({"imports_s": t_import - t0, "load_s": t_load - t_import, "tokenise_s": t_tok - t_load,
                  "forward_s": t_end - t_tok, "tokens": sum(len(ids[i]) for b in batches for i in b),
                  "batches": len(batches), "syncs": warned if cuda else None,
                  "threads": torch.get_num_threads()}))
"""

BUILD = r"""
import json, sys, time
import torch
from transformers import AutoConfig, AutoModel
from isotui.models.untrained import build_untrained
kind, rest, dtype, dev, repeats = sys.argv[1:6]
settings = {k: int(v) for k, v in (p.split("=") for p in rest.split(",") if p)}
cfg = AutoConfig.for_model(kind, **settings)
dt = getattr(torch, dtype)
sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
AutoModel._model_mapping[type(cfg)]
best = {"from_config_s": float("inf"), "isotui_build_s": float("inf")}
for _ in range(int(repeats)):  # alternating, best of each
    t = time.perf_counter()
    with torch.device(dev):
        m = AutoModel.from_config(cfg, dtype=dt)
    sync(); best["from_config_s"] = min(best["from_config_s"], time.perf_counter() - t); del m
    t = time.perf_counter()
    m = build_untrained(lambda: AutoModel.from_config(cfg), device=dev, dtype=dt, seed=0, name=kind)
    sync(); best["isotui_build_s"] = min(best["isotui_build_s"], time.perf_counter() - t)
    params = sum(p.numel() for p in m.parameters()); del m
print(json.dumps({**best, "params": params, "threads": torch.get_num_threads()}))
"""

ISOTUI_SYNCS = r"""
import json, sys, warnings
import torch
import isotui
model, text, max_len, dtype, budget, dev, n = sys.argv[1:8]
cuda = dev.startswith("cuda")
lines = [l for l in open(text, encoding="utf-8") if l.strip()]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    r = isotui.run(model, data="text:" + text, device=dev, dtype=dtype, max_length=int(max_len),
                   batch_size=int(budget) // int(max_len), max_samples=int(n) * (int(budget) // int(max_len)),
                   cache=False)
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
print(json.dumps({"syncs": sum("synchroniz" in str(w.message) for w in caught) if cuda else None,
                  "rows": len(r.result.rows)}))
"""


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name (what every row is measured on)."""
    if device.startswith("cuda"):
        import torch

        return str(torch.cuda.get_device_name(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def uptime() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return out


def child(argv: list[str], timeout: float) -> tuple[float, dict[str, object]]:
    """(whole-process wall seconds, the child's last line of JSON); a failure stops the benchmark."""
    start = time.perf_counter()
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=env(),
        cwd=tempfile.gettempdir(),
        timeout=timeout,
        check=False,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} ... failed:\n{proc.stderr[-3000:]}")
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


def minilm_dir() -> str:
    sys.path.insert(0, str(ROOT))
    from isotui.models.naming import bundled_minilm_dir

    return str(bundled_minilm_dir())


def samples_file(folder: Path, join: int, count: int) -> Path:
    """``count`` samples of ``join`` built-in corpus lines each (25: about 500 tokens)."""
    lines = [line.strip() for line in (ROOT / "isotui/data/builtin_corpus.txt").read_text().splitlines()]
    lines = [line for line in lines if line]
    out, i = [], 0
    while len(out) < count:
        out.append(" ".join(lines[(i + k) % len(lines)] for k in range(join)))
        i += join
    path = folder / f"samples_{join}_{count}.txt"
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


def pair(case: dict[str, object], text: Path, device: str, timeout: float) -> dict[str, object]:
    """A bare forward and an isotui run of one case, whole processes, back to back."""
    model = str(case["model"])
    bare_model = minilm_dir() if model == "minilm" else model
    tok = minilm_dir()
    load = uptime()
    argv = [
        sys.executable,
        "-c",
        BARE,
        bare_model,
        tok,
        str(text),
        str(case["max_length"]),
        str(case["dtype"]),
    ]
    bare_wall, bare = child([*argv, str(case["budget"]), device, "0"], timeout)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        run = [
            sys.executable,
            "-m",
            "isotui",
            "run",
            "-m",
            model,
            "--data",
            f"text:{text}",
            "--device",
            device,
        ]
        run += ["--dtype", str(case["dtype"]), "--max-length", str(case["max_length"]), "--no-cache", "-q"]
        run += ["--json", str(out)]
        start = time.perf_counter()
        proc = subprocess.run(
            run,
            capture_output=True,
            text=True,
            env=env() | {"ISOTUI_CACHE_DIR": str(Path(tmp) / "c")},
            cwd=tempfile.gettempdir(),
            timeout=timeout,
            check=False,
        )
        iso_wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"isotui run -m {model} failed:\n{proc.stderr[-3000:]}")
        doc = json.loads(out.read_text(encoding="utf-8"))
    meta = doc["results"][0]["meta"] if "results" in doc else doc["meta"]
    t = meta["timings"]
    # the ratios and shares from the rounded values the row shows
    forward = round(float(bare["forward_s"]), 3)  # type: ignore[arg-type]
    bare_wall, iso_wall = round(bare_wall, 3), round(iso_wall, 3)
    bare_load = round(float(bare["load_s"]), 3)  # type: ignore[arg-type]
    return {
        "load": load,
        "bare_wall_s": bare_wall,
        "isotui_wall_s": iso_wall,
        "ratio": round(iso_wall / bare_wall, 3),
        "bare_load_s": bare_load,
        "isotui_load_s": t["load_s"],
        "build_ratio": round(t["load_s"] / max(bare_load, 1e-9), 3),
        "bare_forward_s": forward,
        "isotui_forward_s": t["forward_s"],
        "isotui_metrics_s": t["metrics_s"],
        "isotui_finalise_s": t["finalise_s"],
        "accumulation_share": round(t["metrics_s"] / max(forward, 1e-9), 4),
        "finalisation_share": round(t["finalise_s"] / max(forward, 1e-9), 4),
        "tokens": bare["tokens"],
        "threads": bare["threads"],
    }


def syncs(case: dict[str, object], text: Path, device: str, timeout: float) -> dict[str, object]:
    """Host syncs per batch, isotui and bare, over the same batches: (count at 32 - at 8) / 24."""
    model = str(case["model"])
    bare_model = minilm_dir() if model == "minilm" else model
    counts: dict[str, dict[int, object]] = {"isotui": {}, "bare": {}}
    args = [str(case["max_length"]), str(case["dtype"]), str(case["budget"]), device]
    for n in (8, 32):
        _, got = child([sys.executable, "-c", ISOTUI_SYNCS, model, str(text), *args, str(n)], timeout)
        counts["isotui"][n] = got["syncs"]
        bare_args = [bare_model, minilm_dir(), str(text), str(case["max_length"]), str(case["dtype"])]
        _, got = child([sys.executable, "-c", BARE, *bare_args, str(case["budget"]), device, str(n)], timeout)
        counts["bare"][n] = got["syncs"]

    def per_batch(c: dict[int, object]) -> float | None:
        a, b = c[8], c[32]
        return None if a is None or b is None else round((int(b) - int(a)) / 24, 2)  # type: ignore[call-overload]

    return {
        "isotui_syncs_per_batch": per_batch(counts["isotui"]),
        "bare_syncs_per_batch": per_batch(counts["bare"]),
        "counts": {k: {str(n): v for n, v in c.items()} for k, c in counts.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="default: cuda if torch sees one, else cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device (the test's run)")
    parser.add_argument("--parts", default="0,1,2,3")
    parser.add_argument("--cases", default=None, help="part 1's cases by name (default: all three)")
    parser.add_argument("--dims", default=None, help="default 1024,2048,4096,8192 (smoke: 64,128)")
    parser.add_argument("--samples", type=int, default=None, help="per case (default 1644; smoke 24)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    parser.add_argument("--out", type=Path, default=None, help="the rows as JSON lines")
    args = parser.parse_args()

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = device_name(device)
    parts = {int(p) for p in args.parts.split(",")}
    samples = args.samples or (24 if args.smoke else 1644)
    dims = [int(d) for d in (args.dims or ("64,128" if args.smoke else "1024,2048,4096,8192")).split(",")]
    rows: list[dict[str, object]] = []
    sink = args.out.open("w", encoding="utf-8") if args.out else None

    def emit(row: dict[str, object]) -> None:
        row = {"device": device, "device_name": name, **row}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if sink is not None:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        all_cases = cases(args.smoke)
        if args.cases:
            all_cases = [c for c in all_cases if c["case"] in args.cases.split(",")]
        if 0 in parts:  # the untrained model's build alone, in one process
            kind, rest = "gpt_neox", ",".join(f"{k}={v}" for k, v in neox(args.smoke).items())
            load = uptime()
            _, got = child([sys.executable, "-c", BUILD, kind, rest, "bfloat16", device, "3"], args.timeout)
            got = {k: round(v, 3) if isinstance(v, float) else v for k, v in got.items()}
            ratio = round(float(got["isotui_build_s"]) / float(got["from_config_s"]), 3)  # type: ignore[arg-type]
            emit(
                {
                    "part": "build",
                    "case": "pythia-1.4b-shape",
                    "dtype": "bfloat16",
                    "load": load,
                    **got,
                    "ratio": ratio,
                }
            )
        if 1 in parts:
            for case in all_cases:
                text = samples_file(folder, int(case["join"]), samples)  # type: ignore[call-overload]
                emit(
                    {
                        "part": "whole",
                        "case": case["case"],
                        "dtype": case["dtype"],
                        **pair(case, text, device, args.timeout),
                    }
                )
        if 2 in parts:
            text = samples_file(folder, 1, samples)
            for d in dims:
                case = {
                    "case": f"llama-d{d}",
                    "model": spec("llama", llama(d)),
                    "dtype": "bfloat16",
                    "max_length": 64 if args.smoke else 128,
                    "join": 1,
                    "budget": 65536,
                }
                emit(
                    {
                        "part": "shares",
                        "d": d,
                        "case": case["case"],
                        "dtype": "bfloat16",
                        **pair(case, text, device, args.timeout),
                    }
                )
        if 3 in parts:
            case = {
                "case": "gpt2-4x256",
                "model": "random:gpt2:n_layer=4,n_embd=256,n_head=4",
                "dtype": "float32",
                "max_length": 64,
                "join": 1,
                "budget": 1024,
            }
            text = samples_file(folder, 1, 32 * 16)
            emit(
                {
                    "part": "syncs",
                    "case": case["case"],
                    "dtype": "float32",
                    "batch": 16,
                    "load": uptime(),
                    **syncs(case, text, device, args.timeout),
                }
            )
    if sink is not None:
        sink.close()
    print(
        f"\n{len(rows)} rows on {name} ({device}); targets: whole <= 1.10x bare (pythia), build <= 1.5x, "
        "accumulation <= 15% and finalisation <= 10% of the forward, syncs per batch <= the bare forward's"
    )


if __name__ == "__main__":
    main()
