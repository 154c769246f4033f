"""Where a streamed run's memory goes: the model's weights per device, each layer's accumulators
on the device of that layer's hidden states, and which metrics that leaves exact or sampled.

Budgets come from the devices themselves, never from constants: after the model is placed (and
its first batch has run), each device's measured free memory (CUDA ``mem_get_info``, the CPU's
``MemAvailable``) less a margin. Exact streamed covariances (a d x d float64 running sum) go to
every layer whose device still has room for them, in layer order, after one batch partial per
device (a layer commits its batch's d x d sum before the next layer makes its own, so one lives
at a time, not one per layer: issue 15); the reservoirs share what is left, per device.

``isotui run --dry-run`` makes the same plan from the model's config alone: the model is built
on the meta device (accelerate's ``init_empty_weights``: no weights read or downloaded), placed
by accelerate's ``infer_auto_device_map`` under ``--max-memory``, and each device's budget is what
``--max-memory`` gives it less its weights, the workspace and the margin (:func:`sums_budgets`).

``--max-memory`` bounds everything isotui places on a device: before placement, the sums (the
whole plan where it fits, else the floor) and the first batch's workspace are taken out of what
accelerate is given (:func:`placement_memory`), and a run under ``--max-memory`` budgets those
devices with the dry run's arithmetic, its measured free memory only stopping it. The workspace
is the larger of a batch (the forward's activations and one layer's fold,
:func:`fold_transient_bytes`) and finalising one layer (:func:`finalisation_workspace_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from isotui.core.sampled import BOOTSTRAP, SE_GROUPS
from isotui.errors import IsotuiError
from isotui.extract.device import available_memory, resolve_dtype
from isotui.extract.memory_values import SELF_SIM_TYPES, TOKEN_BUDGET
from isotui.extract.memory_values import check_devices as check_devices  # importable from here too
from isotui.models.placement import infer_device_map, refuse_all_on_disk

if TYPE_CHECKING:
    from isotui.models.naming import ModelRef


class PhaseLine(Protocol):
    """A dry run's time per phase as the plan shows it (:class:`isotui.extract.phase_time.PhaseTimes`,
    which reads the plan: the plan names only what it shows of it)."""

    def line(self) -> str: ...

    def layer_cells(self) -> list[tuple[str, str]]: ...

    def to_json(self) -> dict[str, Any]: ...


MARGIN_SHARE = 0.10  # of a device's free memory, kept for transients (the batch's float64 copy)
MARGIN_MIN = 256 << 20  # and never less than this
VECTOR_SUMS = 10  # d-long float64 running vectors per layer (sums, shifts, min, max)
RESERVOIR_MIN = 2
# the smallest reservoir a plan may give a layer without being refused: the standard errors come
# from 8 disjoint groups of the reservoir, and 2 vectors a group is the least that has a spread
RESERVOIR_FLOOR = 16
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# --- the options' values ----------------------------------------------------------------------


def device_name(where: Any) -> str:
    """accelerate's device-map value (0, "cpu", "disk", torch.device) -> ``cuda:0``, ``cpu``..."""
    if isinstance(where, int):
        return f"cuda:{where}"
    text = str(where)
    return "cuda:0" if text == "cuda" else text


def execution_device(device_map: Mapping[str, Any]) -> str:
    """Where a split model runs: accelerate's main device, the first GPU in the map (layers kept
    on the CPU or on disk run there too), else the CPU."""
    devices = [device_name(v) for v in device_map.values()]
    return next((d for d in devices if d not in ("cpu", "disk")), "cpu")


def device_of(name: str, device_map: Mapping[str, Any]) -> str:
    """The device-map entry of the module ``name`` (the longest prefix that the map names)."""
    parts = name.split(".")
    for cut in range(len(parts), -1, -1):
        key = ".".join(parts[:cut])
        if key in device_map:
            return device_name(device_map[key])
    return execution_device(device_map)


def device_summary(device_map: Mapping[str, Any]) -> str:
    """``12 parts on cuda:0, 3 on cpu, 2 on disk``: how accelerate placed the model."""
    counts: dict[str, int] = {}
    for where in device_map.values():
        counts[device_name(where)] = counts.get(device_name(where), 0) + 1
    parts = [f"{n} on {d}" for d, n in counts.items()]
    first = next(iter(counts.values()))
    parts[0] = parts[0].replace(" on ", " part on " if first == 1 else " parts on ", 1)
    return ", ".join(parts) + f"; run from {execution_device(device_map)}"


def weights_per_device(model: Any, device_map: Mapping[str, Any] | None, device: str) -> dict[str, int]:
    """Parameter bytes per device (``disk``: offloaded), each tied weight once."""
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        where = device_of(name, device_map) if device_map else device
        out[where] = out.get(where, 0) + p.numel() * p.element_size()
    return out


# --- the plan ---------------------------------------------------------------------------------


def margin(free: int) -> int:
    """What of a device's free memory stays free: transients, the allocator's slack."""
    return max(MARGIN_MIN, int(free * MARGIN_SHARE))


def measured_memory(device: str) -> tuple[int | None, int | None]:
    """``device``'s free bytes now and what of them accumulators may take (less :func:`margin`);
    None where free memory cannot be told, e.g. MPS."""
    free = available_memory(device)
    return free, None if free is None else max(0, free - margin(free))


def measured_budget(device: str) -> int | None:
    """Bytes accumulators may take on ``device`` now (:func:`measured_memory`)."""
    return measured_memory(device)[1]


def activation_bytes(
    tokens: int, dim: int, inter: int, act_bytes: int, states: int, reservoir: int = 0
) -> int:
    """A batch of ``tokens`` on a device where ``states`` hidden states of width ``dim`` are made:
    those states, the widest forward transients (the MLP's ``inter``-wide ones) and the fold of
    one layer into its sums (:func:`fold_transient_bytes`, as tracked types and exact covariance
    at their most, a reservoir of ``reservoir`` vectors filling); nothing where no state is made.
    The dry run and the run budget the same bytes."""
    if not states:
        return 0
    return forward_bytes(tokens, dim, inter, act_bytes, states) + fold_transient_bytes(
        tokens, dim, act_bytes, samples=tokens, types=SELF_SIM_TYPES, exact=True, reservoir=reservoir
    )


def forward_bytes(tokens: int, dim: int, inter: int, act_bytes: int, states: int) -> int:
    """The forward's activations of a batch of ``tokens`` on a device where ``states`` hidden
    states of width ``dim`` are made: those states (kept until the batch is folded) and the
    widest transients, three of the MLP's ``inter``-wide ones; nothing where no state is made."""
    return tokens * act_bytes * (dim * states + 3 * inter) if states else 0


def mlp_width(config: Any, dim: int) -> int:
    """The MLP's inner width a config gives (``intermediate_size``), else the usual 4 d."""
    inter = getattr(config, "intermediate_size", None)
    return inter if isinstance(inter, int) and inter > 0 else 4 * dim


PAGE = 4096
# Linux maps this much of a mapped file around each page read from it (``fault_around_bytes``,
# 64 KiB by default): the loader's first read of a tensor it leaves on disk maps that much
FAULT_AROUND = 64 << 10


def offload_bytes(model: Any, placed: Mapping[str, Any] | None, main: str) -> dict[str, int]:
    """What offloading adds on each device beside the weights placed there: accelerate brings an
    offloaded module's own weights to the main device while it runs, one module at a time (the
    largest such module's bytes there); a module on disk is read on the CPU first (the largest
    one's bytes there too); and loading reads the first page of every tensor it leaves on disk
    from the memory-mapped weight file, which maps the :data:`FAULT_AROUND` bytes around it into
    the process for as long as the file stays mapped: counted as that and a page per tensor, and
    never more than those tensors' own pages. Measured (``tests/test_offload_bytes.py``, and a bare
    ``from_pretrained`` maps the same): a GPT-2 of d = 256 keeps 68 KiB of each 1 MB tensor on
    disk mapped; one of d = 128, 4.4 of its 5.4 MB on disk (its tensors of 64-256 kB lie in a few
    windows each). So offloading tensors not much larger than 64 KiB saves little resident
    memory. These are clean file pages, the first the kernel takes back under pressure, but they
    count in the resident size. Empty without offload."""
    if not placed:
        return {}
    largest = {"cpu": 0, "disk": 0}
    mapped = disk = 0
    for name, module in model.named_modules():
        own = [p for _, p in module.named_parameters(recurse=False)]
        if not own:
            continue
        where = device_of(f"{name}.weight" if name else "weight", placed)
        if where not in largest:
            continue
        sizes = [p.numel() * p.element_size() for p in own]
        largest[where] = max(largest[where], sum(sizes))
        if where == "disk":
            mapped += len(sizes) * (FAULT_AROUND + PAGE)
            disk += sum(sizes)
    # and never more than the disk tensors' own pages (beyond them is the weights kept)
    mapped = min(mapped, -(-disk // PAGE) * PAGE + FAULT_AROUND)
    main = device_name(main)
    out: dict[str, int] = {}
    if main != "cpu" and max(largest.values()):
        out[main] = max(largest.values())
    if largest["disk"]:
        out["cpu"] = out.get("cpu", 0) + largest["disk"] + mapped
    return out


def fold_transient_bytes(
    tokens: int, dim: int, act_bytes: int, *, samples: int, types: int, exact: bool, reservoir: int
) -> int:
    """The most memory one layer's fold of a batch allocates beside its sums, read off
    :meth:`~isotui.core.accumulator.LayerAccumulator.partial` for ``tokens`` kept vectors of
    width ``dim`` (the model's ``act_bytes`` per value) from ``samples`` samples. A device folds
    one layer at a time (each commits before the next folds), so this is per device, not per
    layer. Alive through the fold: the gathered vectors (``act_bytes``), their float64 copy, the
    unit vectors and the shifted copy (8 + 8 + 8 bytes per value), the per-sample unit sums
    (``samples`` x d float64) and norms; on top of them, the largest of these phases:

    - a square before its column sum (``u * u``, ``xs * xs``): 8 bytes per value;
    - ``exact``: the two float32 copies of the shifted vectors for the d x d product (4 + 4) and
      its float32 result (4 d^2; the float64 partial, 8 d^2, is the plan's batch partial);
    - the sentence sums: two ``samples`` x d float64;
    - ``types``: the per-type sums ((types + 1) x d), the per-(sample, type) unit sums and their
      square (8 + 8 bytes per value), and a few int64 keys per vector;
    - the reservoir while it fills: the float32 vectors (4), their concatenation with the
      ``reservoir`` held ones and the kept rows (4 (reservoir + m) d + 4 reservoir d).

    With types tracked that is 40 bytes per value beside the gathered vectors' own: 42 a token
    per dimension in bfloat16, 44 in float32."""
    m, d = tokens, dim
    value = m * d
    alive = act_bytes * value + 3 * 8 * value + 8 * samples * d + 8 * m
    phases = [
        8 * value,
        8 * value + 4 * d * d if exact else 0,
        16 * samples * d,
        8 * (types + 1) * d + 16 * value + 5 * 8 * m if types else 0,
        4 * value + 4 * (reservoir + m) * d + 4 * reservoir * d if reservoir else 4 * value,
    ]
    return alive + max(phases)


# float64 n x d copies of a reservoir of n vectors alive at once while its metrics are computed
# (read off isotui/core/isotropy.py and isotui/core/sampled.py): the sample itself and its
# centred rows throughout, then, where the directions are the sample's own, the delete-a-group
# jackknife's rest (7/8 n), its projection, the projection's negation and logsumexp's shifted
# copy (4 x 7/8, counted as 4); where the exact covariance's directions are held, one working
# copy (a projection, the rows without the top components, the standardised rows) and the unit
# rows made from it (2)
SAMPLED_COPIES = 6
HELD_COPIES = 4


def finalisation_workspace_bytes(dim: int, *, exact: bool, sample: int) -> int:
    """What finalising one layer allocates beside its sums (the plan's finalisation workspace).
    ``exact`` (the d x d sums held): :func:`~isotui.core.exact_spectrum.moments` makes X^T X and
    the centred scatter (2 x 8 d^2, after transients of 4 x 8 d^2 that are gone before the
    decompositions), then two float64 ``eigh``: each copies its input (8 d^2), returns its
    eigenvectors (8 d^2) and takes LAPACK's ``syevd`` workspace (1 + 6 d + 2 d^2 doubles); the
    first's eigenvectors stay while the second runs, so the peak is 16 + 8 + 8 + 8 + 16 = 56
    bytes per d^2 (plus the workspace's 8 (1 + 6 d)), beside the reservoir's float64 copy
    (8 ``sample`` d). Then the reservoir's metrics over the two eigenvector matrices kept
    (16 d^2): :data:`HELD_COPIES` float64 copies of the reservoir, and I(W)'s bootstrap (its
    counts, 4 B ``sample``, and its B x 2d sums; :func:`~isotui.core.sampled.iw_bootstrap`).

    A sampled layer's reservoir (``sample`` vectors): its float64 copy and its covariance (d x d,
    or the sample x sample Gram matrix when d > sample) decomposed (input copy, eigenvalues only:
    8 n^2 + 8 (1 + 6 n + 2 n^2)), then the metrics over the sample's own directions, two n x n
    or d x d eigenvector matrices, :data:`SAMPLED_COPIES` float64 copies of the reservoir and,
    where d is below the jackknife's rest of the sample, its 2 (G + 1) d x d sums
    (:func:`~isotui.core.sampled.eigen_jackknife_se`).
    These are live bytes: on the CPU, finalisation gives freed heap back before and after each
    layer (:func:`~isotui.extract.heap.release_free_memory`). On a GPU the reservoir's host
    float64 copy (8 ``sample`` d) is on the host besides.

    Finalisation runs one layer at a time on the CPU, so a device's workspace is its widest
    layer's. isotui's device-side finalisation (``gpumath``) sizes its batches of layers with this
    function: ``k`` layers at once take ``k`` times it. cuSOLVER's ``syevd`` workspace on a GPU
    can be larger than LAPACK's (this is LAPACK's count)."""
    d = dim
    copy = 8 * sample * d
    if exact:
        syevd = 8 * (1 + 6 * d + 2 * d * d)
        decompose = max(4 * 8 * d * d, 16 * d * d + 8 * d * d + 8 * d * d + syevd + 8 * d * d) + copy
        # I(W)'s bootstrap beside the held copies: its counts and its (B x 2d) sums
        boot = 4 * BOOTSTRAP * sample + 24 * BOOTSTRAP * d
        return max(decompose, 16 * d * d + HELD_COPIES * copy + boot)
    n = min(d, sample) if sample else d
    decompose = copy + 8 * n * n + 8 * (1 + 6 * n + 2 * n * n)
    # the jackknife's per-group d x d sums (x^T x and the centred one for each of the G groups,
    # and their totals) where d leaves the rest more rows than dimensions
    grams = 2 * (SE_GROUPS + 1) * 8 * d * d if d <= sample - -(-sample // SE_GROUPS) else 0
    return max(decompose, 2 * 8 * n * n + grams + SAMPLED_COPIES * copy)


def limited_budget(given: int, weights: int, activations: int) -> int:
    """What ``given`` bytes for a device (``--max-memory``'s, or its free memory) leave for
    isotui's sums there: less the weights placed on it, the first batch's activations, and the
    margin of what is left."""
    room = max(0, given - weights - activations)
    return max(0, room - margin(room))


def room_for(need: int) -> int:
    """What a device must have left after weights and workspace for :func:`limited_budget` to
    leave ``need`` bytes of sums (the margin taken from it)."""
    return max(need + MARGIN_MIN, int(need / (1 - MARGIN_SHARE)) + 1)


def workspace_bytes(tokens: int, dim: int, inter: int, act_bytes: int, states: int, reservoir: int) -> int:
    """The memory a device needs beside weights and sums when ``states`` hidden states of width
    ``dim`` live there: the larger of a batch (:func:`activation_bytes`: the forward and one
    layer's fold) and finalising one layer (:func:`finalisation_workspace_bytes`, planned as an
    exact layer: the larger); they never overlap (finalisation runs after the last batch)."""
    if not states:
        return 0
    batch = activation_bytes(tokens, dim, inter, act_bytes, states, reservoir)
    return max(batch, finalisation_workspace_bytes(dim, exact=True, sample=reservoir))


@dataclass(frozen=True)
class Budgets:
    """Each device's room for isotui's sums, the batch they were made for, and what the weights
    and the workspace take (the budgets' arithmetic, one function for the dry run and the run)."""

    budgets: dict[str, int | None]
    tokens: int  # the first batch's tokens the workspace is made for
    held: dict[str, int]  # weights and workspace per device
    workspace: dict[str, int]


def sums_budgets(
    have: Mapping[str, int | None],
    weights: Mapping[str, int],
    where: Sequence[str],
    *,
    dim: int,
    inter: int,
    act_bytes: int,
    batch_size: int | None,
    length: int,
    main: str,
    reservoir: int,
    offload: Mapping[str, int] | None = None,
) -> Budgets:
    """The room for sums on each device of ``have`` (its bytes: ``--max-memory``'s or its free
    memory; None: unknown): what is left after its ``weights``, what offloading adds there
    (``offload``, :func:`offload_bytes`), the workspace of the hidden states ``where`` puts there
    (:func:`workspace_bytes`) at the first batch's tokens (:func:`batch_tokens`), and the margin."""

    extra = dict(offload or {})
    floor = reservoir_floor(reservoir)

    def activations(dev: str, n: int) -> int:
        return activation_bytes(n, dim, inter, act_bytes, list(where).count(dev), reservoir)

    def beside(dev: str, n: int) -> int:  # the workspace, and the sums' floor with its margin
        states = list(where).count(dev)
        sums = room_for(states * floor_bytes(dim, floor)) if states else 0
        return workspace_bytes(n, dim, inter, act_bytes, states, reservoir) + extra.get(dev, 0) + sums

    tokens = batch_tokens(batch_size, length, main, have, weights, activations, beside)
    work = {
        d: workspace_bytes(tokens, dim, inter, act_bytes, list(where).count(d), reservoir) + extra.get(d, 0)
        for d in have
    }
    return Budgets(
        {d: None if h is None else limited_budget(h, weights.get(d, 0), work[d]) for d, h in have.items()},
        tokens,
        {dev: weights.get(dev, 0) + work[dev] for dev in have},
        work,
    )


def placement_memory(
    config: Any,
    max_memory: Mapping[int | str, int] | None,
    *,
    dtype: str,
    batch_size: int | None,
    max_length: int | None,
    reservoir: int,
    cpu_least: int = 0,
) -> dict[int | str, int] | None:
    """The ``max_memory`` handed to accelerate for ``--max-memory``: on each device that will
    hold isotui's sums (every GPU named, else the CPU), what the user gave less the sums (on the
    CPU the whole plan asked for when that fits in what was given, else and on GPUs the sums at
    the floor, :func:`reservoir_floor`; with their margin, :func:`room_for`) and the workspace of
    the first batch (:func:`workspace_bytes`), so that weights, sums and workspace together stay
    within what was typed (accelerate fills a device up to what it is given). One device is
    planned for every hidden state, several GPUs each for an even share and one more (the main
    GPU also runs blocks offloaded to the CPU or disk: where that leaves it short of the floor,
    the plan is refused after placement, :meth:`MemoryPlan.refuse_below_floor`). One
    sentence (:class:`IsotuiError`) when a device cannot hold even that (on the CPU, saying
    what it needs with the least the weights take there, ``cpu_least``: :func:`cpu_least`);
    models whose config gives no ``hidden_size`` and ``num_hidden_layers`` keep ``max_memory``
    as given."""
    from isotui.models.limits import config_position_limit, default_length

    if not max_memory:
        return None
    out = dict(max_memory)
    dim, n_blocks = getattr(config, "hidden_size", None), getattr(config, "num_hidden_layers", None)
    if not isinstance(dim, int) or not isinstance(n_blocks, int):
        return out
    if getattr(config, "is_encoder_decoder", False):
        return out
    gpus = [k for k in out if isinstance(k, int)]
    homes: list[int | str] = list(gpus) or (["cpu"] if "cpu" in out else [])
    main = device_name(gpus[0]) if gpus else "cpu"
    floor = reservoir_floor(reservoir)
    length = max_length or default_length(config_position_limit(config), None)
    inter = mlp_width(config, dim)
    short: list[str] = []
    for key in homes:
        # its share of the hidden states (all of them on one device; the main GPU also makes
        # those of blocks offloaded to the CPU or disk: a plan short of its floor there is refused)
        states = n_blocks + 1 if len(homes) == 1 else -(-(n_blocks + 1) // len(homes)) + 1
        need = states * floor_bytes(dim, floor)
        given, dev = out[key], device_name(key)
        room = sums_budgets(
            {dev: given},
            {dev: cpu_least} if key == "cpu" else {},  # the weights that must stay there
            [dev] * states,
            dim=dim,
            inter=inter,
            act_bytes=DTYPE_BYTES[dtype],
            batch_size=batch_size,
            length=length,
            main=main,
            reservoir=reservoir,
        )
        reserve = room.workspace[dev] + room_for(need)
        # on the CPU, the plan asked for (exact covariances, the whole reservoir, every token
        # type) when it fits in what was given before any weight: accelerate then places weights
        # beside it; a GPU keeps the floor, so that weights stay in GPU memory rather than go to
        # disk (Llama-3-70B on 2 x 80 GB: the whole plan would send 74 GB of weights to disk)
        whole = states * LayerPlan("", dim, dev, True, reservoir, SELF_SIM_TYPES).bytes + partial_bytes(dim)
        if key == "cpu" and given >= room.workspace[dev] + room_for(whole):
            reserve = room.workspace[dev] + room_for(whole)
        if given < reserve:
            least = reserve + (cpu_least if key == "cpu" else 0)
            left = max(0, given - room.workspace[dev])
            if not short:
                short.append(
                    f"--max-memory leaves {_size(left)} on {dev} beside a batch of {room.tokens:,} tokens "
                    f"({_size(room.workspace[dev])} with finalisation) and before any weights, too little "
                    f"for even {floor} reservoir vectors per layer ({_size(need)} for its {states} layers) "
                    f"and the {_size(margin(room_for(need)))} kept free beside them; it needs at least "
                    f"--max-memory {key}={_size_up(least)} ({_size_up(least - given)} more)"
                )
            else:  # every device short is named, each with its own least (issue 36)
                short.append(
                    f"at least --max-memory {key}={_size_up(least)} ({_size_up(least - given)} more)"
                )
        out[key] = given - reserve
    if short:
        raise IsotuiError(
            " and ".join(short)
            + " (more for weights to stay in memory), or a smaller --batch-size or --max-length"
        )
    return out


def device_key(device: str) -> int | str:
    """``cuda:1`` -> 1, ``cpu`` -> ``cpu``: a device as ``--max-memory`` (accelerate) keys it."""
    return int(device.split(":")[1]) if device.startswith("cuda:") else device


def batch_tokens(
    batch_size: int | None,
    length: int,
    main: str,
    have: Mapping[str, int | None],
    weights: Mapping[str, int] | None = None,
    activations: Callable[[str, int], int] | None = None,
    beside: Callable[[str, int], int] | None = None,
) -> int:
    """The first batch's tokens the budgets are made for: ``--batch-size`` samples of ``length``,
    or the device's token budget, halved (as the run's out-of-memory back-off would) while its
    activations take more than a quarter of what the weights leave on a device in ``have``, or
    while what the weights leave is less than ``beside(device, tokens)`` (the batch's workspace
    and the sums at their floor: a batch that leaves the floor no room is halved before the
    plan is refused, so that more memory never refuses a plan that less memory allows)."""
    if batch_size:
        return batch_size * length
    tokens = TOKEN_BUDGET.get(main.split(":")[0], TOKEN_BUDGET["cpu"])
    weights = weights or {}

    def short(d: str, h: int, n: int) -> bool:
        left = h - weights.get(d, 0)
        if activations is not None and 0 < activations(d, n) > left // 4:
            return True
        return beside is not None and beside(d, n) > left

    while tokens > length and any(h is not None and short(d, h, tokens) for d, h in have.items()):
        tokens //= 2
    return tokens


def reservoir_floor(asked: int) -> int:
    """The fewest reservoir vectors a plan may give a layer (fewer is refused, never planned)."""
    return min(asked, RESERVOIR_FLOOR)


def cov_bytes(dim: int) -> int:
    """An exact streamed covariance: the d x d float64 running sum."""
    return 8 * dim * dim


def partial_bytes(dim: int) -> int:
    """A batch's d x d float64 partial, one layer's at a time per device (each layer commits it
    before the next makes its own; the product it is copied from is a transient, in the margin)."""
    return 8 * dim * dim


def fixed_bytes(dim: int, types: int) -> int:
    """A layer's accumulators apart from covariance and reservoir: float64 vectors, and the
    self-similarity sums of ``types`` token types."""
    return 8 * dim * VECTOR_SUMS + types * (8 * dim + 24)


def reservoir_bytes(dim: int, size: int) -> int:
    """A reservoir: ``size`` float32 vectors and their float64 keys."""
    return size * (4 * dim + 8)


def floor_bytes(dim: int, vectors: int) -> int:
    """A layer kept at the least a plan gives it: its fixed sums without token types, and a
    reservoir of ``vectors`` (the floor, :func:`reservoir_floor`)."""
    return fixed_bytes(dim, 0) + reservoir_bytes(dim, vectors)


def gradient_bytes(dim: int) -> int:
    """A layer's gradient sums (:class:`~isotui.core.gradients.GradAccumulator`): g g^T and the
    shifted x x^T (two d x d float64) and six float64 d-vectors."""
    return 2 * 8 * dim * dim + 6 * 8 * dim


# self-similarity's room before any covariance is planned (the fixed budget it had before):
# beyond it, token types get only what every layer's exact covariance leaves
SELF_SIM_FLOOR_BYTES = 256 << 20


def fit_types(
    layers: Sequence[tuple[int, str, bool]],
    budgets: Mapping[str, int | None],
    asked: int,
    keep_vectors: int = 0,
) -> int:
    """How many token types' self-similarity sums fit: given (d, device, tracks types) per layer
    and each device's budget, the most types up to ``asked`` whose sums, beside every layer's
    float64 vectors and a reservoir of ``keep_vectors`` (the floor, :func:`reservoir_floor`),
    fit every device's budget (these are the sums :func:`plan_layers` counts first). Exact
    covariances come before types: past what ``SELF_SIM_FLOOR_BYTES`` holds over all layers,
    types get only the room every layer's covariance (and one batch partial) leaves. A device
    whose free memory cannot be told limits nothing."""
    per_all = sum(8 * dim + 24 for dim, _dev, tracks in layers if tracks)
    floor = min(asked, SELF_SIM_FLOOR_BYTES // per_all) if per_all else asked
    fit = asked
    for device in dict.fromkeys(dev for _d, dev, _t in layers):
        left = budgets.get(device)
        mine = [(dim, tracks) for dim, dev, tracks in layers if dev == device]
        per_type = sum(8 * dim + 24 for dim, tracks in mine if tracks)
        if left is None or not per_type:
            continue
        room = left - sum(floor_bytes(dim, keep_vectors) for dim, _t in mine)
        covariances = sum(cov_bytes(dim) for dim, _t in mine) + partial_bytes(max(dim for dim, _t in mine))
        fit = min(fit, max(max(0, room - covariances) // per_type, min(floor, max(0, room) // per_type)))
    return max(0, fit)


@dataclass(frozen=True)
class LayerPlan:
    """One hidden state's accumulators: where they live, what they hold, their bytes."""

    name: str  # "layer 3", "decoder layer 3"
    dim: int
    device: str
    exact_cov: bool
    reservoir: int
    types: int = 0
    vectors: int | None = None  # the most vectors the layer will see (None: not known beforehand)

    @property
    def held(self) -> int:
        """Vectors its reservoir will hold: it fills up to its size, and never past the vectors
        there are (32 images' flattened maps: 32, however large the reservoir)."""
        return self.reservoir if self.vectors is None else min(self.reservoir, self.vectors)

    @property
    def bytes(self) -> int:
        cov = cov_bytes(self.dim) if self.exact_cov else 0
        return fixed_bytes(self.dim, self.types) + cov + reservoir_bytes(self.dim, self.held)


@dataclass
class MemoryPlan:
    """Weights and accumulators per device, and the batches (see the module's doc)."""

    layers: list[LayerPlan]
    budgets: dict[str, int | None]  # accumulator budget per device (None: not measurable)
    weights: dict[str, int] = field(default_factory=dict)
    reservoir_asked: int = 0
    batch: str = ""  # how batches are cut
    source: str = "measured free memory"
    on_paper: bool = False  # a dry run's
    types_asked: int = 0  # token types self-similarity would follow with room for all of them
    batch_tokens: int = 0  # the first batch's tokens the workspace is planned for (0: not planned)
    act_bytes: int = 4  # bytes per value of the model's hidden states
    mlp_width: int = 0  # the MLP's inner width, for the forward's widest transients (:func:`mlp_width`)
    offload: dict[str, int] = field(default_factory=dict)  # :func:`offload_bytes` per device
    # a dry run's fields that the run may find otherwise (JSON paths: "budget_bytes.cpu")
    estimates: list[str] = field(default_factory=list)
    phases: PhaseLine | None = None  # a dry run's time per phase (an estimate, decides nothing)
    # what this process held resident before the model was loaded (Python, torch, transformers):
    # outside the plan and --max-memory, stated beside them (issue 36); None: not measured
    resident: int | None = None
    # a run's free bytes per device its budget was measured from (not recorded: this process's)
    free: dict[str, int | None] = field(default_factory=dict)

    def transients(self) -> dict[str, int]:
        """Per device, the most one batch's fold allocates there beside the sums (its widest
        layer's :func:`fold_transient_bytes`: a device folds one layer at a time)."""
        out: dict[str, int] = {}
        if not self.batch_tokens:
            return out
        for p in self.layers:
            fold = fold_transient_bytes(
                self.batch_tokens,
                p.dim,
                self.act_bytes,
                samples=self.batch_tokens,
                types=p.types,
                exact=p.exact_cov,
                reservoir=p.held,
            )
            out[p.device] = max(out.get(p.device, 0), fold)
        return out

    def forward(self) -> dict[str, int]:
        """Per device, the first batch's forward activations there (:func:`forward_bytes`: the
        hidden states made there and the MLP's widest transients)."""
        out: dict[str, int] = {}
        if not self.batch_tokens:
            return out
        for device in dict.fromkeys(p.device for p in self.layers):
            states = sum(p.dim for p in self.layers if p.device == device)
            out[device] = forward_bytes(self.batch_tokens, states, self.mlp_width, self.act_bytes, 1)
        return out

    def batch_workspace(self) -> dict[str, int]:
        """Per device, the most a batch allocates there beside the sums: its forward and the fold
        of its widest layer (:meth:`forward`, :meth:`transients`)."""
        fold, forward = self.transients(), self.forward()
        return {d: forward.get(d, 0) + fold.get(d, 0) for d in {**forward, **fold}}

    def peaks(self) -> dict[str, int]:
        """Per device (``disk`` aside), the most the run holds there by this plan: the weights,
        what offloading adds (:func:`offload_bytes`), the sums, and the larger of a batch's
        workspace and finalisation's (they never overlap). Empty when no batch is planned."""
        batch, final, sums = self.batch_workspace(), self.finalisation(), self.per_device()
        if not batch:
            return {}
        devices = dict.fromkeys([*self.weights, *self.offload, *sums])
        return {
            d: self.weights.get(d, 0)
            + self.offload.get(d, 0)
            + sums.get(d, 0)
            + max(batch.get(d, 0), final.get(d, 0))
            for d in devices
            if d != "disk"
        }

    def finalisation(self) -> dict[str, int]:
        """Per device, finalising its widest layer (:func:`finalisation_workspace_bytes`; one
        layer at a time, after the last batch)."""
        out: dict[str, int] = {}
        for p in self.layers:
            work = finalisation_workspace_bytes(p.dim, exact=p.exact_cov, sample=p.held)
            out[p.device] = max(out.get(p.device, 0), work)
        return out

    def per_device(self) -> dict[str, int]:
        """Accumulator bytes per device: its layers' and one batch partial (:meth:`partials`)."""
        out: dict[str, int] = {}
        for layer in self.layers:
            out[layer.device] = out.get(layer.device, 0) + layer.bytes
        for device, held in self.partials().items():
            out[device] += held
        return out

    def partials(self) -> dict[str, int]:
        """Per device with an exact covariance, the one batch partial that lives at a time
        there: the widest exact layer's :func:`partial_bytes`."""
        out: dict[str, int] = {}
        for p in self.layers:
            if p.exact_cov:
                out[p.device] = max(out.get(p.device, 0), partial_bytes(p.dim))
        return out

    def cov_total(self) -> int:
        """The float64 covariance sums (d x d x 8 per exact layer), partials left out."""
        return sum(8 * p.dim * p.dim for p in self.layers if p.exact_cov)

    def exact_sampled(self) -> tuple[str, str]:
        """(what is exact, what is sampled) in the table's words."""
        n, cov = len(self.layers), sum(p.exact_cov for p in self.layers)
        short = [p for p in self.layers if p.reservoir < self.reservoir_asked]
        exact = (
            "avg_cos, drift, norms and self-similarity over every vector in all layers; "
            f"IsoScore, effective rank and the spectrum from the exact covariance in {cov} of {n} layers"
        )
        low, high = min(p.reservoir for p in self.layers), max(p.reservoir for p in self.layers)
        sampled = (
            "avg_cos_centered, I(W), all-but-the-top and standardised avg_cos from a reservoir of "
            + (f"{low:,}" if low == high else f"{low:,} to {high:,}")
            + " vectors per layer where a layer has more (--exact: over every vector; asked "
            f"{self.reservoir_asked:,}"
            + (f"; {len(short)} layers capped to fit their device" if short else "")
            + ")"
        )
        if cov < n:
            sampled += f"; IsoScore, effective rank and the spectrum from it in {n - cov} layers"
        return exact, sampled

    def notes(self) -> list[str]:
        """The plan in the table's notes (and the JSON's): one line per fact."""
        per = self.per_device()
        weights = ", ".join(f"{d} {_size(b)}" for d, b in self.weights.items()) or "-"
        accs = ", ".join(
            f"{d} {_size(b)} ({sum(p.device == d for p in self.layers)} layers"
            # a dry run's budgets are given; a run's measured ones go to the JSON only (notes of
            # the same computation stay the same, e.g. a merge of shards and a one-pass run)
            + (
                f", of {_size(self.budgets[d])} left"
                if self.on_paper and self.budgets.get(d) is not None
                else ""
            )
            + ")"
            for d, b in per.items()
        )
        exact, sampled = self.exact_sampled()
        partials = self.partials()
        if partials:  # counted in the accumulators above
            accs += f"; with one layer's batch partial per device ({_size(max(partials.values()))})"
        lines = [
            f"memory plan ({self.source}): weights {weights}; accumulators {accs}",
            f"exact: {exact}",
            f"sampled: {sampled}",
        ]
        lines += self.caps()
        if self.batch:
            lines.append(f"batches: {self.batch}")
        work = self.workspace_line()
        if work:
            lines.append(work)
        if self.phases is not None:
            lines.append(self.phases.line())
        resident = self.resident_line()
        if resident:
            lines.append(resident)
        if self.estimates:
            lines.append(f"estimated (the run may find otherwise): {', '.join(self.estimates)}")
        return lines

    def resident_line(self) -> str:
        """The process's fixed cost beside the plan, in words: a dry run's only (a run's own goes
        to its JSON, so that the notes of one computation are the same in every process)."""
        if self.resident is None or not self.on_paper:
            return ""
        cpu = self.peaks().get("cpu")
        total = f"; on cpu at most {_size(self.resident + cpu)} resident in all" if cpu is not None else ""
        return (
            f"beside the plan: this process holds {_size(self.resident)} resident before any model is "
            "loaded (Python, torch, transformers, their libraries), outside the plan and --max-memory" + total
        )

    def workspace_line(self) -> str:
        """The workspace beside the sums per device, in words (empty when not planned)."""
        fold, final, forward = self.transients(), self.finalisation(), self.forward()
        if not fold:
            return ""
        line = (
            f"workspace beside the sums (a batch of {self.batch_tokens:,} tokens, then finalisation, "
            "one layer at a time): "
            + ", ".join(
                f"{d} {_size(forward.get(d, 0))} forward, {_size(fold.get(d, 0))} folding, "
                f"{_size(final[d])} finalising"
                for d in final
            )
        )
        if self.offload:
            line += "; offloaded modules' weights brought in one at a time and the weight file's pages " + (
                ", ".join(f"{d} {_size(b)}" for d, b in self.offload.items())
            )
        peaks = self.peaks()
        return line + "; at most " + ", ".join(f"{d} {_size(b)}" for d, b in peaks.items()) + " in all"

    def caps(self) -> list[str]:
        """What the budgets cut below what was asked, and why (self-similarity's token types),
        and the layers whose spectrum is rank-deficient by construction."""
        out = self.rank_deficient()
        held = max((p.types for p in self.layers), default=0)  # every tracking layer holds as many
        if held >= self.types_asked:
            return out
        short = [d for d, b in self.budgets.items() if b is not None]
        return [
            f"self-similarity follows the {held:,} most frequent token types, not {self.types_asked:,}: "
            f"their float64 sums per layer fit no more beside the other sums in the memory left on "
            f"{', '.join(short) or 'the devices'} ({', '.join(_size(self.budgets[d]) for d in short)})",
            *out,
        ]

    def rank_deficient(self) -> list[str]:
        """Layers whose covariance comes from a reservoir of fewer vectors than dimensions: its
        rank is at most the reservoir's size, whatever the data (a plan's choice, said)."""
        short = [  # the plan's cap binds: a layer with fewer vectors than d is the data's doing
            p for p in self.layers if not p.exact_cov and p.reservoir < p.dim and p.held == p.reservoir
        ]
        if not short:
            return []
        low = min(p.reservoir for p in short)
        more = f" and {len(short) - 4} more" if len(short) > 4 else ""
        return [
            f"rank-deficient by construction: {', '.join(p.name for p in short[:4])}{more} (sampled "
            f"covariance from a reservoir of {low:,}{'+' if any(p.reservoir > low for p in short) else ''} "
            f"vectors in d = {max(p.dim for p in short):,}) have rank at most their reservoir's size, so "
            "IsoScore, effective rank and the spectrum there see only that many directions: give the run "
            "more memory for exact covariances, or --exact"
        ]

    def table(self) -> list[str]:
        """Per layer: device, d, exact covariance or not, reservoir, bytes and, where the plan has
        its time per phase, each layer's estimated sums and finalisation (``--dry-run``)."""
        costs = self.phases.layer_cells() if self.phases is not None else []
        timed = len(costs) == len(self.layers) > 0
        # 80 columns with the times: "encoder layer 23" and "cuda:15" are the widest name and device
        rows = [f"{'layer':<16} {'device':<7} {'d':>6} {'covariance':>10} {'reservoir':>9} {'bytes':>10}"]
        rows[0] += f" {'sums':>7} {'finalise':>8}" if timed else ""
        for i, p in enumerate(self.layers):
            rows.append(
                f"{p.name:<16} {p.device:<7} {p.dim:>6} {'exact' if p.exact_cov else 'sampled':>10} "
                f"{p.reservoir:>9,} {_size(p.bytes):>10}"
            )
            rows[-1] += f" {costs[i][0]:>7} {costs[i][1]:>8}" if timed else ""
        batch, final, per = self.batch_workspace(), self.finalisation(), self.per_device()
        peaks = self.peaks()
        if batch:
            rows += [
                "",
                f"{'device':<14} {'weights':>10} {'offload':>10} {'sums':>10} {'batch':>10} "
                f"{'finalising':>10} {'at most':>10}",
            ]
            for device in dict.fromkeys([*per, *peaks]):
                sums = per.get(device, 0)
                rows.append(
                    f"{device:<14} {_size(self.weights.get(device, 0)):>10} "
                    f"{_size(self.offload.get(device, 0)):>10} {_size(sums):>10} "
                    f"{_size(batch.get(device, 0)):>10} {_size(final.get(device, 0)):>10} "
                    f"{_size(peaks.get(device, 0)):>10}"
                )
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "weights_bytes": dict(self.weights),
            "accumulator_bytes": self.per_device(),
            "budget_bytes": dict(self.budgets),
            "covariance_bytes": self.cov_total(),
            "batch_partial_bytes": self.partials(),
            "batch": self.batch,
            "source": self.source,
            "types_asked": self.types_asked,
            "reservoir_asked": self.reservoir_asked,
            "batch_tokens": self.batch_tokens,
            "act_bytes": self.act_bytes,
            "mlp_width": self.mlp_width,
            "forward_bytes": self.forward(),
            "transient_bytes": self.transients(),
            "finalisation_bytes": self.finalisation(),
            "offload_bytes": dict(self.offload),
            "peak_bytes": self.peaks(),
            "estimates": list(self.estimates),
            **({"phases": self.phases.to_json()} if self.phases is not None else {}),
            **({"resident_before_bytes": self.resident} if self.resident is not None else {}),
            "layers": [
                {
                    "name": p.name,
                    "device": p.device,
                    "dim": p.dim,
                    "exact_cov": p.exact_cov,
                    "reservoir": p.reservoir,
                    "vectors": p.vectors,
                    "types": p.types,
                    "bytes": p.bytes,
                }
                for p in self.layers
            ],
        }

    def refuse_below_floor(
        self,
        max_memory: Mapping[int | str, int] | None,
        held: Mapping[str, int],
        what: str,
        free: Mapping[str, int | None] | None = None,
    ) -> None:
        """One sentence (:class:`IsotuiError`) when a device's budget leaves some layer a
        reservoir below :func:`reservoir_floor`, naming for every such device the real amount
        missing (issue 36): the smallest ``--max-memory`` for a device given one, else the memory
        to free there, each the least at which this plan is not refused. ``held``: what the
        weights and the first batch take on each device beside the sums (none in a run, whose
        free memory is measured with its weights loaded); ``free``: each device's free memory
        (None or missing: the budget itself, margin and all)."""
        floor = reservoir_floor(self.reservoir_asked)
        short: list[tuple[str, int, int, int]] = []  # device, its budget, the floor's sums, layers
        fixes: list[str] = []
        for device in dict.fromkeys(p.device for p in self.layers):
            mine = [p for p in self.layers if p.device == device]
            if min(p.reservoir for p in mine) >= floor:
                continue
            left = self.budgets.get(device) or 0
            need = sum(floor_bytes(p.dim, floor) for p in mine)
            short.append((device, left, need, len(mine)))
            smallest = held.get(device, 0) + room_for(need)  # the sums' floor with their margin
            given = (max_memory or {}).get(device_key(device))
            if given is not None:
                fix = f"give at least --max-memory {device_key(device)}={_size_up(smallest)}"
                fixes.append(fix + f" ({_size_up(smallest - given)} more)" if smallest > given else fix)
                continue
            have = (free or {}).get(device)
            if have is None:  # only the budget is known: what it lacks, and the margin it keeps
                have = left + margin(left)
            beside = f" with {_size(held[device])} of weights and a batch" if held.get(device) else ""
            fixes.append(
                f"free {_size_up(smallest - have)} more on {device} ({_size_up(smallest)} in all{beside}; "
                f"{_size(have)} free now)"
            )
        if not short:
            return
        device, left, need, count = short[0]
        more = "".join(f", {_size(b)} on {d} ({_size(n)} for its {c})" for d, b, n, c in short[1:])
        others = any(device_key(d) not in (max_memory or {}) for d, *_ in short)
        ways = ", or spread the model over more devices (--device-map auto)" if others else ""
        raise IsotuiError(
            f"{what} leaves {_size(left)} on {device} for isotui's sums beside the weights and a "
            f"batch{more}, too little for even {floor} reservoir vectors per layer ({_size(need)} "
            f"for its {count} layers); {' and '.join(fixes)}{ways}"
        )

    def merge_bytes(self) -> int:
        """The CPU's peak where the shards of a run with this plan merge (every device's sums
        come to the CPU there): the running sum and the shard state read beside it, then the
        merged state and the accumulators finalisation rebuilds from it (each the plan's sums),
        beside one layer's finalisation workspace."""
        sums = sum(self.per_device().values())
        return 2 * sums + max(self.finalisation().values(), default=0)

    def refuse_merge(self, count: int, free: int | None) -> None:
        """One sentence (:class:`IsotuiError`) when this machine's ``free`` CPU memory cannot
        merge the ``count`` shards of a run with this plan (:meth:`merge_bytes` and the margin),
        saying how much more it needs; the shards stay cached, so the same command merges them
        where there is room (issue 36)."""
        need = room_for(self.merge_bytes())
        if free is None or need <= free:
            return
        raise IsotuiError(
            f"merging the {count} shards of this run holds two copies of its sums on the CPU and "
            f"then finalises one layer ({_size(self.merge_bytes())}, with what is kept free "
            f"{_size_up(need)}), and the CPU has {_size(free)} free here: free {_size_up(need - free)} "
            "more, or run the same command on a machine with more memory (the shards stay cached "
            "until they merge)"
        )

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> MemoryPlan:
        """The plan :meth:`to_json` wrote (a shard's recorded plan); ValueError/KeyError/TypeError
        when ``doc`` is not one."""
        layers = [
            LayerPlan(
                str(p["name"]),
                int(p["dim"]),
                str(p["device"]),
                bool(p["exact_cov"]),
                int(p["reservoir"]),
                int(p.get("types", 0)),
                None if p.get("vectors") is None else int(p["vectors"]),
            )
            for p in doc["layers"]
        ]
        if not layers:
            raise ValueError("a plan without layers")
        reservoir = max(p.reservoir for p in layers)
        return cls(
            layers,
            {str(k): None if v is None else int(v) for k, v in dict(doc.get("budget_bytes", {})).items()},
            weights={str(k): int(v) for k, v in dict(doc.get("weights_bytes", {})).items()},
            reservoir_asked=int(doc.get("reservoir_asked", reservoir)),
            batch=str(doc.get("batch", "")),
            source=str(doc.get("source", "measured free memory")),
            types_asked=int(doc.get("types_asked", 0)),
            batch_tokens=int(doc.get("batch_tokens", 0)),
            act_bytes=int(doc.get("act_bytes", 4)),
            mlp_width=int(doc.get("mlp_width", 0)),
            offload={str(k): int(v) for k, v in dict(doc.get("offload_bytes", {})).items()},
        )

    def follow(self, own: MemoryPlan, who: str, run_key: str) -> MemoryPlan:
        """This (recorded) plan, kept by a process whose own plan would be ``own``: the same
        exact covariances, reservoirs and token types per layer, on the devices this process
        placed them on (another machine may place them elsewhere), against its budgets. One
        sentence (:class:`IsotuiError`) when it is another model's plan or does not fit here."""
        mine = [(p.name, p.dim) for p in own.layers]
        if [(p.name, p.dim) for p in self.layers] != mine:
            raise IsotuiError(
                f"{who} cannot follow the plan recorded for this run: it was made for other layers "
                f"({len(self.layers)} of d = {self.layers[0].dim}, here {len(mine)} of d = {mine[0][1]})"
            )
        layers = [
            LayerPlan(o.name, o.dim, o.device, r.exact_cov, r.reservoir, r.types, o.vectors)
            for r, o in zip(self.layers, own.layers, strict=True)
        ]
        kept = MemoryPlan(
            layers,
            own.budgets,
            weights=own.weights,
            reservoir_asked=self.reservoir_asked,
            batch=own.batch,
            source=self.source,
            types_asked=self.types_asked,
            batch_tokens=own.batch_tokens,
            act_bytes=own.act_bytes,
            mlp_width=own.mlp_width,
            offload=own.offload,
        )
        for device, need in kept.per_device().items():
            left, have = own.budgets.get(device), own.free.get(device)
            if left is not None and need > left:
                exact = sum(p.exact_cov for p in layers)
                # the free memory that holds it beside the margin, where it was measured
                more = room_for(need) - have if have is not None else need - left
                raise IsotuiError(
                    f"{who} follows the plan its run was started with ({exact} of {len(layers)} exact "
                    f"covariances, reservoirs of {max(p.reservoir for p in layers):,} vectors, "
                    f"{max(p.types for p in layers):,} token types): its sums need {_size(need)} on "
                    f"{device}, which has {_size(left)} left here; run it where {device} has "
                    f"{_size_up(more)} more free (or a larger --max-memory), or remove the run's "
                    f"shards (`isotui cache rm {run_key[:12]}`) and start again with a smaller --reservoir"
                )
        return kept


def size_text(n: int | None, *, up: bool = False) -> str:
    """Bytes in the table's words: ``1.5 GB``, ``12.0 kB``, ``?`` when unknown; ``up``: rounded
    up (a size to give or to free that is never short of ``n``)."""
    return _size_up(n) if up and n is not None else _size(n)


def _size_up(n: int) -> str:
    """Bytes in the table's words rounded up (a size to give that is never short of ``n``), to
    within 1% of it (3 digits), so that 1% less than a size stated is short of ``n``."""
    import math

    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            places = 2 if n < 10 * scale else 1
            return f"{math.ceil(n / scale * 10**places) / 10**places:.{places}f} {unit}"
    return f"{n} B"


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def plan_layers(
    layers: Sequence[tuple[str, int, str, int]],
    budgets: Mapping[str, int | None],
    reservoir: int,
    vectors: Sequence[int | None] | None = None,
) -> list[LayerPlan]:
    """Each layer's accumulators, given (name, d, device, tracked types) per layer and each
    device's budget: first the fixed sums, then an exact covariance for every layer whose device
    still has room for it (in layer order; the first also needs room for the one batch partial
    of the device's widest layer, :func:`partial_bytes`), then reservoirs of at most ``reservoir`` vectors
    sharing what is left on their device. ``vectors``: per layer, the most vectors it will see
    (None: unknown); a reservoir never holds more, so it costs no more (:attr:`LayerPlan.held`).
    A device whose free memory cannot be told (None) gets everything it is asked for."""
    bound = list(vectors) if vectors is not None else [None] * len(layers)
    plans: dict[int, LayerPlan] = {}
    for device in dict.fromkeys(d for _n, _d, d, _t in layers):
        mine = [(i, layer) for i, layer in enumerate(layers) if layer[2] == device]
        left = budgets.get(device)
        if left is None:
            for i, (name, dim, _dev, types) in mine:
                plans[i] = LayerPlan(name, dim, device, True, reservoir, types, bound[i])
            continue
        left -= sum(fixed_bytes(dim, types) for _i, (_n, dim, _dv, types) in mine)
        floor = reservoir_floor(reservoir)
        floor_bytes = sum(
            reservoir_bytes(dim, floor if bound[i] is None else min(floor, bound[i] or 0))
            for i, (_n, dim, _dv, _t) in mine
        )
        left -= floor_bytes  # covariances never take the floor's room
        exact: dict[int, bool] = {}
        partial = partial_bytes(max(dim for _i, (_n, dim, _dv, _t) in mine))
        for i, (_n, dim, _dv, _t) in mine:
            need = cov_bytes(dim) + (0 if any(exact.values()) else partial)
            exact[i] = need <= left
            left -= need if exact[i] else 0
        left += floor_bytes
        size = _reservoir_size([(dim, bound[i]) for i, (_n, dim, _dv, _t) in mine], max(0, left), reservoir)
        for i, (name, dim, _dev, types) in mine:
            plans[i] = LayerPlan(name, dim, device, exact[i], size, types, bound[i])
    return [plans[i] for i in range(len(layers))]


def _reservoir_size(layers: Sequence[tuple[int, int | None]], room: int, asked: int) -> int:
    """The largest reservoir size up to ``asked`` (at least :data:`RESERVOIR_MIN`) whose vectors
    fit ``room`` bytes on one device, given (d, the most vectors it will see) per layer: a layer
    with fewer vectors than the size holds only those."""

    def need(size: int) -> int:
        return sum(reservoir_bytes(dim, size if most is None else min(size, most)) for dim, most in layers)

    if need(asked) <= room:
        return asked
    lo, hi = RESERVOIR_MIN, asked  # need(lo) may exceed room: the floor is kept anyway
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= room else (lo, mid - 1)
    return lo


def batch_line(batch_size: int | None, device: str, max_length: int | None, tokens: int | None = None) -> str:
    """How the loop cuts batches (:class:`~isotui.extract.planning.BatchPlan`), in words;
    ``tokens``: the budget a dry run expects the out-of-memory back-off to settle on."""
    kind = device.split(":")[0]
    budget = TOKEN_BUDGET.get(kind, TOKEN_BUDGET["cpu"])
    if not batch_size and max_length and tokens and tokens < budget:
        return (
            f"auto: {budget:,}-token budget on {kind}, expected to halve to {max(1, tokens // max_length)} "
            f"samples of {max_length} tokens ({tokens:,} tokens) for the activations to fit beside the "
            "weights"
        )
    if batch_size:
        return f"{batch_size} samples per batch (--batch-size), halved on out-of-memory"
    if max_length:
        return (
            f"auto: up to {max(1, budget // max_length)} samples of {max_length} tokens "
            f"({budget:,}-token budget on {kind}), halved on out-of-memory"
        )
    return f"auto: a {budget:,}-unit budget on {kind}, halved on out-of-memory"


# --- a dry run: the plan from the config alone -------------------------------------------------


def _block_names(model: Any, count: int) -> list[str]:
    """The names of the model's ``count`` blocks (the ModuleList that holds them)."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return [f"{name}.{i}" for i in range(count)]
    return []


# what a dry run guesses until the corpus is counted (:func:`layers_plan`'s ``counted``)
CORPUS_GUESSES = ("layers.vectors", "types_asked", "layers.types", "layers.bytes", "accumulator_bytes")


@dataclass
class Paper:
    """A model placed on paper (the meta device, no weights): what every experiment's dry run
    plans from."""

    config: Any
    model: Any
    dim: int
    n_blocks: int
    dtype: str
    weights: dict[str, int]
    where: list[str]  # each hidden state's device (0: the embeddings' output)
    main: str
    budgets: dict[str, int | None]  # accumulator room per device: ``where``'s, and the CPU's
    batch: str
    source: str
    max_memory: dict[int | str, int] | None = None  # --max-memory, as accelerate keys it
    held: dict[str, int] = field(default_factory=dict)  # per device: weights and the workspace
    tokens: int = 0  # the first batch's tokens the workspace is planned for
    estimates: list[str] = field(default_factory=list)  # the plan's fields the run may see otherwise
    length: int = 0  # tokens per sample (--max-length, else the model's limit)
    offload: dict[str, int] = field(default_factory=dict)  # :func:`offload_bytes` per device
    have: dict[str, int | None] = field(default_factory=dict)  # --max-memory's or free bytes per device
    resident: int | None = None  # this process's resident bytes before any model (MemoryPlan.resident)


def place_on_paper(
    ref: ModelRef,
    *,
    device_map: str | None,
    max_memory: Sequence[tuple[int | str, int]] | None,
    device: str,
    dtype: str,
    batch_size: int | None,
    max_length: int | None,
    trust_remote_code: bool = False,
    head: str | None = None,
    reservoir: int = 4096,
) -> Paper:
    """``ref`` built from its config on the meta device (``head="lm"``: with its language-model
    head, as the gradient experiment loads it), placed by accelerate under ``--max-memory``; each
    device's budget is what ``--max-memory`` (or the device) gives it less its weights, the first
    batch's activations and the margin. Text transformers models whose config names
    ``hidden_size`` and ``num_hidden_layers``."""
    import torch

    from isotui.extract.device import fixed_cost
    from isotui.models.limits import config_position_limit, default_length
    from isotui.models.loading import model_config

    config = model_config(ref, trust_remote_code)
    resident = fixed_cost()  # as the run measures it, before its model
    dim, n_blocks = getattr(config, "hidden_size", None), getattr(config, "num_hidden_layers", None)
    if not isinstance(dim, int) or not isinstance(n_blocks, int) or config.is_encoder_decoder:
        raise IsotuiError(
            f"--dry-run plans text models whose config gives hidden_size and num_hidden_layers; "
            f"{ref.name!r} ({type(config).__name__}) does not"
        )
    memory = dict(max_memory) if max_memory else None
    gpus = [k for k in memory or {} if isinstance(k, int)]
    kind = "cuda" if gpus else device.split(":")[0] if device != "auto" else "cpu"
    declared = getattr(config, "dtype", None)
    declared = str(declared).removeprefix("torch.") if declared is not None else None
    run_dtype = resolve_dtype(dtype, kind, declared)
    model = meta_model(config, ref.name, head=head, dtype=run_dtype, trust_remote_code=trust_remote_code)
    if device_map:
        placed, _ = place_under(
            model,
            config,
            memory,
            device_map,
            dtype=run_dtype,
            batch_size=batch_size,
            max_length=max_length,
            reservoir=reservoir,
            built=ref.kind == "random",
        )
        if ref.kind == "random":  # built, then dispatched: as the run refuses it (issue 36)
            refuse_all_on_disk(placed, ref.name)
        main = execution_device(placed)
        source = "--max-memory" if memory else "this machine's devices"
    else:
        placed, main = {"": device if device != "auto" else kind}, device if device != "auto" else kind
        source = "the device's whole memory" if memory is None else "--max-memory"
    main = device_name(main)
    weights = weights_per_device(model, placed, main)
    offload = offload_bytes(model, placed if device_map else None, main)
    where = hidden_state_devices(model, placed, main, n_blocks)
    length = max_length or default_length(config_position_limit(config), None)
    have: dict[str, int | None] = {}
    for dev in dict.fromkeys([*where, "cpu"]):
        given = (memory or {}).get(device_key(dev))
        measurable = not dev.startswith("cuda:") or torch.cuda.is_available()
        have[dev] = given if given is not None else available_memory(dev) if measurable else None
    room = sums_budgets(
        have,
        weights,
        where,
        dim=dim,
        inter=mlp_width(config, dim),
        act_bytes=DTYPE_BYTES[run_dtype],
        batch_size=batch_size,
        length=length,
        main=main,
        reservoir=reservoir,
        offload=offload,
    )
    # what the dry run cannot know and the run will: budgets of devices that --max-memory does
    # not bound are this machine's free memory now, before any weight is read (the run measures
    # them after its first batch); the most vectors a layer sees (the run counts its corpus'
    # tokens); the token types self-similarity follows (the run's corpus may have fewer than
    # the 1,000 planned, and their sums' bytes with them); without --max-length, the tokenizer's
    # limit on the length
    estimates = [f"budget_bytes.{dev}" for dev in have if (memory or {}).get(device_key(dev)) is None]
    estimates += list(CORPUS_GUESSES)
    if max_length is None or (
        room.tokens < batch_tokens(batch_size, length, main, {}) and "budget_bytes." + main in estimates
    ):  # the tokenizer may cap the length; free memory halved the batch (the run halves on OOM)
        estimates += ["batch", "batch_tokens", "forward_bytes"]
    estimates += ["transient_bytes", "peak_bytes"]  # with the types
    estimates += ["resident_before_bytes"]  # the run's process measures its own
    return Paper(
        config,
        model,
        dim,
        n_blocks,
        run_dtype,
        weights,
        where,
        main,
        room.budgets,
        batch_line(batch_size, main, length, room.tokens),
        f"dry run from the config, {run_dtype} weights, memory from {source}",
        memory,
        room.held,
        room.tokens,
        estimates,
        length,
        offload,
        have,
        resident,
    )


def meta_model(config: Any, name: str, *, head: str | None, dtype: str, trust_remote_code: bool) -> Any:
    """The model of ``config`` on the meta device (no weights), as the run loads it (``head="lm"``:
    with its language-model head) in ``dtype``: what placements are made for before loading."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModel

    from isotui.models.loading import lm_class

    with init_empty_weights():
        if head == "lm":
            model = lm_class(config, name)(config)
        else:
            model = AutoModel.from_config(
                config, trust_remote_code=trust_remote_code, dtype=getattr(torch, dtype)
            )
    return model.to(getattr(torch, dtype))


def place_under(
    model: Any,
    config: Any,
    max_memory: Mapping[int | str, int] | None,
    device_map: str,
    *,
    dtype: str,
    batch_size: int | None,
    max_length: int | None,
    reservoir: int,
    built: bool = False,
) -> tuple[dict[str, Any], dict[int | str, int] | None]:
    """(accelerate's placement of ``model``, the ``max_memory`` it was made under) for
    ``--max-memory``: what isotui keeps out of each device (:func:`placement_memory`, refused
    with the least the weights take on the CPU, :func:`cpu_least`), then what offloading adds
    taken out of the CPU's share (:func:`place_within`). The dry run and the run place so.
    ``built``: an untrained model (built in memory, then dispatched: see :func:`cpu_least`)."""
    handed = placement_memory(
        config,
        max_memory,
        dtype=dtype,
        batch_size=batch_size,
        max_length=max_length,
        reservoir=reservoir,
        cpu_least=cpu_least(model, max_memory, built=built),
    )
    return place_within(model, device_map, handed)


def cpu_least(model: Any, max_memory: Mapping[int | str, int] | None, *, built: bool = False) -> int:
    """The least CPU memory a model's weights take under a CPU ``--max-memory``: all of them in
    memory, or all on disk and what offloading then adds (:func:`offload_bytes`; run from the
    first GPU it names, else the CPU), the smaller. A ``built`` (untrained) model cannot be
    wholly on disk (:func:`refuse_all_on_disk`): its least is every weight in memory, so the
    size a refusal states is one that runs (issue 36)."""
    gpus = [k for k in max_memory or {} if isinstance(k, int)]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if built:  # all in memory, and the room accelerate keeps beside them for its largest layer
        from accelerate.utils import compute_module_sizes, get_max_layer_size

        sizes = compute_module_sizes(model)
        no_split = list(getattr(model, "_no_split_modules", None) or [])
        return total + get_max_layer_size(list(model.named_children()), sizes, no_split)[0]
    main = device_name(gpus[0]) if gpus else "cpu"
    return min(total, offload_bytes(model, {"": "disk"}, main).get("cpu", 0))


def place_within(
    model: Any, device_map: str, handed: Mapping[int | str, int] | None
) -> tuple[dict[str, Any], dict[int | str, int] | None]:
    """(accelerate's placement of ``model``, the ``max_memory`` it was made under): ``handed``,
    less on the CPU what offloading that placement adds there (:func:`offload_bytes`), so that
    it comes out of the weights' share and not out of isotui's sums (placed again with the CPU's
    share cut, until the cut covers what the placement offloads; a few rounds at most, as each
    cut sends more to disk)."""
    placed = infer_device_map(model, device_map, handed)
    if not handed or "cpu" not in handed:
        return placed, dict(handed) if handed else None
    out, taken = dict(handed), 0
    for _ in range(4):
        extra = offload_bytes(model, placed, execution_device(placed)).get("cpu", 0)
        if extra <= taken:
            break
        taken = extra
        out["cpu"] = max(0, handed["cpu"] - taken)
        placed = infer_device_map(model, device_map, out)
    return placed, out


def hidden_state_devices(model: Any, placed: Mapping[str, Any], main: str, n_blocks: int) -> list[str]:
    """Where each hidden state is made (0: the embeddings' output, i: the i-th block's), by the
    device map ``placed``; offloaded blocks (CPU or disk) run on the main device when it is a GPU."""
    blocks = _block_names(model, n_blocks)
    emb = next((n for n, m in model.named_modules() if m is model.get_input_embeddings()), "")
    where = [device_of(n, placed) for n in [emb, *blocks]] if blocks else [main] * (n_blocks + 1)
    return [main if w in ("cpu", "disk") and main != "cpu" else ("cpu" if w == "disk" else w) for w in where]


def dry_run(
    ref: ModelRef,
    *,
    device_map: str | None,
    max_memory: Sequence[tuple[int | str, int]] | None,
    device: str,
    dtype: str,
    reservoir: int,
    batch_size: int | None,
    max_length: int | None,
    trust_remote_code: bool = False,
) -> MemoryPlan:
    """The memory plan of a layers run of ``ref`` from its config alone (see the module's doc)."""
    paper = place_on_paper(
        ref,
        device_map=device_map,
        max_memory=max_memory,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        max_length=max_length,
        trust_remote_code=trust_remote_code,
        reservoir=reservoir,
    )
    return layers_plan(paper, reservoir)


def layers_plan(paper: Paper, reservoir: int, counted: tuple[int, int | None] | None = None) -> MemoryPlan:
    """A layers run's plan for a model placed on paper: every hidden state's sums. ``counted``:
    the corpus's (token types self-similarity follows, most vectors a layer sees; None where not
    known), as the run counts them (:func:`isotui.extract.runner.corpus_counts`); without it the
    plan asks for the most types and no bound on the vectors, and says both are estimates."""
    dim, where = paper.dim, paper.where
    budgets = {d: paper.budgets[d] for d in dict.fromkeys(where)}
    asked, vectors = counted if counted is not None else (SELF_SIM_TYPES, None)
    types = fit_types([(dim, d, True) for d in where], budgets, asked, reservoir_floor(reservoir))
    names = [f"layer {i}" for i in range(len(where))]
    named = [(n, dim, d, types) for n, d in zip(names, where, strict=True)]
    layers = plan_layers(named, budgets, reservoir, [vectors] * len(where))
    estimates = list(paper.estimates)
    if counted is not None:
        guessed = {"types_asked", "layers.types"} | (set(CORPUS_GUESSES) if vectors is not None else set())
        if "batch_tokens" not in estimates:  # the length the corpus was cut to is the run's
            guessed |= {"transient_bytes", "peak_bytes"}
        estimates = [e for e in estimates if e not in guessed]
    plan = MemoryPlan(
        layers,
        budgets,
        weights=paper.weights,
        reservoir_asked=reservoir,
        batch=paper.batch,
        source=paper.source,
        on_paper=True,
        resident=paper.resident,
        types_asked=asked,
        batch_tokens=paper.tokens,
        act_bytes=DTYPE_BYTES[paper.dtype],
        mlp_width=mlp_width(paper.config, dim),
        offload=paper.offload,
        estimates=estimates,
    )
    what = "--max-memory" if paper.max_memory else "the free memory"
    plan.refuse_below_floor(paper.max_memory, paper.held, what, paper.have)
    return plan


# --- the other experiments' dry runs ----------------------------------------------------------
