"""BlockStore on a real 3-primary Redis Cluster: blocks spread over nodes, one pipelined round trip."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

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
        assert (await store.store_blocks(FP.short(), hashes, frames)).value == 40
        per_node = [sum(1 for _ in n.scan_iter(match="clu:blk:*")) for n in nodes]
        assert sum(per_node) == 40 and sum(1 for c in per_node if c) >= 2  # spread over nodes

        before, trips = [getex_calls(n) for n in nodes], store.stats().round_trips
        assert (await store.fetch(FP.short(), hashes)).value == frames
        assert store.stats().round_trips == trips + 1  # one pipeline, split by node
        assert [getex_calls(n) - b for n, b in zip(nodes, before, strict=True)] == per_node
        # a lookup's reader thread: the same round trip on the blocking cluster client (its LRU touch included)
        before, trips = [getex_calls(n) for n in nodes], store.stats().round_trips
        assert (await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes)).value == frames
        assert store.stats().round_trips == trips + 1 and store.stats().errors == 0
        assert [getex_calls(n) - b for n, b in zip(nodes, before, strict=True)] == per_node

        # the budget runs its Lua scripts across the cluster's slots
        more = chain_hashes(list(range(5000, 5000 + 16 * 40)), 16, root_hash(FP, b"t"))
        await store.store_blocks(FP.short(), more, [os.urandom(1000) for _ in more])
        held = sum(sum(n.strlen(k) for k in n.scan_iter(match="clu:blk:*")) for n in nodes)
        usage = await store.usage()
        assert usage.bytes_held == held <= 60_000 and store.stats().evictions > 0
        assert (await store.reconcile()).stale_blocks == 0

        rec = (await store.write_session(SessionRecord("acme", "c1", FP.short(), [1, 2, 3]), None)).value
        assert rec is not None and (await store.read_session("acme", "c1")).value == rec
        assert await store.list_sessions("acme") == [("acme", "c1")]
    finally:
        await store.clear_namespace()
        await store.close()


def _frames_of(result: object) -> list[bytes]:
    return [bytes(v) for v in result.value]  # type: ignore[attr-defined]


async def test_a_cluster_hit_lands_in_place_reading_every_node_at_once(kv_cluster: RedisCluster) -> None:
    """A lookup's reader on a Cluster: each node's share of the keys in one round trip on a connection of its own,
    all at once, every frame received into its buffer, as on a single Redis."""
    store = BlockStore(StoreSettings.from_url(kv_cluster.url, cluster=True, namespace="land-clu", index_shards=16))
    nodes = [n.client() for n in kv_cluster.nodes]
    try:
        hashes: list[BlockHash] = chain_hashes(list(range(16 * 24)), 16, root_hash(FP, b"t"))
        frames = [os.urandom(3000) for _ in hashes]
        assert (await store.store_blocks(FP.short(), hashes, frames)).value == 24
        per_node = [sum(1 for _ in n.scan_iter(match="land-clu:blk:*")) for n in nodes]
        assert sum(1 for c in per_node if c) == 3
        into = [memoryview(bytearray(3000)) for _ in hashes]
        before, trips = [getex_calls(n) for n in nodes], store.stats().round_trips
        result = await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes, into)
        assert _frames_of(result) == frames and all(v is t for v, t in zip(result.value, into, strict=True))
        assert [getex_calls(n) - b for n, b in zip(nodes, before, strict=True)] == per_node
        assert store.stats().round_trips == trips + 1 and store.stats().errors == 0
        # a shorter buffer than the value: it comes back as bytes, and the next keys still land
        into[3] = memoryview(bytearray(10))
        result = await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes, into)
        assert _frames_of(result) == frames and isinstance(result.value[3], bytes) and result.value[4] is into[4]
        absent = chain_hashes(list(range(9000, 9000 + 16 * 3)), 16, root_hash(FP, b"t"))
        partial = await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes[:5] + absent, into[:8])
        assert _frames_of(partial) == frames[:5]
    finally:
        await store.clear_namespace()
        await store.close()


async def test_signed_frames_land_per_node_and_a_forged_one_ends_the_hit(kv_cluster: RedisCluster) -> None:
    """Under a frame key each node's values land with their trailer apart and are verified there; a value signed
    under another key ends the hit at that block, as on a single Redis."""
    key = "k" * 32
    settings = StoreSettings.from_url(kv_cluster.url, cluster=True, namespace="sig-clu", index_shards=16,
                                      frame_key=key)
    store = BlockStore(settings)
    forger = BlockStore(replace(settings, frame_key="f" * 32))
    try:
        hashes: list[BlockHash] = chain_hashes(list(range(16 * 9)), 16, root_hash(FP, b"s"))
        frames = [os.urandom(2500) for _ in hashes]
        assert (await store.store_blocks(FP.short(), hashes, frames)).value == 9
        into = [memoryview(bytearray(2500)) for _ in hashes]
        result = await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes, into)
        assert _frames_of(result) == frames and all(v is t for v, t in zip(result.value, into, strict=True))
        await store.client.delete(store.keys.block(FP.short(), hashes[6])[1])
        assert (await forger.store_blocks(FP.short(), hashes[6:7], [frames[6]])).value == 1
        result = await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes, into)
        assert _frames_of(result) == frames[:6] and store.stats().rejected_mac == 1
    finally:
        await store.clear_namespace()
        await store.close()
        await forger.close()


async def test_a_slot_moving_mid_read_is_read_again_through_the_cluster_client(fresh_cluster: RedisCluster) -> None:
    """A slot migrated as `redis-cli --cluster reshard` does it: while some of its keys have moved (ASK) and once
    all have (MOVED, the reader's slot map stale), every frame still comes back right; then the reads go straight
    to the new owner again."""
    cluster = fresh_cluster
    store = BlockStore(StoreSettings.from_url(cluster.url, cluster=True, namespace="mig-clu", index_shards=4))
    admin = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        hashes: list[BlockHash] = chain_hashes(list(range(16 * 24)), 16, root_hash(FP, b"m"))
        frames = [os.urandom(2000) for _ in hashes]
        assert (await store.store_blocks(FP.short(), hashes, frames)).value == 24
        into = [memoryview(bytearray(2000)) for _ in hashes]
        assert _frames_of(await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes, into)) == frames
        _, key = store.keys.block(FP.short(), hashes[0])
        slot = admin.keyslot(key)
        dest = next(n for n in cluster.nodes if n is not cluster.owner(slot))
        source = cluster.start_moving(slot, dest)
        blocks = [k for k in source.client().scan_iter(match="mig-clu:blk:*") if admin.keyslot(k) == slot]
        assert len(blocks) >= 3  # the shard's blocks (and its index keys) share the slot
        cluster.migrate(source, dest, blocks[: len(blocks) // 3])  # the source answers ASK for these
        result = await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes, into)
        assert _frames_of(result) == frames and store.stats().redirects >= len(blocks) // 3
        cluster.finish_moving(slot, source, dest)
        assert cluster.owner(slot) is dest
        redirects = store.stats().redirects
        result = await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes, into)
        assert _frames_of(result) == frames and store.stats().redirects > redirects  # MOVED: the map was stale
        redirects = store.stats().redirects
        result = await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes, into)
        assert _frames_of(result) == frames and store.stats().redirects == redirects  # the map learnt the move
        assert store.stats().errors == 0
    finally:
        admin.close()
        await store.clear_namespace()
        await store.close()


async def test_chunks_on_a_cluster_are_read_one_ahead_and_answer_as_fetch_blocking(kv_cluster: RedisCluster) -> None:
    """fetch_chunks_blocking on a Cluster yields what fetch_blocking gives chunk by chunk, frames in their slots, and
    ends at a hole; closed after its first chunk, the chunk already being read is done before it returns."""
    store = BlockStore(StoreSettings.from_url(kv_cluster.url, cluster=True, namespace="ahead-clu", index_shards=16))
    try:
        hashes: list[BlockHash] = chain_hashes(list(range(16 * 12)), 16, root_hash(FP, b"a"))
        frames = [os.urandom(3000) for _ in hashes]
        assert (await store.store_blocks(FP.short(), hashes, frames)).value == 12
        buf = bytearray(12 * 4096)
        slots = [memoryview(buf)[i * 4096:i * 4096 + 3000] for i in range(12)]
        cuts = [(0, 5), (5, 10), (10, 12)]
        chunks, into = [hashes[a:b] for a, b in cuts], [slots[a:b] for a, b in cuts]

        def fetch_all() -> list[list[object]]:
            return [r.value for r in store.fetch_chunks_blocking(FP.short(), chunks, into)]

        got = await asyncio.to_thread(fetch_all)
        assert [[bytes(f) for f in c] for c in got] == [frames[a:b] for a, b in cuts]
        assert all(f is s for c, sl in zip(got, into, strict=True) for f, s in zip(c, sl, strict=True))
        assert (store.stats().hits, store.stats().errors) == (3, 0)

        await store.client.delete(store.keys.block(FP.short(), hashes[7])[1])
        hole = await asyncio.to_thread(fetch_all)  # the second chunk ends at block 7: no third chunk
        assert [[bytes(f) for f in c] for c in hole] == [frames[0:5], frames[5:7]]

        def first_only() -> tuple[int, list[bytes]]:
            buf[:] = bytes(len(buf))
            results = store.fetch_chunks_blocking(FP.short(), chunks, into)
            first = next(results)  # the second chunk is being read meanwhile
            results.close()  # waits for it: its frames have landed when close returns
            return len(first.value), [bytes(v) for v in slots[5:7]]

        assert await asyncio.to_thread(first_only) == (5, frames[5:7])
    finally:
        await store.clear_namespace()
        await store.close()
