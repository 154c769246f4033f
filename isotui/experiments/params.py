"""An experiment's own parameters, declared once as a frozen dataclass whose fields carry a
:class:`Param`: the command line's flags, the Python API's keywords (and later the app's fields)
all come from those fields, so no front end knows an experiment's options by heart.

A parameter's ``parse`` turns a value as a user gives it (a flag's string, an API keyword's int
or bool) into the field's value, or raises :class:`~isotui.errors.IsotuiError` in one sentence;
the same sentence reaches the command line and the API. ``view`` marks a parameter that only
changes what is shown (``--heads``, ``--metric``): never part of a request or its cache key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, TypeVar, overload

from isotui.errors import IsotuiError

P = TypeVar("P")
V = TypeVar("V")


def _as_given(value: V) -> V:
    return value


@dataclass(frozen=True)
class Param:
    """One parameter as every front end sees it (``name``: the field, the API keyword; its
    flag is ``--`` + name with dashes, plus ``short`` when given)."""

    name: str
    default: object
    help: str
    parse: Callable[[Any], Any] = _as_given
    choices: tuple[str, ...] = ()
    switch: bool = False  # an on/off flag (``--heads``); an API value must be a bool
    metavar: str | None = None
    short: str | None = None  # ``-q``-style spelling on the command line
    nargs: str | None = None  # "?": the flag alone means ``const``
    const: object = None
    view: bool = False  # changes only what is shown, never a request

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def value(self, given: object) -> object:
        """``given`` (None: not given) as the field's value; one sentence when it is bad."""
        if given is None:
            return self.default
        if self.nargs == "?" and given is True:  # the flag alone (an API keyword set to True)
            given = self.const
        if self.switch:
            if not isinstance(given, bool):
                raise IsotuiError(f"{self.name} must be true or false (got {given!r})")
            return given
        if self.choices and given not in self.choices:
            raise IsotuiError(f"{self.flag} must be one of {', '.join(self.choices)} (got {given!r})")
        return self.parse(given)


@overload
def param(default: None = None, **meta: object) -> None: ...
@overload
def param(default: V, **meta: object) -> V: ...
def param(default: object = None, **meta: object) -> object:
    """A dataclass field declared as an experiment parameter (see :class:`Param`); typed, as
    :func:`dataclasses.field` is, as its default, the value the field holds."""
    return field(default=default, metadata={"param": meta | {"default": default}})


def positive(flag: str) -> Callable[[str | int], int]:
    """A parameter's ``parse``: a whole number of at least 1 (not a bool), else one sentence
    naming ``flag``."""

    def parse(value: str | int) -> int:
        try:
            n = int(value)
        except (TypeError, ValueError):
            raise IsotuiError(f"{flag} must be a positive integer (got {value!r})") from None
        if isinstance(value, bool) or n < 1:  # the number as parsed: the CLI and the API say the same
            raise IsotuiError(
                f"{flag} must be a positive integer (got {value if isinstance(value, bool) else n})"
            )
        return n

    return parse


@dataclass(frozen=True)
class NoParams:
    """The parameters of an experiment that has none of its own."""


def params_of(cls: type) -> tuple[Param, ...]:
    """The parameters ``cls`` declares, in field order."""
    if not is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a parameters dataclass")
    out = []
    for f in fields(cls):
        meta = f.metadata.get("param")
        if meta is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with param()")
        if f.default is MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} has no default")
        out.append(Param(name=f.name, **meta))
    return tuple(out)


def make_params(cls: type[P], given: Mapping[str, object]) -> P:
    """An instance of ``cls`` from values as given (None or absent: the default), each checked
    in declaration order; a name ``cls`` does not declare is a :class:`TypeError` (the front end
    says unknown options in its own terms before calling this)."""
    declared = params_of(cls)
    unknown = set(given) - {p.name for p in declared}
    if unknown:
        raise TypeError(f"{cls.__name__} has no parameters {', '.join(sorted(unknown))}")
    return cls(**{p.name: p.value(given.get(p.name)) for p in declared})
