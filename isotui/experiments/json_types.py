"""Shared type aliases of the JSON the experiments write and read back (cache payloads, records,
plans): a recursive :data:`JsonValue`, and :data:`JsonObject`, one JSON document."""

from __future__ import annotations

from typing import TypeAlias

JsonValue: TypeAlias = "bool | int | float | str | list[JsonValue] | dict[str, JsonValue] | None"
JsonObject: TypeAlias = "dict[str, JsonValue]"
