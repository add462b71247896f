"""Key names: blocks spread over the budget index's shards."""

from __future__ import annotations

import random

from cachestore.keys import KeySpace


def test_blocks_spread_over_shards() -> None:
    keys = KeySpace("ns", 16)
    rng = random.Random(0)
    counts = [0] * 16
    for _ in range(1600):
        counts[keys.shard_of(rng.randbytes(16))] += 1  # type: ignore[arg-type]
    assert min(counts) > 50 and max(counts) < 160
