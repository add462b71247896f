"""The store's small parts on their own: circuit breaker states and the pod-local LRU tier."""

from __future__ import annotations

from cachestore.breaker import CircuitBreaker
from cachestore.keys import KeySpace
from cachestore.localtier import LocalTier


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_probes_once_and_closes() -> None:
    clock = Clock()
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
    breaker = CircuitBreaker(failures=2, reset_s=1.0, clock=Clock())
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state == "closed"


def test_local_tier_is_byte_bounded_lru() -> None:
    tier = LocalTier(max_bytes=300)
    for key in "abc":
        tier.put(key, key.encode() * 100)
    assert tier.get("a") == b"a" * 100  # a is now the most recent
    tier.put("d", b"d" * 100)  # evicts b, the least recently used
    assert "b" not in tier and tier.bytes_held == 300 and tier.evictions == 1
    tier.put("huge", b"x" * 301)  # larger than the bound: never kept, evicts nothing
    assert "huge" not in tier and len(tier) == 3
    assert tier.get("b") is None and tier.misses == 1


def test_blocks_spread_over_shards() -> None:
    import random  # noqa: PLC0415

    keys = KeySpace("ns", 16)
    rng = random.Random(0)
    counts = [0] * 16
    for _ in range(1600):
        counts[keys.shard_of(rng.randbytes(16))] += 1  # type: ignore[arg-type]
    assert min(counts) > 50 and max(counts) < 160
