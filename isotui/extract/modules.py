"""Which modules a ``--modules`` run reads: globs over ``model.named_modules()`` and named sites.

A glob names modules whose output is measured, by the rule users know from ``.gitignore``: ``*``
and ``?`` stay within one dotted name, ``**`` crosses dots (:func:`glob_regex`; before issue 38 ``*``
crossed dots, and a glob whose matches changed says so in the run's notes); a named site
(``resid_post``, ``attn_out``, ``mlp_out``, ``norm_in``) names, for an architecture isotui knows,
the modules (or the inputs of modules) that give that point of every block. Each read is a
:class:`Site`; the run orders them by when they first run (extract/runner.py) and checks there
that each gives one (batch, position, d) tensor per forward pass (:func:`site_tensor`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from isotui.errors import IsotuiError

OUTPUT, INPUT = "output", "input"

# Per model_type, each named site as (module name pattern, what is read); ``{i}`` is a block's
# number, names relative to the base model (``bert.`` of BertForMaskedLM is added when present).
# resid_post is the default run's rows: the embeddings, then each block's output (GPT-2 and
# GPT-NeoX: each block's input, then the final norm's output, as their hidden_states are).
NAMED_SITES: dict[str, dict[str, tuple[tuple[str, str], ...]]] = {
    "bert": {
        "resid_post": (("embeddings", OUTPUT), ("encoder.layer.{i}", OUTPUT)),
        "attn_out": (("encoder.layer.{i}.attention.output.dense", OUTPUT),),
        "mlp_out": (("encoder.layer.{i}.output.dense", OUTPUT),),
        "norm_in": (
            ("encoder.layer.{i}.attention.output.LayerNorm", INPUT),
            ("encoder.layer.{i}.output.LayerNorm", INPUT),
        ),
    },
    "gpt2": {
        "resid_post": (("h.{i}", INPUT), ("ln_f", OUTPUT)),
        "attn_out": (("h.{i}.attn", OUTPUT),),
        "mlp_out": (("h.{i}.mlp", OUTPUT),),
        "norm_in": (("h.{i}.ln_1", INPUT), ("h.{i}.ln_2", INPUT), ("ln_f", INPUT)),
    },
    "gpt_neox": {
        "resid_post": (("layers.{i}", INPUT), ("final_layer_norm", OUTPUT)),
        "attn_out": (("layers.{i}.attention", OUTPUT),),
        "mlp_out": (("layers.{i}.mlp", OUTPUT),),
        "norm_in": (
            ("layers.{i}.input_layernorm", INPUT),
            ("layers.{i}.post_attention_layernorm", INPUT),
            ("final_layer_norm", INPUT),
        ),
    },
}
SITE_NAMES = ("resid_post", "attn_out", "mlp_out", "norm_in")


@dataclass(frozen=True)
class Site:
    """One tensor a stream of sites reads (extract/runner.py): a module's output, or its input
    (named sites; final-norm's norms)."""

    name: str  # the module's name in model.named_modules()
    module: Any
    read: str = OUTPUT
    # the stack of positions it is in, whose mask keeps its tokens: "model", or an
    # encoder-decoder's "encoder" or "decoder" (final-norm's; --modules reads one stack)
    component: str = "model"

    @property
    def label(self) -> str:
        """The row's ``module`` column: the module's name, ``NAME (input)`` for its input."""
        return self.name if self.read == OUTPUT else f"{self.name} (input)"


def _base_prefix(model: Any) -> str:
    """``bert.`` for a BertForMaskedLM (the base model's name under the model), else ``""``."""
    base = getattr(model, "base_model", model)
    if base is model:
        return ""
    name = next((n for n, m in model.named_modules() if m is base), "")
    return f"{name}." if name else ""


def _pattern(prefix: str, name: str) -> re.Pattern[str]:
    return re.compile(re.escape(prefix + name).replace(re.escape("{i}"), r"\d+"))


def _nearest(word: str, names: list[str]) -> str:
    close = difflib.get_close_matches(word, names, n=5, cutoff=0.0)
    return ", ".join(close) if close else "(the model has no named modules)"


WILDCARDS = frozenset("*?[")


def has_wildcard(glob: str) -> bool:
    """Whether ``glob`` is a pattern rather than one module's name (its cache key says the rule)."""
    return glob not in SITE_NAMES and any(c in WILDCARDS for c in glob)


def glob_regex(glob: str) -> re.Pattern[str]:
    """``glob`` as a regular expression over module names: ``**`` any characters (dots too),
    ``*`` any within one dotted name, ``?`` one character but a dot, ``[...]`` (``[!...]``) a
    class; everything else literal."""
    out, i = [], 0
    while i < len(glob):
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append("[^.]*")
            i += 1
        elif glob[i] == "?":
            out.append("[^.]")
            i += 1
        elif glob[i] == "[" and (end := glob.find("]", i + 2)) != -1:
            body = glob[i + 1 : end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out))


def _crossing(glob: str) -> str:
    """``glob`` with each lone ``*`` as ``**``: what it meant when ``*`` crossed dots."""
    return re.sub(r"(?<!\*)\*(?!\*)", "**", glob)


def resolve(
    model: Any, model_type: str, globs: tuple[str, ...], notes: list[str] | None = None
) -> list[Site]:
    """The sites ``globs`` name in ``model`` (named sites first looked up for ``model_type``),
    each once, in ``named_modules`` order; a glob matching nothing is refused naming the nearest
    module names. A glob whose matches differ from fnmatch's (``*`` crossing dots, the rule before
    issue 38) is said in ``notes``, or, matching nothing now, refused with the spelling that
    crosses dots."""
    modules = {n: m for n, m in model.named_modules() if n}
    names = list(modules)
    chosen: dict[tuple[str, str], Site] = {}
    what = type(model).__name__
    for glob in globs:
        if glob in SITE_NAMES:
            table = NAMED_SITES.get(model_type)
            if table is None:
                raise IsotuiError(
                    f"--modules {glob} is a named site of {', '.join(NAMED_SITES)} models, and {what} is a "
                    f"{model_type or 'non-transformers'} model: give globs of its module names instead "
                    f"(such as {_nearest(glob, names)})"
                )
            prefix = _base_prefix(model)
            found = [
                (n, read)
                for n in names
                for pattern, read in table[glob]
                if _pattern(prefix, pattern).fullmatch(n)
            ]
            if not found:
                raise IsotuiError(
                    f"--modules {glob}: {what} has none of the modules {model_type}'s {glob} names "
                    f"({', '.join(p for p, _ in table[glob])}); the nearest names: {_nearest(glob, names)}"
                )
        else:
            rule = glob_regex(glob)
            found = [(n, OUTPUT) for n in names if rule.fullmatch(n)]
            before = [n for n in names if fnmatchcase(n, glob)]
            if not found and before:
                raise IsotuiError(
                    f"--modules {glob!r} matches no module of {what}: * stays within one dotted name "
                    f"(** crosses dots); it matched {len(before)} when * crossed dots, as "
                    f"--modules {_crossing(glob)!r} does"
                )
            if not found:
                raise IsotuiError(
                    f"--modules {glob!r} matches no module of {what}; the nearest names: "
                    f"{_nearest(glob, names)}"
                )
            if notes is not None and [n for n, _ in found] != before:
                notes.append(
                    f"--modules {glob!r}: * now stays within one dotted name (** crosses dots): "
                    f"{len(found)} modules, where * crossing dots matched {len(before)}; "
                    f"--modules {_crossing(glob)!r} gives those {len(before)}"
                )
        for name, read in found:
            chosen.setdefault((name, read), Site(name, modules[name], read))
    order = {n: k for k, n in enumerate(names)}
    return sorted(chosen.values(), key=lambda s: (order[s.name], s.read != INPUT))


def read_value(site: Site, args: tuple[Any, ...]) -> Any:
    """What a hook of ``site`` sees: (args, kwargs) of a pre-hook for an input (the first
    positional argument, or ``hidden_states``), (inputs, output) of a forward hook."""
    if site.read == INPUT:
        inputs, kwargs = args
        return inputs[0] if inputs else kwargs.get("hidden_states")
    return args[1]


def site_tensor(site: Site, value: Any, inputs: dict[str, Any]) -> Any:
    """``value`` (the first element of a tuple or model output) as a (batch, position, d) tensor
    of the batch's ``inputs``: floating-point, the batch's samples, for text the input's
    positions (:func:`~isotui.extract.forward.vectors_problem`); anything else is refused in one
    sentence naming the module."""
    import torch

    from isotui.extract.forward import vectors_problem

    tensor = value
    if not isinstance(value, torch.Tensor):
        if hasattr(value, "to_tuple"):  # a transformers ModelOutput
            value = value.to_tuple()
        tensor = value[0] if isinstance(value, tuple | list) and value else value
    is_tensor = isinstance(tensor, torch.Tensor)
    if is_tensor and tensor.ndim == 3:
        problem = vectors_problem(tensor, inputs)
        if problem is None:
            return tensor
        raise IsotuiError(f"--modules: module {site.label}'s tensor {problem}; leave it out of the globs")
    said = (
        f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)}"
        if is_tensor
        else f"a {type(tensor).__name__}"
    )
    batch = len(next(iter(inputs.values())))
    raise IsotuiError(
        f"--modules: module {site.label} gives {said}, not a (batch, position, d) float tensor for "
        f"a batch of {batch}; leave it out of the globs"
    )


def edit_hook(hooks: Any, site: Site, change: Callable[[Any], Any]) -> None:
    """Hook ``site`` (on ``hooks``, an :class:`~isotui.extract.loop.Hooks`) so that the model
    goes on with ``change(tensor)`` in place of the tensor the site gives: a module's output (a
    tensor, or the first element of a tuple or of a transformers ModelOutput), or its input (the
    first positional argument, or ``hidden_states``). Registered ahead of the model's own hooks
    (transformers records hidden states in hooks), so what they record is the changed tensor.
    Anything else is refused in one sentence naming the module."""
    import torch

    if site.read == INPUT:

        def pre(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            if args:
                return (change(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}

        hooks.pre(site.module, pre, with_kwargs=True, prepend=True)
        return

    def post(_m: Any, _inputs: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return change(out)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (change(out[0]), *out[1:])
        if hasattr(out, "to_tuple") and len(out) and isinstance(out[0], torch.Tensor):  # a ModelOutput
            first = next(iter(out.keys()))
            out[first] = change(out[first])
            return out
        raise IsotuiError(
            f"module {site.label} gives a {type(out).__name__}, not a tensor or a tuple whose first "
            "element is one, so isotui cannot change what it gives; choose another site"
        )

    hooks.forward(site.module, post, prepend=True)
