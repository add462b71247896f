"""BlockStore on a real 3-primary Redis Cluster: blocks spread over nodes, one pipelined round trip."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis

from cachestore.hashing import BlockHash, ModelFingerprint, chain_hashes, root_hash
from cachestore.sessions import SessionRecord
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops.redisproc import RedisCluster

pytestmark = pytest.mark.cluster

FP = ModelFingerprint("smollm2-135m", "tok1", "float32", 30, 3, 64, 16, "int8+lz4/g64")


def getex_calls(node: redis.Redis) -> int:
    stats = node.info("commandstats")
    return int(stats.get("cmdstat_getex", {}).get("calls", 0))


async def test_cluster_round_trip_budget_and_sessions(kv_cluster: RedisCluster) -> None:
    store = BlockStore(StoreSettings.from_url(kv_cluster.url, cluster=True, namespace="clu",
                                              budget_bytes=60_000, max_value_bytes=2_000))
    nodes = [n.client() for n in kv_cluster.nodes]
    try:
        hashes: list[BlockHash] = chain_hashes(list(range(16 * 40)), 16, root_hash(FP, b"t"))
        frames = [os.urandom(1000) for _ in hashes]
        assert await store.put_blocks(FP.short(), hashes, frames) == 40
        per_node = [sum(1 for _ in n.scan_iter(match="clu:blk:*")) for n in nodes]
        assert sum(per_node) == 40 and sum(1 for c in per_node if c) >= 2  # spread over nodes

        before, trips = [getex_calls(n) for n in nodes], store.stats().round_trips
        assert await store.lookup(FP.short(), hashes) == frames
        assert store.stats().round_trips == trips + 1  # one pipeline, split by node
        assert [getex_calls(n) - b for n, b in zip(nodes, before, strict=True)] == per_node
        # a lookup's reader thread: the same round trip on the blocking cluster client (its LRU touch included)
        before, trips = [getex_calls(n) for n in nodes], store.stats().round_trips
        assert (await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes)).value == frames
        assert store.stats().round_trips == trips + 1 and store.stats().errors == 0
        assert [getex_calls(n) - b for n, b in zip(nodes, before, strict=True)] == per_node

        # the budget runs its Lua scripts across the cluster's slots
        more = chain_hashes(list(range(5000, 5000 + 16 * 40)), 16, root_hash(FP, b"t"))
        await store.put_blocks(FP.short(), more, [os.urandom(1000) for _ in more])
        held = sum(sum(n.strlen(k) for k in n.scan_iter(match="clu:blk:*")) for n in nodes)
        usage = await store.usage()
        assert usage.bytes_held == held <= 60_000 and store.stats().evictions > 0
        assert (await store.reconcile()).stale_blocks == 0

        rec = await store.put_session(SessionRecord("acme", "c1", FP.short(), [1, 2, 3]), None)
        assert rec is not None and await store.get_session("acme", "c1") == rec
        assert await store.list_sessions("acme") == [("acme", "c1")]
    finally:
        await store.clear_namespace()
        await store.close()
