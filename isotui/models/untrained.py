"""Untrained (``random:``) transformers models built where they run, with weights for a seed that
do not depend on the device.

The model is built on the meta device (no memory, no draws), given empty tensors on its device
in its dtype, and then initialised by transformers' own ``initialize_weights`` (the route
``from_pretrained`` takes for weights a checkpoint lacks), module by module: each module's own
parameters and buffers are initialised in float32 on the CPU (a shadow the size of one module's
own tensors, never the whole model) and copied into the device's tensors, cast to the dtype.
Every random draw, on any device, is taken on the CPU from a generator of its own, seeded by
(seed, the draw's place in the init's order, the chunk of :data:`CHUNK` values), so large
tensors are drawn in parallel chunks and no value depends on the device, the dtype's route, the
thread count or torch's global generator.

So one seed gives the same weights on every device; in float32 they are the float32 values, and
in bfloat16 or float16 they are those values rounded (where an init is elementwise after the
draw, as every transformers init is: normal, uniform, truncated normal, zeros, ones). The values
depend on torch's CPU generator and on transformers' init code: the model's fingerprint holds
:data:`INIT_SCHEME` and the transformers version. torch's vectorised CPU normal may differ in
the last bit between CPU instruction sets (x86 AVX2 and ARM), which it did before too.

A tensor that transformers' init leaves untouched (a module whose ``_init_weights`` skips it) gets
its module's own default init (``reset_parameters``), as ``from_config`` would have given it at
construction; a buffer left unset is refused in one sentence rather than measured as garbage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from isotui.errors import IsotuiError

# Part of a random model's fingerprint (isotui.models.naming): a change of the values a seed gives
# changes it, so cached results of the old weights are never read as the new ones'.
# 1 (implicit, before): built on the CPU by from_config after torch.manual_seed(seed), then moved.
INIT_SCHEME = "device-free-2"
# Values per seeded draw: fixed, so the weights do not depend on the thread count; small enough
# that one layer's matrix (d = 2048: 4-17 M values) keeps 16 cores busy, large enough that seeding
# a generator (microseconds) is nothing beside drawing a chunk (about 5 ms on one core).
CHUNK = 1 << 20

# In-place random fills and random factories: every one is taken over (when no generator is given).
_FILLS = ("normal_", "uniform_")  # drawn in parallel chunks
_OTHER_FILLS = ("random_", "bernoulli_", "exponential_", "log_normal_", "cauchy_", "geometric_")
_FACTORIES = (
    "rand",
    "randn",
    "randint",
    "randperm",
    "rand_like",
    "randn_like",
    "randint_like",
    "normal",
    "bernoulli",
    "multinomial",
    "poisson",
)


def _stream_seed(*parts: int) -> int:
    """A 63-bit seed for one draw: the hash of (seed, draw, chunk)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def build_untrained(factory: Callable[[], Any], *, device: str, dtype: Any, seed: int, name: str) -> Any:
    """The model ``factory()`` builds, on ``device`` in ``dtype``, initialised from ``seed`` as the
    module doc says (``factory``: ``AutoModel.from_config(config)`` or a class on the config)."""
    import torch

    with torch.device("meta"):
        model = factory()
    model = model.to(dtype=dtype)  # on meta: no memory
    model.to_empty(device=device)
    init = getattr(model, "initialize_weights", None)
    if init is None:
        raise IsotuiError(f"could not build untrained model {name!r}: it is not a transformers model")
    with SeededDraws(seed) as draws, torch.no_grad(), _shadowed_init(model, draws, name):
        init()
    model.tie_weights()
    return model


class _Shadows:
    """One module's own tensors swapped for float32 CPU ones while its init runs, then copied back."""

    def __init__(self, module: Any) -> None:
        import torch

        self.module, self.saved = module, []
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is None or tensor.is_meta:
                    continue
                dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
                shadow = (
                    torch.full(tensor.shape, float("nan"), dtype=dtype) if dtype == torch.float32 else None
                )
                if shadow is None:  # integer buffers (position ids) keep what the build gave them
                    shadow = tensor.detach().to("cpu", copy=True)
                self.saved.append((table, key, tensor))
                table[key] = (
                    torch.nn.Parameter(shadow, tensor.requires_grad)
                    if table is module._parameters
                    else shadow
                )

    def unset(self) -> list[str]:
        """The floating tensors the init left (partly) unset."""
        import torch

        out = []
        for table, key, _ in self.saved:
            now = table[key]
            if now is not None and now.is_floating_point() and bool(torch.isnan(now).any()):
                out.append(key)
        return out

    def restore(self) -> None:
        """Copy each shadow into its device tensor (cast) and put the device tensor back."""
        for table, key, tensor in self.saved:
            now = table[key]
            if now is not None and tuple(now.shape) == tuple(tensor.shape):
                tensor.detach().copy_(now.detach())
                table[key] = tensor
            elif now is not None:  # the init replaced it with another shape: keep that, on the device
                table[key] = now.to(device=tensor.device, dtype=tensor.dtype)


@contextmanager
def _shadowed_init(model: Any, draws: SeededDraws, name: str) -> Iterator[None]:
    """Every transformers submodel's ``_init_weights`` run on CPU shadows of the module's own
    tensors (an instance attribute over the class's method, removed afterwards)."""
    from transformers import PreTrainedModel

    owners = [m for m in model.modules() if isinstance(m, PreTrainedModel)]

    def wrap(original: Callable[[Any], None]) -> Callable[[Any], None]:
        def init_one(module: Any) -> None:
            shadows = _Shadows(module)
            try:
                original(module)
                unset = shadows.unset()
                if unset and _is_parametrization(module):
                    _default_parametrized(module)
                    unset = shadows.unset()
                if unset and hasattr(module, "reset_parameters"):  # what from_config's build gave it
                    again = _Shadows(module)  # the init's shadows aside, fresh ones in their place
                    module.reset_parameters()
                    for table, key, first in again.saved:
                        if key not in unset:
                            table[key] = first
                    unset = shadows.unset()
                if unset:  # drawn by the model's constructor alone (older transformers' init skips it)
                    _constructor_draws(shadows, unset)
                    unset = shadows.unset()
                if unset:
                    raise IsotuiError(
                        f"could not build untrained model {name!r}: transformers' init of "
                        f"{type(module).__name__} leaves {unset[0]!r} unset"
                    )
            finally:
                shadows.restore()

        return init_one

    for owner in owners:
        owner.__dict__["_init_weights"] = wrap(owner._init_weights)  # this model's instances only
    try:
        yield
    finally:
        for owner in owners:
            owner.__dict__.pop("_init_weights", None)


# Parameters a model draws in its constructor, which some transformers versions' ``_init_weights``
# leave to that draw (wav2vec2's ``masked_spec_embed``, ``uniform_()`` on [0, 1), before 5.17):
# drawn as the constructor draws them, from the build's seeded draws.
CONSTRUCTOR_UNIFORM = ("masked_spec_embed",)


def _constructor_draws(shadows: Any, unset: list[str]) -> None:
    import torch

    for table, key, _device_tensor in shadows.saved:
        if key in unset and key in CONSTRUCTOR_UNIFORM:
            with torch.no_grad():
                table[key].uniform_()


def _is_parametrization(module: Any) -> bool:
    from torch.nn.utils.parametrize import ParametrizationList

    return isinstance(module, ParametrizationList)


def _default_parametrized(plist: Any) -> None:
    """A parametrized weight (wav2vec2's weight-normed positional convolution) that the init left
    unset: the default of torch's Linear and Conv layers (``reset_parameters``: kaiming uniform,
    a = sqrt 5), which ``from_config`` gave the weight before parametrizing it, set through the
    parametrization's ``right_inverse``."""
    import math

    import torch

    weight = torch.empty(plist().shape, dtype=torch.float32)
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    plist.right_inverse(weight)


def _torch_function_mode() -> type:
    from torch.overrides import TorchFunctionMode

    return TorchFunctionMode


class SeededDraws:
    """A torch function mode (this thread only) under which every random draw is taken on the CPU
    from its own seeded generator and copied where it goes: see the module doc.

    Taken over: ``normal_``/``uniform_`` (the tensor methods, ``torch.nn.init``'s and
    transformers' guarded ones: drawn in parallel chunks), any other function that takes a
    ``generator`` (``torch.nn.init.kaiming_uniform_``, ``trunc_normal_``...: run on a float32 CPU
    tensor with a generator of its own), the other random tensor methods and torch's random
    factories. ``torch.nn.init`` hands itself to the mode before it runs (``handle_torch_function``),
    so its functions arrive here whole and run with the generator given."""

    def __init__(self, seed: int) -> None:
        import inspect

        import torch
        from transformers import initialization

        self.seed, self.count = int(seed), 0
        self.workers = max(1, torch.get_num_threads())
        self.pool: ThreadPoolExecutor | None = None
        fills: dict[Any, str] = {getattr(torch.Tensor, n): n for n in _FILLS}
        for n in _FILLS:  # torch's, the originals transformers kept, and transformers' guarded ones
            originals = getattr(initialization, "TORCH_INIT_FUNCTIONS", {})
            for f in (getattr(torch.nn.init, n), originals.get(n), getattr(initialization, n, None)):
                if f is not None:
                    fills[f] = n
        others = {getattr(torch.Tensor, n) for n in _OTHER_FILLS}
        factories = {getattr(torch, n) for n in _FACTORIES if hasattr(torch, n)}
        takes_generator: dict[Any, bool] = {}
        mode_base = _torch_function_mode()
        draws = self

        def seeded(func: Any) -> bool:
            if func not in takes_generator:
                try:
                    takes_generator[func] = "generator" in inspect.signature(func).parameters
                except (TypeError, ValueError):
                    takes_generator[func] = False
            return takes_generator[func]

        class _Mode(mode_base):  # type: ignore[misc, valid-type]
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = dict(kwargs or {})
                if "tensor" in kwargs and not args:  # torch.nn.init hands its tensor by name
                    args = (kwargs.pop("tensor"),)
                if kwargs.get("generator") is None:
                    kwargs.pop("generator", None)
                    if func in fills:
                        return draws.fill(fills[func], args, kwargs)
                    if func in others:
                        return draws.other_fill(func, args, kwargs)
                    if func in factories:
                        return draws.factory(func, args, kwargs)
                    if args and isinstance(args[0], torch.Tensor) and seeded(func):
                        return draws.other_fill(func, args, kwargs)
                return func(*args, **kwargs)

        self.mode = _Mode()

    def __enter__(self) -> SeededDraws:
        self.pool = ThreadPoolExecutor(self.workers) if self.workers > 1 else None
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    def _next(self) -> int:
        self.count += 1
        return self.count

    def generator(self, draw: int, chunk: int = 0) -> Any:
        import torch

        return torch.Generator(device="cpu").manual_seed(_stream_seed(self.seed, draw, chunk))

    def fill(self, method: str, args: Any, kwargs: dict[str, Any]) -> Any:
        """A normal or uniform fill: float32 values drawn in chunks on the CPU, each chunk from a
        generator of its own, on threads (the values do not depend on how many)."""
        import torch

        tensor = args[0]
        if getattr(tensor, "_is_hf_initialized", False):  # transformers' guard: loaded, not drawn
            return tensor
        names = ("mean", "std") if method == "normal_" else ("a", "b")
        low, high = (0.0, 1.0)
        given = [*args[1:3]]
        low = given[0] if len(given) > 0 else kwargs.get(names[0], kwargs.get("from", low))
        high = given[1] if len(given) > 1 else kwargs.get(names[1], kwargs.get("to", high))
        draw = self._next()
        direct = tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.is_contiguous()
        out = tensor.detach() if direct else torch.empty(tensor.shape, dtype=torch.float32)
        flat = out.view(-1)
        spans = [(j, flat[i : i + CHUNK]) for j, i in enumerate(range(0, flat.numel(), CHUNK))]

        def one(span: tuple[int, Any]) -> None:
            j, part = span
            getattr(part, method)(low, high, generator=self.generator(draw, j))

        if len(spans) > 1 and self.pool is not None:
            list(self.pool.map(one, spans))
        else:
            for span in spans:
                one(span)
        if not direct:
            tensor.detach().copy_(out)
        return tensor

    def other_fill(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Any other draw into a tensor: taken on a float32 CPU copy with a generator of its own,
        then copied back."""
        import torch

        tensor = args[0]
        direct = tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64)
        cpu = (
            tensor
            if direct
            else tensor.detach().to("cpu", torch.float32 if tensor.is_floating_point() else None)
        )
        func(cpu, *args[1:], **kwargs, generator=self.generator(self._next()))
        if not direct:
            tensor.detach().copy_(cpu)
        return tensor

    def factory(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """``torch.randn(...)`` and its kin: made on the CPU, then moved to the device asked for."""
        import torch

        like = next((a for a in args if isinstance(a, torch.Tensor)), None)
        device = kwargs.pop("device", None)
        if device is None:
            device = like.device if like is not None else torch.get_default_device()
        args = tuple(a.to("cpu") if isinstance(a, torch.Tensor) else a for a in args)
        if like is None or func.__name__.endswith("_like"):  # a shape: made on the CPU
            kwargs["device"] = "cpu"
        out = func(*args, **kwargs, generator=self.generator(self._next()))
        return out.to(device)
