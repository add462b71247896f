"""The circuit breaker's states, and the one guard that runs async and blocking calls under it."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from cachestore.breaker import CircuitBreaker
from cachestore.errors import ValueTooLarge
from cachestore.stats import Counters
from cachestore.store.guard import FAILED, Guard
from tests.timing import ManualClock


def test_breaker_opens_probes_once_and_closes() -> None:
    clock = ManualClock()
    breaker = CircuitBreaker(failures=3, reset_s=5.0, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state == "closed"
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow()
    clock.now = 5.0
    assert breaker.state == "half_open"
    assert breaker.allow() and not breaker.allow()  # exactly one probe
    breaker.record_failure()  # the probe failed: open again for another reset_s
    assert breaker.state == "open" and breaker.times_opened == 2
    clock.now = 10.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allow()


def test_success_resets_the_failure_count() -> None:
    breaker = CircuitBreaker(failures=2, reset_s=1.0, clock=ManualClock())
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state == "closed"


def _refused() -> None:
    raise RedisConnectionError("refused")


async def _refused_async() -> None:
    raise RedisConnectionError("refused")


async def test_async_and_blocking_failures_open_one_breaker() -> None:
    counters = Counters()
    guard = Guard(CircuitBreaker(failures=2, reset_s=60.0, clock=ManualClock()), counters)
    assert await guard.run(_refused_async, 1.0) is FAILED  # the event loop's call
    assert guard.run_blocking(_refused) is FAILED  # a reader thread's: the same breaker counts both
    assert guard.state == "open"
    assert guard.run_blocking(lambda: 1) is FAILED and await guard.run(_refused_async, 1.0, write=True) is FAILED
    assert {k: counters.values[k] for k in ("errors", "skipped_open", "dropped_writes")} == {
        "errors": 2, "skipped_open": 2, "dropped_writes": 1}


async def test_a_timeout_is_a_failure_and_counted_as_one() -> None:
    counters = Counters()
    guard = Guard(CircuitBreaker(failures=5, reset_s=60.0), counters)
    assert await guard.run(lambda: asyncio.sleep(1.0), 0.01) is FAILED  # the wait is the test: a call past its budget
    assert counters.values["timeouts"] == 1 and counters.values["errors"] == 1


async def test_a_callers_mistake_propagates_and_leaves_the_probe_free() -> None:
    clock = ManualClock()
    guard = Guard(CircuitBreaker(failures=1, reset_s=5.0, clock=clock), Counters())
    guard.run_blocking(_refused)
    clock.now = 5.0  # half open: one probe may go

    def too_large() -> None:
        raise ValueTooLarge("a frame over max_value_bytes")

    with pytest.raises(ValueTooLarge):
        guard.run_blocking(too_large)
    assert await guard.run(lambda: asyncio.sleep(0, "ok"), 1.0) == "ok"  # the probe was released, and succeeds
    assert guard.state == "closed"
