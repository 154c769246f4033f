"""Whole-process `isotui run` over a careful bare forward (benchmarks/bare_forward.py), as a ratio.

Issue 15's target: <= 1.10x at one thread, <= 1.15x at the default threads on an idle machine.
Both read the same text file (the built-in corpus's first N samples, as isotui reads them) at the
same max length; each is timed as a whole process (imports, load, tokenise, forward, and for
isotui its metrics and output), bare and isotui alternating so adjacent runs share the machine's
load. Each row records `uptime`'s load averages before the pair and the threads both used.

    python benchmarks/process.py [--samples 1000] [--max-length 128] [--model minilm]
                                 [--threads 1,default] [--repeats 1] [--roots A,B]
                                 [--modules GLOB ...]

``--roots``: checkouts of isotui to time against each other in the same run (before/after a
change: each isotui process runs with that checkout first on PYTHONPATH), after the bare forward
of each round. Each row's ``rest`` is the wall time outside the stages its process reports: for
isotui, its imports before loading, the rows, the output and the interpreter's exit; for the bare
forward, the interpreter's start and exit.

``--modules GLOB`` (repeatable): each round also times `isotui run --modules GLOB ...` (the sites
those globs name, e.g. MiniLM's 25: ``resid_post attn_out mlp_out
'encoder.layer.*.intermediate.dense'``) right after the plain run, and prints its ratio to the
plain run's (issue 40's target: 25 MiniLM sites <= 2.5x).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds of the whole process, its CPU seconds (user + system), its stdout); a failure
    stops the benchmark. On a loaded machine the CPU seconds move less than the wall's."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # run from the temp folder: `python -m` puts the working directory first on sys.path, ahead
    # of PYTHONPATH (a checkout there would shadow --roots)
    where = tempfile.gettempdir()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, cwd=where)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, cpu, proc.stdout


def uptime() -> str:
    """`uptime`'s load averages (1, 5, 15 minutes)."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--threads", default="1,default", help="comma-separated: N or default")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--roots", default="", help="comma-separated isotui checkouts (default: installed)")
    parser.add_argument("--modules", action="append", default=[], help="also time a run of these sites")
    args = parser.parse_args()
    roots = [r for r in args.roots.split(",") if r] or [""]

    from isotui.data.sources import load_samples, parse_data
    from isotui.extract.threads import choose_threads, usable_cores
    from isotui.models.naming import parse_model

    model_dir = parse_model(args.model).local_dir()
    samples = load_samples(parse_data("builtin"), args.samples, args.max_length)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(samples) + "\n", encoding="utf-8")
        env["ISOTUI_CACHE_DIR"] = str(Path(tmp) / "cache")
        out = Path(tmp) / "run.json"
        for setting in args.threads.split(","):
            for _ in range(args.repeats):
                load = uptime()
                asked = None if setting == "default" else int(setting)
                threads = choose_threads(asked)[0]  # the bare forward gets what isotui will choose
                bare_s, bare_cpu, bare_out = timed(
                    [
                        sys.executable,
                        str(HERE / "bare_forward.py"),
                        str(corpus),
                        str(model_dir),
                        "--max-length",
                        str(args.max_length),
                        "--threads",
                        str(threads),
                    ],
                    env,
                )
                bare = json.loads(bare_out)
                flags = [] if asked is None else ["--threads", str(asked)]
                run = [sys.executable, "-m", "isotui", "run", "-m", args.model, "--data", f"text:{corpus}"]
                run += ["--max-length", str(args.max_length), "--no-cache", "-q", "--json", str(out), *flags]
                sites = [a for glob in args.modules for a in ("--modules", glob)]
                for root in roots:
                    path = os.pathsep.join([root, env.get("PYTHONPATH", "")])
                    mine = {**env, "PYTHONPATH": path} if root else env
                    for extra in [[], sites] if sites else [[]]:
                        ours_s, ours_cpu, _ = timed(run + extra, mine)
                        doc = json.loads(out.read_text(encoding="utf-8"))
                        meta = doc["results"][0]["meta"] if "results" in doc else doc["meta"]
                        meta["root"] = (root or "installed") + (
                            f" +{len(doc_rows(doc))} sites" if extra else ""
                        )
                        rows.append(
                            (setting, load, uptime(), bare, (bare_s, bare_cpu), meta, (ours_s, ours_cpu))
                        )
                        load = uptime()

    print(
        f"model={args.model} samples={len(samples)} max_length={args.max_length} "
        f"usable cores={usable_cores()} cpu_count={os.cpu_count()}"
    )
    print(
        f"{'threads':>8} {'bare/isotui':>11} {'load before':>16} {'load after':>16} "
        f"{'bare s':>7} {'isotui s':>8} {'ratio':>6} {'bare cpu':>8} {'isotui cpu':>10} {'ratio':>6}"
    )
    for setting, before, after, bare, (bare_s, bare_cpu), meta, (ours_s, ours_cpu) in rows:
        print(
            f"{setting:>8} {bare['threads']:>5}/{meta.get('threads', '?'):<5} {before:>16} {after:>16} "
            f"{bare_s:7.2f} {ours_s:8.2f} {ours_s / bare_s:5.2f}x {bare_cpu:8.2f} {ours_cpu:10.2f} "
            f"{ours_cpu / bare_cpu:5.2f}x"
        )
        timings = meta.get("timings", {})
        stages = " ".join(f"{k.removesuffix('_s')}={v}" for k, v in timings.items())
        rest = ours_s - sum(timings.values())
        print(f"{'':>8} isotui ({meta['root']}) stages (s): {stages} rest={rest:.3f}")
        bare_rest = bare_s - sum(bare[k] for k in ("imports_s", "load_s", "tokenise_s", "forward_s"))
        print(
            f"{'':>8} bare stages (s): imports={bare['imports_s']} load={bare['load_s']} "
            f"tokenise={bare['tokenise_s']} forward={bare['forward_s']} rest={bare_rest:.3f} "
            f"tokens={bare['tokens']} batches={bare['batches']}"
        )
        for note in meta.get("notes", []):
            if "load average" in note:
                print(f"{'':>8} isotui's note: {note}")
    for setting in dict.fromkeys(r[0] for r in rows):
        for root in dict.fromkeys(r[5]["root"] for r in rows):
            mine = [r for r in rows if r[0] == setting and r[5]["root"] == root]
            wall = min(r[6][0] for r in mine) / min(r[4][0] for r in mine)
            cpu = min(r[6][1] for r in mine) / min(r[4][1] for r in mine)
            ratios = sorted(r[6][0] / r[4][0] for r in mine)
            print(
                f"threads {setting} isotui {root}: best/best over {len(mine)} pair(s): wall {wall:.2f}x, "
                f"cpu {cpu:.2f}x (pairs' wall ratios {', '.join(f'{x:.2f}' for x in ratios)})"
            )
    if args.modules:  # each round's sites run over the plain run just before it
        for setting in dict.fromkeys(r[0] for r in rows):
            mine = [r for r in rows if r[0] == setting]
            pairs = [
                (a, b) for a, b in itertools.pairwise(mine) if b[5]["root"].startswith(f"{a[5]['root']} +")
            ]
            for plain, sited in pairs:
                (wall, cpu), (plain_wall, plain_cpu) = sited[6], plain[6]
                print(
                    f"threads {setting} {sited[5]['root']} over the plain run: wall {wall / plain_wall:.2f}x "
                    f"({wall:.1f} s against {plain_wall:.1f} s), cpu {cpu / plain_cpu:.2f}x"
                )
    print("targets (issue 15): <= 1.10x at one thread; <= 1.15x at the default threads, idle machine")
    if args.modules:
        print("target (issue 40): 25 MiniLM sites <= 2.5x the plain run")


def doc_rows(doc: dict) -> list:
    """The layer rows of an `isotui run --json` file (one model)."""
    result = doc["results"][0] if "results" in doc else doc
    return result["rows"]


if __name__ == "__main__":
    main()
