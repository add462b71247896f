"""The pod-local tier: a byte-bounded LRU of encoded blocks."""

from __future__ import annotations

from cachestore.localtier import LocalTier


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
