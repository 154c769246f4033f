"""A count kept on the accumulator's device: a 0-d int64 tensor that each batch adds to without a
host sync (the accelerators' sync-free path), read on the host (a sync) only when asked for."""

from __future__ import annotations

from typing import Any, overload


class DeviceCount:
    """The attribute ``name`` of an accumulator reads its tensor ``_name`` as an int and sets it
    in place (``fill_``), so that the tensor stays where the batches add to it."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self.held = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.held = "_" + name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> DeviceCount: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> int: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> DeviceCount | int:
        return self if obj is None else int(getattr(obj, self.held))

    def __set__(self, obj: Any, value: int) -> None:
        getattr(obj, self.held).fill_(value)
