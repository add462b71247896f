"""Counters of a BlockStore, and the snapshots the service and the admin CLI read."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of one store's counters since it was created."""

    lookups: int = 0
    hits: int = 0  # lookups that found every requested block
    partial_hits: int = 0  # lookups that found a non-empty strict prefix
    misses: int = 0  # lookups that found nothing (errors included)
    blocks_read: int = 0
    bytes_read: int = 0
    local_hits: int = 0  # blocks served by the pod-local tier
    blocks_written: int = 0
    bytes_written: int = 0
    dropped_writes: int = 0  # store_blocks/write_session/put_entries calls dropped on an error or open breaker
    evictions: int = 0
    evicted_bytes: int = 0
    tenant_evictions: int = 0  # of the evictions: entries a tenant over its quota evicted (its own)
    stale_removed: int = 0  # index entries of blocks Redis evicted or expired itself
    lost_parent_writes: int = 0  # block writes dropped: Redis had lost their parent and the pod not its frames
    blocks_restored: int = 0  # blocks Redis had lost, written again from the local tier under new blocks
    errors: int = 0  # Redis errors and timeouts
    timeouts: int = 0
    skipped_open: int = 0  # calls not made because the breaker was open
    round_trips: int = 0  # pipelines / commands sent (a Cluster read of every node at once counts one)
    redirects: int = 0  # keys a Cluster node answered MOVED or ASK for, read again through the Cluster client
    bad_records: int = 0  # session records or values that failed validation
    rejected_mac: int = 0  # values read back not signed under their key by an accepted frame key (a miss)
    cas_conflicts: int = 0
    breaker_state: str = "closed"
    breaker_opened: int = 0

    def as_dict(self) -> dict[str, int | str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Counters:
    """The mutable counters behind StoreStats: the event loop and the lookups' reader threads add to them."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {
            f.name: 0 for f in fields(StoreStats) if f.type in (int, "int") and f.name != "breaker_opened"
        }
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.values[name] += n

    def add_all(self, **counts: int) -> None:
        """Several counters at once (one lock)."""
        with self._lock:
            for name, n in counts.items():
                self.values[name] += n

    def snapshot(self, breaker_state: str, breaker_opened: int) -> StoreStats:
        with self._lock:
            return StoreStats(**self.values, breaker_state=breaker_state, breaker_opened=breaker_opened)


@dataclass(frozen=True)
class Usage:
    """Bytes a namespace holds (as accounted) against its budget."""

    bytes_held: int
    budget_bytes: int
    blocks: int
    shards: int
    by_tenant: dict[str, int] = field(default_factory=dict)  # bytes each tenant's entries hold (as accounted)

    @property
    def fraction(self) -> float:
        return self.bytes_held / self.budget_bytes if self.budget_bytes else 0.0
