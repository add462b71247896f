"""Reusable buffers: a hit decodes into memory that is already paged in.

A fresh context buffer (tens of MB for a 2048-token context) pays its page faults on first touch, a large
share of a hit's time to first token; so does a fresh llama.cpp sequence state. Keeping a buffer or two between
requests removes that cost for a bounded amount of memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from cachestore.codec.arrays import Array, empty, empty_bytes, numel

ROUND_TOKENS = 256  # capacities are rounded up so that buffers fit later, longer prompts
LANDING_ROUND = 4 << 20  # landing buffers likewise, in bytes

B = TypeVar("B")


class IdlePool(Generic[B]):
    """Idle buffers: `take(n)` hands out the smallest one holding at least n (else a new one from `make(n)`),
    `give` keeps the largest `max_idle`. Thread-safe: a buffer may come back on another thread."""

    def __init__(self, size: Callable[[B], int], make: Callable[[int], B], max_idle: int) -> None:
        self._size, self._make, self._max_idle = size, make, max_idle
        self._idle: list[B] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> B:
        """A buffer of at least `n` (its contents are garbage)."""
        with self._lock:
            fitting = [i for i, b in enumerate(self._idle) if self._size(b) >= n]
            if fitting:  # by index: `list.remove` would compare tensors element-wise
                return self._idle.pop(min(fitting, key=lambda i: self._size(self._idle[i])))
        return self._make(n)

    def give(self, buf: B) -> None:
        """Return a buffer nobody uses any more."""
        with self._lock:
            self._idle.append(buf)
            self._idle.sort(key=self._size, reverse=True)
            del self._idle[self._max_idle :]

    @property
    def idle(self) -> int:
        return len(self._idle)


class ContextPool(IdlePool[Array]):
    """Idle [layers, 2, kv_heads, capacity, head_dim] buffers; `take(tokens)` has room for `tokens`."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: Any, max_idle: int = 2) -> None:
        """`dtype` a numpy or torch dtype: the buffers are arrays of its library (`KvGeometry.dtype`)."""

        def make(tokens: int) -> Array:
            capacity = -(-tokens // ROUND_TOKENS) * ROUND_TOKENS
            return empty((layers, 2, kv_heads, capacity, head_dim), dtype)

        super().__init__(lambda buf: buf.shape[3], make, max_idle)


class LandingPool(IdlePool[Array]):
    """Idle 1-D uint8 buffers a lookup's frames are received into (`cachestore.wire`); `take(n)` holds n bytes,
    rounded up so that buffers fit later, longer lookups."""

    def __init__(self, like: Any, max_idle: int = 2) -> None:
        """`like`: the engine's KV dtype, whose library the buffers are arrays of."""

        def make(nbytes: int) -> Array:
            return empty_bytes(-(-nbytes // LANDING_ROUND) * LANDING_ROUND, like)

        super().__init__(numel, make, max_idle)
