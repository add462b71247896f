"""Time in tests (no tests): waiting for an event with a deadline instead of sleeping, and a clock a test moves by
hand. Torch-free: `make lowest` runs store tests that use it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

POLL_S = 0.02  # between two looks at a condition: short against any deadline here, long enough not to spin


def wait_for(done: Callable[[], T], what: str, timeout_s: float = 30.0, poll_s: float = POLL_S) -> T:
    """Poll `done` until it returns something true, and return that; fail naming `what` after `timeout_s`.
    The one way a test waits for something another thread or process does (never a sleep that orders events)."""
    deadline = time.monotonic() + timeout_s
    while not (result := done()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(poll_s)
    return result


async def wait_for_async(done: Callable[[], T | Awaitable[T]], what: str, timeout_s: float = 30.0,
                         poll_s: float = POLL_S) -> T:
    """`wait_for` on the event loop: `done` may be a coroutine function; the loop runs between looks."""
    deadline = time.monotonic() + timeout_s
    while True:
        result: Any = done()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(poll_s)


class ManualClock:
    """A clock (`clock()` -> seconds) that moves only when a test sets `now`: time-based code tested without
    waiting."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
