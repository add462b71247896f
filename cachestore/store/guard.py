"""The one guard in front of Redis: the circuit breaker, a time bound, and the counters a failure moves.

Async calls (the event loop) and blocking ones (a lookup's reader threads) go through the same guard, so they share
one breaker and count their failures alike; nothing it guards raises on Redis trouble.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from redis.exceptions import TimeoutError as RedisTimeoutError

from cachestore.breaker import CircuitBreaker
from cachestore.errors import StoreError
from cachestore.stats import Counters

T = TypeVar("T")


class Failed:
    """Marks a guarded call that did not reach Redis or failed there."""


FAILED = Failed()


class _Call(Generic[T]):
    """What one guarded call returned, or FAILED."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: T | Failed = FAILED


class Guard:
    """A breaker and the store's counters. A guarded call counts `skipped_open` when the breaker is open, `errors`
    (and `timeouts`) when it fails, and `dropped_writes` when a write (`write=True`) did not happen.

    Caller mistakes (a `StoreError`: a value over max_value_bytes, a malformed name) and cancellation are not
    Redis's doing: they propagate, and the breaker is told nothing."""

    def __init__(self, breaker: CircuitBreaker, counters: Counters) -> None:
        self.breaker = breaker
        self.counters = counters

    @property
    def state(self) -> str:
        return self.breaker.state

    async def run(self, call: Callable[[], Awaitable[T]], timeout_s: float, *, write: bool = False) -> T | Failed:
        """`call()` under the breaker and `timeout_s`."""
        if not self.enter(write):
            return FAILED
        outcome: _Call[T] = _Call()
        with self._settle(outcome, write):
            outcome.value = await asyncio.wait_for(call(), timeout_s)
        return outcome.value

    def run_blocking(self, call: Callable[[], T], *, write: bool = False) -> T | Failed:
        """`run` for a blocking call on a reader thread (its client's socket timeout bounds it)."""
        if not self.enter(write):
            return FAILED
        outcome: _Call[T] = _Call()
        with self._settle(outcome, write):
            outcome.value = call()
        return outcome.value

    def enter(self, write: bool = False) -> bool:
        """Whether a call may go to Redis now (counted when not); one that may must then end in `succeeded`,
        `failed` or `release`."""
        if self.breaker.allow():
            return True
        self.counters.add("skipped_open")
        if write:
            self.counters.add("dropped_writes")
        return False

    def allow(self) -> bool:
        """`enter` for a caller whose fallback, when refused, is guarded calls of its own (which count the skip)."""
        return self.breaker.allow()

    def succeeded(self) -> None:
        self.breaker.record_success()

    def failed(self, exc: Exception, write: bool = False) -> Failed:
        self.counters.add("errors")
        if isinstance(exc, TimeoutError | RedisTimeoutError):
            self.counters.add("timeouts")
        if write:
            self.counters.add("dropped_writes")
        self.breaker.record_failure()
        return FAILED

    def release(self) -> None:
        """An allowed call ended without telling success or failure (cancelled, closed early, a caller's mistake)."""
        self.breaker.release()

    @contextmanager
    def _settle(self, outcome: _Call[Any], write: bool) -> Iterator[None]:
        """Tells the breaker how the call in the `with` block ended; a Redis failure leaves FAILED in `outcome` and is
        not raised."""
        try:
            yield
        except StoreError:
            self.release()
            raise
        except Exception as exc:  # noqa: BLE001 - any Redis trouble is a miss or a dropped write
            outcome.value = self.failed(exc, write)
            return
        except BaseException:  # cancelled, or the interpreter is stopping: not Redis's doing
            self.release()
            raise
        self.succeeded()
