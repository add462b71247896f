"""A circuit breaker: stop calling a failing Redis, probe it now and then, close on success."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


class CircuitBreaker:
    """Opens after `failures` consecutive failures; after `reset_s` lets one probe through.

    Thread-safe: a BlockStore's event loop and its lookups' reader threads share one.
    """

    def __init__(self, failures: int, reset_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_threshold = failures
        self.reset_s = reset_s
        self._clock = clock
        self._state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False
        self.times_opened = 0
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        if self._state == OPEN and self._clock() - self._opened_at >= self.reset_s:
            return HALF_OPEN
        return self._state

    def allow(self) -> bool:
        """May the caller talk to Redis now? In half-open state only one probe at a time."""
        with self._lock:
            state = self.state
            if state == CLOSED:
                return True
            if state == HALF_OPEN and not self._probe_in_flight:
                self._state = HALF_OPEN
                self._probe_in_flight = True
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            self._state = CLOSED
            self._failures = 0
            self._probe_in_flight = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            probing = self._probe_in_flight
            self._probe_in_flight = False
            if probing or self._failures >= self.failure_threshold:
                if self._state != OPEN:
                    self.times_opened += 1
                self._state = OPEN
                self._opened_at = self._clock()

    def release(self) -> None:
        """A call that was allowed ended without telling success or failure (e.g. cancelled)."""
        with self._lock:
            self._probe_in_flight = False
