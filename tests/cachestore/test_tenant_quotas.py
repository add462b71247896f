"""Per-tenant byte quotas in the store: a tenant over its quota evicts its own least-recently-used entries, never
another's; the tenant accounting stays exact through eviction, Redis dropping keys itself, and reconcile."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest
import redis

from cachestore import budget
from cachestore.eviction import now_ms
from cachestore.hashing import BlockHash
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops.redisproc import RedisCluster, RedisProcess
from tests.storekit import block_hash as h
from tests.timing import wait_for_async

MODEL = "0123456789abcdef"


def present(client: redis.Redis | redis.RedisCluster, store: BlockStore, hashes: Sequence[BlockHash]) -> list[bool]:
    return [bool(client.exists(store.keys.block(MODEL, x)[1])) for x in hashes]


def quota_store(url: str, **options: object) -> BlockStore:
    settings = {"namespace": "quota", "budget_bytes": 100_000, "max_value_bytes": 2_000, "index_shards": 4,
                "tenant_quota_bytes": 20_000, "tenant_quotas": (("big", 50_000),), **options}
    return BlockStore(StoreSettings.from_url(url, **settings))


async def test_a_tenant_over_its_quota_evicts_only_its_own_oldest(redis_server: RedisProcess) -> None:
    store = quota_store(redis_server.url)
    client = redis_server.client()
    try:
        quiet = [h(i, 1) for i in range(10)]  # 10 KB: half its quota
        assert (await store.store_blocks(MODEL, quiet, [os.urandom(1000)] * 10, "quiet")).value == 10
        noisy = [h(i, 2) for i in range(200)]  # 200 KB, ten times its own quota, twice the namespace's budget
        for start in range(0, 200, 5):
            await store.store_blocks(MODEL, noisy[start:start + 5], [os.urandom(1000) for _ in range(5)], "noisy")
            assert (await store.fetch(MODEL, quiet[:3])).value != [] or start == 0  # quiet's turns keep reading
            usage = await store.usage()
            assert usage.by_tenant["noisy"] <= 20_000  # under its quota after every write
            assert usage.bytes_held <= 100_000
        assert all(present(client, store, quiet))  # not one of the quiet tenant's blocks was evicted
        kept = present(client, store, noisy)
        assert not any(kept[:150]) and all(kept[-10:])  # the noisy tenant lost its oldest, kept its newest
        usage = await store.usage()
        assert usage.by_tenant == {"noisy": sum(kept) * 1000, "quiet": 10_000}
        assert usage.bytes_held == sum(usage.by_tenant.values())
        assert store.stats().tenant_evictions == store.stats().evictions > 0
        big = [h(i, 3) for i in range(45)]  # an override: 50 KB for this one
        assert (await store.store_blocks(MODEL, big, [os.urandom(1000)] * 45, "big")).value == 45
        assert (await store.usage()).by_tenant["big"] == 45_000
    finally:
        await store.clear_namespace()
        await store.close()


async def test_the_tenant_lru_follows_reads_and_tails_count(redis_server: RedisProcess) -> None:
    """A tenant's entry it read recently survives its own eviction; tails and reply ids are the tenant's too."""
    store = quota_store(redis_server.url, tenant_quota_bytes=10_000)
    client = redis_server.client()
    try:
        first = [h(i, 4) for i in range(8)]
        assert (await store.store_blocks(MODEL, first, [os.urandom(1000)] * 8, "t")).value == 8
        # the LRU's clock is in ms: a read in the same ms as the write would tie with it
        written_ms = now_ms()
        await wait_for_async(lambda: now_ms() > written_ms, "the LRU's clock past the write's millisecond", 1)
        assert (await store.fetch(MODEL, first[:2])).value != []  # now its most recently used
        tail = store.keys.tail(MODEL, h(99, 4))
        assert await store.put_entries([tail], [os.urandom(1500)], "t") == 1
        assert (await store.usage()).by_tenant["t"] == 9_500
        more = [h(i, 5) for i in range(3)]
        await store.store_blocks(MODEL, more, [os.urandom(1000)] * 3, "t")
        kept = present(client, store, first)
        assert kept[:2] == [True, True] and not all(kept[2:])  # the read ones survived, older unread ones went
        assert (await store.usage()).by_tenant["t"] <= 10_000
    finally:
        await store.clear_namespace()
        await store.close()


async def test_untenanted_writes_keep_the_namespace_budget_only(redis_server: RedisProcess) -> None:
    store = quota_store(redis_server.url, budget_bytes=20_000, tenant_quota_bytes=0, tenant_quotas=())
    try:
        for start in range(0, 30, 10):
            assert (await store.store_blocks(MODEL, [h(i, 6) for i in range(start, start + 10)],
                                          [os.urandom(1000)] * 10)).value == 10
        usage = await store.usage()
        assert usage.bytes_held <= 20_000 and usage.by_tenant == {}
    finally:
        await store.clear_namespace()
        await store.close()


async def test_tenant_accounting_survives_redis_dropping_keys_and_reconcile(redis_server: RedisProcess) -> None:
    store = quota_store(redis_server.url)
    client = redis_server.client()
    try:
        mine = [h(i, 7) for i in range(10)]
        assert (await store.store_blocks(MODEL, mine, [os.urandom(1000)] * 10, "a")).value == 10
        theirs = [h(i, 8) for i in range(6)]
        assert (await store.store_blocks(MODEL, theirs, [os.urandom(1000)] * 6, "b")).value == 6
        client.delete(store.keys.block(MODEL, mine[0])[1])  # Redis evicting blocks itself
        assert (await store.fetch(MODEL, mine)).value == []  # TOUCH notices the missing block
        assert (await store.usage()).by_tenant == {"a": 9_000, "b": 6_000}
        client.delete(store.keys.block(MODEL, theirs[0])[1])
        for shard in store.keys.all_shards():
            client.delete(shard.tenant_bytes)  # and an index key
        await store.reconcile()
        assert (await store.usage()).by_tenant == {"a": 9_000, "b": 5_000}
        assert (await store.usage()).bytes_held == 14_000
    finally:
        await store.clear_namespace()
        await store.close()


@pytest.mark.cluster
async def test_quotas_on_a_cluster(redis_cluster: RedisCluster, figures: dict[str, object]) -> None:
    store = quota_store(redis_cluster.url, cluster=True, namespace="cquota", index_shards=16)
    client = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        quiet = [h(i, 9) for i in range(10)]
        assert (await store.store_blocks(MODEL, quiet, [os.urandom(1000)] * 10, "quiet")).value == 10
        noisy = [h(i, 10) for i in range(120)]
        for start in range(0, 120, 6):
            await store.store_blocks(MODEL, noisy[start:start + 6], [os.urandom(1000)] * 6, "noisy")
            assert len((await store.fetch(MODEL, quiet)).value) == 10
        usage = await store.usage()
        assert usage.by_tenant["quiet"] == 10_000 and usage.by_tenant["noisy"] <= 20_000
        assert all(present(client, store, quiet))
        assert store.stats().tenant_evictions > 0 and store.stats().errors == 0
        assert await budget.tenant_totals(store.client, store.keys) == usage.by_tenant
        figures.update(primaries=len(redis_cluster.nodes), index_shards=16, quiet_blocks=10, noisy_blocks=120,
                       quiet_lookups_whole=20, quiet_held=usage.by_tenant["quiet"], noisy_held=usage.by_tenant["noisy"],
                       noisy_quota=20_000, tenant_evictions=store.stats().tenant_evictions, store_errors=0)
    finally:
        await store.clear_namespace()
        await store.close()
        client.close()
