"""The byte budget: never over budget + one block, LRU order, recovery when Redis drops keys itself."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import redis

from cachestore.eviction import now_ms
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops.redisproc import FLAVORS, RedisProcess
from tests.storekit import block_hash as h
from tests.timing import wait_for_async

MODEL = "0123456789abcdef"


def held_bytes(client: redis.Redis, namespace: str) -> tuple[int, int]:
    """(bytes, blocks) actually present in Redis for the namespace, by SCAN + STRLEN."""
    keys = list(client.scan_iter(match=f"{namespace}:blk:*", count=1000))
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.strlen(k)
    sizes = pipe.execute() if keys else []
    return sum(sizes), sum(1 for s in sizes if s)


async def test_random_workload_never_exceeds_budget_plus_one_block(kv_server: RedisProcess) -> None:
    budget, max_block = 20_000, 2_000
    client = kv_server.client()
    for seed in (1, 2, 3):
        ns = f"prop{seed}"
        store = BlockStore(StoreSettings.from_url(
            kv_server.url, namespace=ns, budget_bytes=budget, max_value_bytes=max_block, index_shards=4,
            high_watermark=0.9, low_watermark=0.6,
        ))
        rng = random.Random(seed)
        written = []
        try:
            for _ in range(120):
                if rng.random() < 0.6 or not written:
                    n = rng.randint(1, 6)
                    ids = [rng.randrange(400) for _ in range(n)]
                    frames = [os.urandom(rng.randint(100, max_block)) for _ in ids]
                    await store.store_blocks(MODEL, [h(i, seed) for i in ids], frames)
                    written.extend(ids)
                else:
                    ids = rng.sample(written, min(len(written), rng.randint(1, 4)))
                    await store.fetch(MODEL, [h(i, seed) for i in ids])
                actual, _ = held_bytes(client, ns)
                assert actual <= budget + max_block
                assert (await store.usage()).bytes_held == actual  # the count matches reality
            assert store.stats().evictions > 0  # the workload did exercise eviction
        finally:
            await store.clear_namespace()
            await store.close()


async def test_concurrent_puts_of_one_store_stay_in_budget(kv_server: RedisProcess) -> None:
    store = BlockStore(StoreSettings.from_url(kv_server.url, namespace="conc", budget_bytes=10_000,
                                              max_value_bytes=1_000, index_shards=4))
    try:
        await asyncio.gather(*(store.store_blocks(MODEL, [h(i), h(i + 1000)], [os.urandom(1000)] * 2)
                               for i in range(40)))
        actual, _ = held_bytes(kv_server.client(), "conc")
        assert actual <= 10_000 and (await store.usage()).bytes_held == actual
    finally:
        await store.close()


async def test_lru_order_is_respected(kv_server: RedisProcess) -> None:
    clock = {"ms": now_ms()}  # the budget's clock, a millisecond a step: every write and touch in order
    store = BlockStore(StoreSettings.from_url(kv_server.url, namespace="lru", budget_bytes=10_000,
                                              max_value_bytes=1_000, low_watermark=0.5, index_shards=4,
                                              eviction_policy="lru"),  # per block, by the millisecond
                       clock_ms=lambda: clock["ms"])
    try:
        for i in range(9):
            clock["ms"] += 1
            await store.store_blocks(MODEL, [h(i)], [os.urandom(1000)])
        clock["ms"] += 1
        assert len((await store.fetch(MODEL, [h(0)])).value) == 1  # touch the two oldest
        assert len((await store.fetch(MODEL, [h(1)])).value) == 1
        clock["ms"] += 1
        await store.store_blocks(MODEL, [h(9)], [os.urandom(1000)])  # 10,000 > 9,500: evict to 5,000
        present = [i for i in range(10) if (await store.fetch(MODEL, [h(i)])).value]
        assert present == [0, 1, 7, 8, 9]
        assert store.stats().evictions == 5
        assert (await store.usage()).bytes_held == 5000
    finally:
        await store.close()


async def test_count_recovers_when_redis_drops_keys_itself(kv_server: RedisProcess) -> None:
    client = kv_server.client()
    store = BlockStore(StoreSettings.from_url(kv_server.url, namespace="stale", budget_bytes=10_000,
                                              max_value_bytes=1_000, index_shards=4))
    try:
        await store.store_blocks(MODEL, [h(i) for i in range(9)], [os.urandom(1000) for _ in range(9)])
        keys = [store.keys.block(MODEL, h(i))[1] for i in range(9)]
        client.delete(*keys[:3])  # as maxmemory eviction would
        for k in keys[3:5]:
            client.pexpire(k, 1)  # as a TTL would
        # EXISTS drops a key past its TTL
        await wait_for_async(lambda: not client.exists(*keys[3:5]), "both keys to expire", 5, poll_s=0.001)
        assert (await store.usage()).bytes_held == 9000  # stale until noticed
        assert (await store.fetch(MODEL, [h(0)])).value == []  # a lookup cleans what it misses
        assert (await store.usage()).bytes_held == 8000
        result = await store.reconcile()
        assert result.stale_blocks == 4
        usage = await store.usage()
        assert (usage.bytes_held, usage.blocks) == (4000, 4)
        # writing past the watermark now evicts live blocks only as far as needed
        await store.store_blocks(MODEL, [h(i) for i in range(10, 16)], [os.urandom(1000) for _ in range(6)])
        assert held_bytes(client, "stale")[0] == (await store.usage()).bytes_held <= 10_000
    finally:
        await store.close()


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_redis_maxmemory_eviction_then_reconcile(flavor: str) -> None:
    server = RedisProcess(extra_args=("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru"),
                          flavor=flavor).start()
    client = server.client()
    store = BlockStore(StoreSettings.from_url(server.url, namespace="mm", budget_bytes=1 << 30, index_shards=4))
    try:
        for i in range(0, 80, 4):  # 8 MB through a 3 MB Redis
            await store.store_blocks(MODEL, [h(i + j) for j in range(4)], [os.urandom(100_000) for _ in range(4)])
        actual, blocks = held_bytes(client, "mm")
        assert 0 < actual < 3_000_000 and blocks < 80  # Redis dropped blocks (and perhaps index keys)
        client.config_set("maxmemory", "0")  # pressure over: Redis no longer evicts mid-count
        await store.reconcile()
        usage = await store.usage()
        assert (usage.bytes_held, usage.blocks) == held_bytes(client, "mm")
        assert all(client.pttl(k) > 0 for k in client.scan_iter(match="mm:*"))  # every key keeps a TTL
    finally:
        await store.close()
        server.cleanup()
