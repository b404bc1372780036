"""A least-recently-used cache bounded in bytes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["ResultCache"]

V = TypeVar("V")


class ResultCache(Generic[V]):
    """key -> value, evicting least recently used entries beyond `max_bytes`.

    `size_of(value)` gives an entry's bytes; a value larger than `max_bytes` is not stored.
    Not thread-safe: use from one event loop.
    """

    def __init__(self, max_bytes: int, size_of: Callable[[V], int]) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: str, value: V) -> bool:
        """Store `value` (evicting LRU entries); False if it is too large to cache."""
        size = self._size_of(value)
        if size > self.max_bytes:
            return False
        old = self._items.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        self._items[key] = (value, size)
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, (_, evicted) = self._items.popitem(last=False)
            self.nbytes -= evicted
        return True
