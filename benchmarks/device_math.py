"""Products and finalisation on a device (issue 26 items 3 and 5), per d, the device in every row.

Part 1, per d: the gram of ``--rows`` shifted anisotropic rows by every product scheme the device
is offered (isotui/extract/tensor_cores.py: float32, float64, and on a GPU with tensor cores
3xTF32 and bf16x6; on the CPU the tensor cores are emulated, so their times mean nothing there):
the error against float64 (max |G - G64| / max |G64|) and the best of 3 times, then the scheme the
probe picks. Part 2, per d: ``--layers`` layers of exact d x d sums (and a full 4,096-vector
reservoir) finalised one layer at a time (each layer's own ``finalize``) and by
``finalize_all`` (batched on a GPU), the largest relative difference between the two on any
metric, and the time left said after the first layer against the true time left.

    python benchmarks/device_math.py --device cuda [--dims 1024,2048,4096,8192] [--layers 8]
    python benchmarks/device_math.py --device cpu --dims 256,512 --layers 3   # the CPU's path
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import asdict


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, load {os.getloadavg()[0]:.2f})"


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def products(device, dims: list[int], rows: int) -> None:
    from isotui.extract import tensor_cores

    print(f"{'device':<28} {'d':>5} {'scheme':>8} {'error':>9} {'ms':>9}  picked")
    for d in dims:
        x = tensor_cores.probe_data(device, rows=rows, dim=d)
        table = tensor_cores.measure(device, tensor_cores.candidates(device), x)
        picked = tensor_cores.choose(table)
        for m in table:
            ms = f"{m.seconds * 1e3:9.2f}" if m.seconds is not None else "   failed"
            mark = "  <-" if m.scheme is picked else ""
            print(f"{device_name(device):<28} {d:>5} {m.scheme.name:>8} {m.error:9.1e} {ms}{mark}")


def layers(device, d: int, n_layers: int, n: int = 6000):
    """``n_layers`` accumulators of d, exact sums, on ``device``, fed ``n`` vectors each."""
    import torch

    from isotui.core.accumulator import LayerAccumulator, sample_keys

    gen = torch.Generator().manual_seed(d)
    scales = torch.logspace(0, -2, d, dtype=torch.float64)
    out = []
    for _ in range(n_layers):
        mean = torch.randn(d, generator=gen, dtype=torch.float64) * 2
        acc = LayerAccumulator(d, device, full_cov=True, reservoir=4096)
        for start in range(0, n, 1000):
            rows = torch.arange(start, min(start + 1000, n))
            x = (torch.randn(len(rows), d, generator=gen, dtype=torch.float64) * scales + mean).float()
            ids = rows // 25 - start // 25
            acc.commit(
                acc.partial(x.to(device), ids.to(device), sample_keys(0, rows // 25, rows % 25).to(device))
            )
        out.append(acc)
    return out


def finalisation(device, dims: list[int], n_layers: int) -> None:
    from isotui.core import products as policy
    from isotui.extract import finalise, tensor_cores
    from isotui.extract.progress import Progress

    tensor_cores.ensure_scheme(device)
    print(
        f"\n{'device':<28} {'d':>5} {'layers':>6} {'one by one s':>12} {'batched s':>9} {'max rel diff':>12} "
        f"{'ETA@1 s':>8} {'true s':>7}  scheme"
    )
    for d in dims:
        accs = layers(device, d, n_layers)
        sync(device)
        start = time.perf_counter()
        one = [acc.finalize() for acc in accs]
        sync(device)
        one_s = time.perf_counter() - start
        events: list[Progress] = []
        marks: list[float] = []

        def seen(event: Progress, events=events, marks=marks) -> None:
            events.append(event)
            marks.append(time.perf_counter())

        start = time.perf_counter()
        got = finalise.finalize_all({"model": accs}, seen, Progress(0, 0, 0, 0.0), None)
        sync(device)
        end = time.perf_counter()
        diff = 0.0
        for a, b in zip(one, got["model"], strict=True):
            for key, value in asdict(a).items():
                other = asdict(b)[key]
                if isinstance(value, float) and math.isfinite(value) and value:
                    diff = max(diff, abs(other - value) / abs(value))
        second = next((i for i, e in enumerate(events) if e.layers_done == 1), None)
        eta = events[second].finalize_left_s if second is not None else None
        truth = end - marks[second] if second is not None else None
        eta_text = f"{eta:8.2f}" if eta is not None else "       -"
        truth_text = f"{truth:7.2f}" if truth is not None else "      -"
        scheme = policy.scheme_for(accs[0].device).name
        print(
            f"{device_name(device):<28} {d:>5} {n_layers:>6} {one_s:12.2f} {end - start:9.2f} {diff:12.1e} "
            f"{eta_text} {truth_text}  {scheme}"
        )


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dims", default="1024,2048,4096,8192")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--skip-products", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dims = [int(d) for d in args.dims.split(",")]
    if not args.skip_products:
        products(device, dims, args.rows)
    finalisation(device, dims, args.layers)


if __name__ == "__main__":
    main()
