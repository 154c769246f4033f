"""How long each phase of a run will take, said before it starts (``--dry-run``).

A plan fixes the work of every phase; only the rate at which a device does it is not known
before the run. The work is read off the plan: weights to read, weights that an offloaded block
brings to its execution device on every batch, the forward's dense products (2 FLOPs per
weight per token, and attention's 4 x length x d per token per block), the exact sums' products
(2 d^2 FLOPs per token per exact layer, :mod:`isotui.core.products`) and the finalisation's
float64 eigendecompositions (one of d x d per exact layer, one of the reservoir's size per
layer). The rates are:

- a device on this machine: a short probe (a float32 product for the forward and the sums, a
  float64 ``eigh`` for the finalisation), about 0.1 s on a CPU;
- a GPU named in a dry run but absent here (``--max-memory 0=80GB`` on a laptop), or one whose
  name is in :data:`NOMINAL`: the vendor's peak times :data:`EFFICIENCY`, and the eigensolver's
  measured time on an H100 (1.31 s at d = 8,192, the issue's measurement) scaled by the card's
  float64 rate. A GPU is timed as an H100 when its name is unknown, and the line says so.

The estimate is a number the run may miss (the data's lengths, other jobs, the disk): it is
listed among the plan's ``estimates`` and never decides anything.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from isotui.extract.memory_plan import MemoryPlan, Paper

# The share of a peak rate a large dense product reaches: a transformer's forward at thousands
# of tokens per batch runs its matmuls at 40-60% of the vendor's peak
EFFICIENCY = 0.5
# weights read from local disk (an NVMe drive; a network file system is slower) and copied from
# host memory to a GPU (PCIe 4 x16 in practice) when accelerate offloads a block
DISK_BYTES_PER_S = 2e9
HOST_TO_GPU_BYTES_PER_S = 25e9
EIGH_REFERENCE_DIM = 8192
# What the sums and the finalisation do per layer, read off the code (and checked against the
# run's own phase times on this machine's CPU, docs/guide/run.md):
# - per token, an exact layer's gram (2 d^2 FLOPs) and the rest of the batch's fold (the types'
#   sums, the unit vectors, the float64 adds), 1 to 5 grams' time on a CPU (MiniLM's
#   100 x 64 tokens: 0.2 to 1.0 s against the grams' 0.2 s), counted as SUMS_PRODUCTS d^2;
# - per layer, the exact covariance's eigh, the reservoir metrics' 7 eighs of min(d, n) (I(W),
#   centred I(W), all-but-the-top, standardised, IsoScore*...) and the jackknife's 2 G more up to
#   EIGEN_JACKKNIFE_MAX_DIM dims, and about 2 n d^2 of products.
SUMS_PRODUCTS = 6
SAMPLE_EIGHS = 7
SAMPLE_PRODUCTS = 2


@dataclass(frozen=True)
class Rates:
    """What one device does per second: the model's products in its dtype (FLOP/s), the
    float32-accurate products of the sums (FLOP/s), and one float64 eigendecomposition at d =
    8,192 (seconds; it scales as d^3)."""

    name: str
    forward_flops: float
    sums_flops: float
    eigh_8192_s: float
    source: str  # "measured here", "nominal"
    # float64 products (the reservoir metrics') over float32's time: a GPU forms them by its
    # tensor-core scheme at the sums' rate (isotui.core.products)
    float64_penalty: float = 1.0
    per_layer_s: float = 0.0  # a layer's finalisation's fixed cost (Python, small products)

    def eigh_s(self, dim: int) -> float:
        return self.eigh_8192_s * (dim / EIGH_REFERENCE_DIM) ** 3


def _nominal(name: str, half: float, tf32: float, fp64: float) -> Rates:
    """From a card's dense peaks (FLOP/s): the forward in bfloat16/float16, the sums as three
    TF32 products (3xTF32), the eigensolver as an H100's scaled by the float64 peak."""
    h100_fp64 = 67e12
    return Rates(name, half * EFFICIENCY, tf32 / 3 * EFFICIENCY, 1.31 * h100_fp64 / fp64, "nominal")


# Dense peaks from the vendors' data sheets (SXM parts, without sparsity)
NOMINAL: dict[str, Rates] = {
    "H100": _nominal("NVIDIA H100", 989e12, 494e12, 67e12),
    "H200": _nominal("NVIDIA H200", 989e12, 494e12, 67e12),
    "A100": _nominal("NVIDIA A100", 312e12, 156e12, 19.5e12),
}


def nominal_for(name: str) -> Rates | None:
    """The nominal rates of a card whose name contains one of :data:`NOMINAL`'s keys."""
    return next((r for key, r in NOMINAL.items() if key in name.upper()), None)


def measure(device: str) -> Rates:
    """A device's rates from a short probe on it: a 2,048 x 512 x 512 float32 product (the
    forward in float32 and the sums' one-product scheme) and a float64 ``eigh`` at d = 384."""
    import torch

    dev = torch.device(device)

    def best(work) -> float:
        work()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            work()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - start)
        return max(min(times), 1e-9)

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2048, 512, generator=gen).to(dev)
    b = torch.randn(512, 512, generator=gen).to(dev)
    flops = 2 * 2048 * 512 * 512 / best(lambda: a @ b)
    small = 384
    c = torch.randn(small, small, generator=gen, dtype=torch.float64)
    c = (c @ c.T).to(dev)
    eigh = best(lambda: torch.linalg.eigh(c)) * (EIGH_REFERENCE_DIM / small) ** 3
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "this CPU"
    cpu = dev.type == "cpu"
    return Rates(name, flops, flops, eigh, "measured here", 2.0 if cpu else 1.0, 0.3 if cpu else 0.0)


_MEASURED: dict[str, Rates] = {}


def rates_for(device: str) -> Rates:
    """``device``'s rates: a GPU with a known name, nominal; one absent from this machine, an
    H100's; anything else measured once per process."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return NOMINAL["H100"]
        known = nominal_for(torch.cuda.get_device_name(torch.device(device)))
        if known is not None:
            return known
    if device not in _MEASURED:
        _MEASURED[device] = measure(device)
    return _MEASURED[device]


@dataclass
class PhaseTimes:
    """Seconds per phase of one run (one checkpoint of a series), and how they were reached."""

    tokens: int
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    devices: dict[str, str] = field(default_factory=dict)  # device -> its rates' name and source
    repeat: int = 1  # checkpoints of a series, each one such run
    bounded: bool = True  # tokens is the run's most (--max-samples); else a round number per which
    # per hidden state or site, in the plan's order: (its sums' seconds, its finalisation's), the
    # parts of the "sums" and "finalisation" phases (the dry run's table shows them per layer)
    layers: list[tuple[float, float]] = field(default_factory=list)

    def total(self) -> float:
        return sum(self.seconds.values())

    def line(self) -> str:
        phases = "; ".join(f"{name} {duration(s)}" for name, s in self.seconds.items())
        same: dict[str, list[str]] = {}  # the rates' words -> the devices timed by them
        for device, what in self.devices.items():
            same.setdefault(what, []).append(device)
        how = "; ".join(f"{', '.join(devices)}: {what}" for what, devices in same.items())
        whole = duration(self.total())
        per = (
            f"up to {self.tokens:,} tokens"
            if self.bounded
            else f"per {self.tokens:,} tokens, no --max-samples"
        )
        out = f"time (estimated, {per}; {how}): {phases}; in all {whole}"
        if self.repeat > 1:
            out += f", {duration(self.total() * self.repeat)} for its {self.repeat} checkpoints"
        return out

    def layer_cells(self) -> list[tuple[str, str]]:
        """Each layer's sums and finalisation as the plan's table shows them."""
        return [(duration(sums), duration(final)) for sums, final in self.layers]

    def to_json(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "seconds": dict(self.seconds),
            "devices": dict(self.devices),
            "repeat": self.repeat,
            "bounded": self.bounded,
            "layers": [{"sums": a, "finalisation": b} for a, b in self.layers],
        }


def duration(seconds: float) -> str:
    """``seconds`` in the unit a person reads: 0.4 s, 12 s, 75.0 min, 5.4 h."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 600:
        return f"{seconds:.0f} s"
    if seconds < 3 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class Work:
    """What a planned run does, from the plan and the model's config."""

    tokens: int  # the most tokens the run reads
    length: int  # tokens per sample (attention's cost grows with it)
    batch_tokens: int  # tokens per batch (offloaded weights travel once per batch)
    main: str  # the device the forward starts on (offloaded blocks run there)
    weights: Mapping[str, int]  # bytes of weights per device ("disk" included)
    weight_bytes: int  # bytes per weight
    embedding_weights: int  # weights looked up, not multiplied (token and position embeddings)
    blocks: Mapping[str, int]  # transformer blocks per device
    dim: int
    layers: Sequence[tuple[str, int, bool, int]]  # per hidden state: device, d, exact, reservoir


def estimate(work: Work, rates: Mapping[str, Rates] | None = None, repeat: int = 1) -> PhaseTimes:
    """Seconds per phase of ``work`` (see the module's doc); ``rates`` per device, else
    :func:`rates_for` each device."""
    from isotui.core.sampled import EIGEN_JACKKNIFE_MAX_DIM, SE_GROUPS

    devices = sorted({*(d for d in work.weights if d != "disk"), *(p[0] for p in work.layers)})
    have = {d: (rates or {}).get(d) or rates_for(d) for d in devices}
    run_on = have.get(work.main) or rates_for(work.main)
    times = PhaseTimes(work.tokens, repeat=repeat)
    times.devices = {d: f"{r.name}, {r.source}" for d, r in have.items()}
    batches = max(1, -(-work.tokens // max(1, work.batch_tokens)))
    total = sum(work.weights.values())
    times.seconds["reading weights"] = total / DISK_BYTES_PER_S
    travel = 0.0
    if work.main.startswith("cuda"):  # offloaded blocks come to the GPU on every batch
        travel += work.weights.get("cpu", 0) / HOST_TO_GPU_BYTES_PER_S
        travel += work.weights.get("disk", 0) * (1 / DISK_BYTES_PER_S + 1 / HOST_TO_GPU_BYTES_PER_S)
    elif work.weights.get("disk"):
        travel += work.weights["disk"] / DISK_BYTES_PER_S
    if travel:
        times.seconds["offloaded weights, every batch"] = travel * batches
    # the forward: each device's blocks at its rate, one after the other (a device map pipelines
    # nothing: one batch goes through the devices in turn); offloaded blocks run on the main one
    n_weights = total / work.weight_bytes - work.embedding_weights
    n_blocks = max(1, sum(work.blocks.values()))
    forward = 0.0
    for device, blocks in work.blocks.items():
        r = have.get(device) or run_on
        share = blocks / n_blocks
        flops = work.tokens * (2 * n_weights * share + 4 * work.length * work.dim * blocks)
        forward += flops / r.forward_flops
    times.seconds["forward"] = forward
    for device, dim, exact, reservoir in work.layers:
        r = have.get(device) or run_on
        m = min(dim, reservoir, work.tokens)  # the reservoir holds at most the vectors there are
        sums = work.tokens * dim * dim * SUMS_PRODUCTS / r.sums_flops if exact else 0.0
        final = r.eigh_s(dim) if exact else 0.0
        final += (SAMPLE_EIGHS + (2 * SE_GROUPS if m <= EIGEN_JACKKNIFE_MAX_DIM else 0)) * r.eigh_s(m)
        final += SAMPLE_PRODUCTS * 2 * m * dim * dim * r.float64_penalty / r.sums_flops + r.per_layer_s
        times.layers.append((sums, final))
    times.seconds["sums"] = sum(s for s, _ in times.layers)
    times.seconds["finalisation"] = sum(f for _, f in times.layers)
    return times


def paper_work(paper: Paper, plan: MemoryPlan, tokens: int) -> Work:
    """The work of a layers run planned on paper (:func:`~isotui.extract.memory_plan.layers_plan`)."""
    from collections import Counter

    import torch

    from isotui.extract.memory_plan import DTYPE_BYTES

    looked_up = sum(m.weight.numel() for m in paper.model.modules() if isinstance(m, torch.nn.Embedding))
    return Work(
        tokens=tokens,
        length=paper.length or 512,
        batch_tokens=paper.tokens or tokens,
        main=paper.main,
        weights=dict(paper.weights),
        weight_bytes=DTYPE_BYTES[paper.dtype],
        embedding_weights=looked_up,
        blocks=dict(Counter(paper.where[1:])),
        dim=paper.dim,
        layers=[(p.device, p.dim, p.exact_cov, p.reservoir) for p in plan.layers],
    )
