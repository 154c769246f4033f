"""Shared type aliases of the JSON the experiments write and read back (cache payloads, records,
plans): a recursive :data:`JsonValue`, and :data:`JsonObject`, one JSON document; and
:func:`from_fields`, a dataclass rebuilt from the JSON object its ``asdict`` wrote."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeAlias, TypeVar

JsonValue: TypeAlias = "bool | int | float | str | list[JsonValue] | dict[str, JsonValue] | None"
JsonObject: TypeAlias = "dict[str, JsonValue]"

T = TypeVar("T")


def from_fields(make: Callable[..., T], fields: Mapping[str, object], **more: object) -> T:
    """``make(**fields, **more)``: a result's dataclass (a row...) from a cache entry's JSON object,
    its fields as ``asdict`` wrote them. Their names are checked by ``make`` (a missing or unknown
    one raises TypeError, which the cache's readers take for a damaged entry), not their types."""
    return make(**fields, **more)
