"""A small least-recently-used cache of open files (parquet tables, video containers).

Each process keeps its own: a cache built before a fork (DataLoader workers) is dropped, not
shared, the first time the child uses it, since decoder state cannot be shared across processes.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


class FileCache(Generic[V]):
    """Up to `capacity` values by key; `close(value)` runs on a value pushed out or cleared."""

    def __init__(self, capacity: int, close: Callable[[V], None] | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._close = close
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._pid = os.getpid()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value for `key`, made with `make()` (and cached) when absent."""
        if self._pid != os.getpid():  # forked: the parent's handles are not ours to use or close
            self._items = OrderedDict()
            self._pid = os.getpid()
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = make()
        self._items[key] = value
        while len(self._items) > self.capacity:
            _, old = self._items.popitem(last=False)
            self._release(old)
        return value

    def clear(self) -> None:
        """Drop (and close) every value."""
        items, self._items = self._items, OrderedDict()
        if self._pid == os.getpid():
            for value in items.values():
                self._release(value)

    def __len__(self) -> int:
        return len(self._items)

    def _release(self, value: V) -> None:
        if self._close is not None:
            self._close(value)
