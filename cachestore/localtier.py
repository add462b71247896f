"""A pod-local, byte-bounded LRU of encoded blocks in front of Redis (an accelerator only)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable


class LocalTier:
    """Keeps at most `max_bytes` of values; the least recently used go first.

    Nothing invalidates an entry but the bound: blocks are content-addressed, so a key
    always names the same bytes. A value larger than the whole bound is never kept.
    Thread-safe (the event loop and the lookups' reader threads share one).
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must not be negative")
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, bytes] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def get(self, key: Hashable) -> bytes | None:
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return value

    def peek(self, key: Hashable) -> bytes | None:
        """The value of `key`, if held, without counting a hit or refreshing its place."""
        with self._lock:
            return self._items.get(key)

    def put(self, key: Hashable, value: bytes) -> None:
        size = len(value)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._items[key] = value
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self._bytes -= len(evicted)
                self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
