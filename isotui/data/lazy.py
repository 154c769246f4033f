"""A corpus whose samples are made on demand (synthetic names, a Hugging Face media column's rows,
a streamed file): indexing, negative indexes and slices handled once, for every such corpus."""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload


class LazySamples(Sequence[str]):
    """A sequence of samples that makes sample ``i`` (``0 <= i < len``) only when asked
    (:meth:`_item`); a slice is a list, made by :meth:`_items`."""

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        size = len(self)
        if isinstance(index, slice):
            return self._items(range(*index.indices(size)))
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError(index)
        return self._item(index)

    def _item(self, index: int) -> str:
        raise NotImplementedError

    def _items(self, indexes: range) -> list[str]:
        """The samples of a slice, in order (a corpus read in one pass overrides it)."""
        return [self._item(i) for i in indexes]
