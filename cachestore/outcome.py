"""What a store call did, as a value: found, absent, stored, conflict, or the store was unavailable.

Callers decide "Redis failed" from this, never by diffing the store's error counters around a call
(a concurrent request's error on the same pod would turn a real miss into an outage).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

T = TypeVar("T")


class Outcome(StrEnum):
    FOUND = "found"  # read: the value is there (for blocks: at least the first one)
    ABSENT = "absent"  # read: Redis answered, nothing there
    STORED = "stored"  # write: done
    CONFLICT = "conflict"  # write: a compare-and-set lost to another writer
    UNAVAILABLE = "unavailable"  # Redis failed, timed out, or the breaker is open: nothing is known


@dataclass(frozen=True)
class Result(Generic[T]):
    """An outcome and the value that goes with it (frames, a record, a count)."""

    outcome: Outcome
    value: T

    @property
    def unavailable(self) -> bool:
        return self.outcome is Outcome.UNAVAILABLE
