"""BlockStore against a real redis-server: prefix lookup, limits, TTL, settings, failure semantics."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from cachestore.errors import ConfigError, ValueTooLarge
from cachestore.hashing import BlockHash, ModelFingerprint, chain_hashes, root_hash
from cachestore.keys import InvalidName
from cachestore.outcome import Outcome
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops.redisproc import RedisProcess
from tests.storekit import namespace_for, scratch_store
from tests.timing import wait_for_async

FP = ModelFingerprint("smollm2-135m", "tok1", "float32", 30, 3, 64, 16, "int8+lz4/g64")
FP_OTHER = ModelFingerprint("smollm2-135m", "tok1", "float32", 30, 3, 64, 16, "int4+lz4/g64")


def hashes_for(tokens: list[int], fp: ModelFingerprint = FP, salt: bytes = b"tenant-a") -> list[BlockHash]:
    return chain_hashes(tokens, fp.block_tokens, root_hash(fp, salt))


def frames_for(n: int, size: int = 1000) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


@pytest.fixture
async def store(shared_kv_server: RedisProcess, request: pytest.FixtureRequest) -> AsyncIterator[BlockStore]:
    settings = StoreSettings.from_url(shared_kv_server.url, namespace=namespace_for(request, "t-"), index_shards=4)
    async with scratch_store(settings) as s:
        yield s


async def test_full_partial_and_miss(store: BlockStore) -> None:
    tokens = list(range(16 * 8))
    hashes = hashes_for(tokens)
    frames = frames_for(8)
    assert (await store.store_blocks(FP.short(), hashes[:5], frames[:5])).value == 5
    assert (await store.fetch(FP.short(), hashes[:5])).value == frames[:5]  # full hit
    assert (await store.fetch(FP.short(), hashes)).value == frames[:5]  # partial hit: prefix only
    other = hashes_for(list(range(1000, 1000 + 64)))
    assert (await store.fetch(FP.short(), other)).value == []  # miss
    st = store.stats()
    assert (st.hits, st.partial_hits, st.misses) == (1, 1, 1)
    assert st.bytes_read == 10 * 1000 and st.blocks_written == 5


async def test_hole_in_chain_truncates(store: BlockStore) -> None:
    hashes = hashes_for(list(range(16 * 6)))
    frames = frames_for(6)
    keep = [0, 1, 3, 4, 5]  # block 2 missing
    await store.store_blocks(FP.short(), [hashes[i] for i in keep], [frames[i] for i in keep])
    assert (await store.fetch(FP.short(), hashes)).value == frames[:2]


async def test_other_tenant_and_other_model_never_hit(store: BlockStore) -> None:
    tokens = list(range(16 * 4))
    await store.store_blocks(FP.short(), hashes_for(tokens), frames_for(4))
    assert len((await store.fetch(FP.short(), hashes_for(tokens))).value) == 4
    assert (await store.fetch(FP.short(), hashes_for(tokens, salt=b"tenant-b"))).value == []
    assert (await store.fetch(FP_OTHER.short(), hashes_for(tokens, fp=FP_OTHER))).value == []
    # same hashes under another model id: the key carries the model, still no hit
    assert (await store.fetch(FP_OTHER.short(), hashes_for(tokens))).value == []


async def test_put_is_idempotent_and_refuses_big_values(store: BlockStore) -> None:
    hashes = hashes_for(list(range(32)))
    frames = frames_for(2)
    assert (await store.store_blocks(FP.short(), hashes, frames)).value == 2
    assert (await store.store_blocks(FP.short(), hashes, frames)).value == 0  # already present
    assert (await store.usage()).bytes_held == 2000
    big = b"x" * (store.settings.max_value_bytes + 1)
    with pytest.raises(ValueTooLarge):
        await store.store_blocks(FP.short(), hashes_for(list(range(500, 532))), [b"ok", big])
    assert (await store.fetch(FP.short(), hashes_for(list(range(500, 532))))).value == []  # nothing written
    with pytest.raises(InvalidName):
        await store.fetch("bad model:id", hashes)


async def test_key_names_are_readable(store: BlockStore, shared_kv_server: RedisProcess) -> None:
    hashes = hashes_for(list(range(16)))
    await store.store_blocks(FP.short(), hashes, frames_for(1))
    ns = store.settings.namespace
    keys = sorted(k.decode() for k in shared_kv_server.client().scan_iter(match=f"{ns}:*"))
    blocks = [k for k in keys if ":blk:" in k]
    assert blocks == [store.keys.block(FP.short(), hashes[0])[1]]
    assert blocks[0].startswith(f"{ns}:blk:{FP.short()}:{hashes[0].hex()}:{{{ns}:s")
    assert all(k.startswith(ns + ":") for k in keys)
    ttl = shared_kv_server.client().pttl(blocks[0])
    assert 0 < ttl <= store.settings.block_ttl_s * 1000


async def test_local_tier_serves_hot_blocks(shared_kv_server: RedisProcess) -> None:
    settings = StoreSettings.from_url(shared_kv_server.url, namespace="t-local", local_tier_bytes=10_000)
    writer, reader = BlockStore(settings), BlockStore(settings)
    try:
        hashes, frames = hashes_for(list(range(64))), frames_for(4)
        await writer.store_blocks(FP.short(), hashes, frames)
        assert (await reader.fetch(FP.short(), hashes)).value == frames  # from Redis, fills the tier
        assert (await reader.fetch(FP.short(), hashes)).value == frames  # from the tier
        assert reader.stats().local_hits == 4
        await writer.clear_namespace()  # Redis loses everything: the tier still answers
        assert (await reader.fetch(FP.short(), hashes)).value == frames
    finally:
        await writer.close()
        await reader.close()


async def test_ttl_expires_and_hits_slide_it(kv_server: RedisProcess) -> None:
    store = BlockStore(StoreSettings.from_url(kv_server.url, namespace="ttl", block_ttl_s=1, index_shards=2))
    try:
        kept, dropped = hashes_for(list(range(16))), hashes_for(list(range(100, 116)))
        await store.store_blocks(FP.short(), kept + dropped, frames_for(2))
        for _ in range(3):  # 1.8 s in all: only the block read every 0.6 s survives
            await asyncio.sleep(0.6)  # the wait is the test: a TTL of 1 s expires in real time
            assert len((await store.fetch(FP.short(), kept)).value) == 1
        assert (await store.fetch(FP.short(), dropped)).value == []
        assert (await store.fetch(FP.short(), kept)).value != []
        await store.reconcile()
        assert (await store.usage()).bytes_held == 1000
    finally:
        await store.close()


def test_settings_from_url_validates_and_masks() -> None:
    s = StoreSettings.from_url("redis://alice:s3cret@10.0.0.1:6380/2?namespace=prod&budget_bytes=4096&max_value_bytes=1024")
    assert s.namespace == "prod" and s.budget_bytes == 4096
    assert "s3cret" not in repr(s) and "***" in repr(s) and "s3cret" not in str(s)
    assert "namespace" not in s.url
    assert StoreSettings.from_url("redis+cluster://h:7000").is_cluster
    assert StoreSettings.from_url("redis+sentinel://h:26379,h2:26379/mymaster").is_sentinel
    assert StoreSettings.from_url("unix:///tmp/redis.sock?db=1").scheme == "unix"
    for bad_url, opts in [
        ("http://x", {}),
        ("redis://x", {"budget_bytes": 0}),
        ("redis://x", {"low_watermark": 0.99}),
        ("redis://x", {"namespace": "a:b"}),
        ("redis://x?budget_bytes=lots", {}),
        ("redis://x", {"no_such_option": 1}),
        ("redis://x", {"max_value_bytes": 10, "budget_bytes": 5}),
    ]:
        with pytest.raises(ConfigError):
            StoreSettings.from_url(bad_url, **opts)


async def test_redis_killed_mid_workload_then_back(kv_server: RedisProcess) -> None:
    settings = StoreSettings.from_url(
        kv_server.url, namespace="chaos", op_timeout_s=0.3, connect_timeout_s=0.2,
        write_timeout_s=0.5, breaker_failures=3, breaker_reset_s=0.3,
    )
    store = BlockStore(settings)
    try:
        hashes, frames = hashes_for(list(range(64))), frames_for(4)
        assert (await store.store_blocks(FP.short(), hashes, frames)).value == 4
        assert (await store.fetch(FP.short(), hashes)).value == frames
        kv_server.kill()
        for _ in range(6):  # nothing raises; the breaker opens
            assert (await store.fetch(FP.short(), hashes)).value == []
            assert (await store.store_blocks(FP.short(), hashes, frames)).value == 0
            assert (await store.read_session("acme", "s1")).value is None
        assert store.breaker_state == "open"
        st = store.stats()
        assert st.errors >= 3 and st.skipped_open > 0 and st.dropped_writes >= 6 and st.breaker_opened >= 1
        kv_server.start()  # same port, empty
        async def probed_closed() -> bool:
            await store.ping()  # the half-open probe, once the breaker's reset has passed
            return store.breaker_state == "closed"

        await wait_for_async(probed_closed, "the breaker to close", 5, poll_s=0.1)
        assert (await store.store_blocks(FP.short(), hashes, frames)).value == 4
        assert (await store.fetch(FP.short(), hashes)).value == frames  # hits resume
    finally:
        await store.close()


async def test_blocking_fetch_from_reader_threads_is_fetch(store: BlockStore) -> None:
    """fetch_blocking (a lookup's reader thread) answers as fetch does, from many threads at once beside the event
    loop, into the same counters, local tier and TTL slide."""
    hashes, frames = hashes_for(list(range(16 * 6))), frames_for(6, 20_000)
    assert (await store.store_blocks(FP.short(), hashes, frames)).value == 6
    other = hashes_for(list(range(5000, 5000 + 16 * 2)))
    before = store.stats()

    async def on_loop() -> list[bytes]:
        return (await store.fetch(FP.short(), hashes)).value

    results = await asyncio.gather(
        *(asyncio.to_thread(store.fetch_blocking, FP.short(), hashes) for _ in range(8)),
        *(on_loop() for _ in range(4)),
        asyncio.to_thread(store.fetch_blocking, FP.short(), hashes[:3] + other),  # a partial hit
        asyncio.to_thread(store.fetch_blocking, FP.short(), other),  # a miss: Redis answered
    )
    assert [r.value for r in results[:8]] == [frames] * 8 and list(results[8:12]) == [frames] * 4
    assert results[12].value == frames[:3] and results[13].outcome is Outcome.ABSENT
    after = store.stats()
    assert (after.lookups - before.lookups, after.hits - before.hits) == (14, 12)
    assert (after.partial_hits - before.partial_hits, after.misses - before.misses) == (1, 1)
    assert after.bytes_read - before.bytes_read == (12 * 6 + 3) * 20_000
    assert after.round_trips - before.round_trips == 14 and after.errors == 0


async def test_blocking_fetch_shares_the_breaker(kv_server: RedisProcess) -> None:
    """Redis gone: reader threads miss (UNAVAILABLE, counted), open the breaker the event loop obeys too, and read
    again on fresh connections once Redis is back."""
    settings = StoreSettings.from_url(kv_server.url, namespace="chaos-b", op_timeout_s=0.3,
                                      connect_timeout_s=0.2, breaker_failures=3, breaker_reset_s=0.3)
    store = BlockStore(settings)
    try:
        hashes, frames = hashes_for(list(range(64))), frames_for(4)
        assert (await store.store_blocks(FP.short(), hashes, frames)).value == 4
        assert (await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes)).value == frames
        kv_server.kill()
        for _ in range(3):
            assert (await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes)).outcome is Outcome.UNAVAILABLE
        assert store.breaker_state == "open" and store.stats().errors >= 3
        skipped = store.stats().skipped_open
        assert (await store.fetch(FP.short(), hashes)).value == []  # the event loop's calls are not even made
        assert (await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes)).outcome is Outcome.UNAVAILABLE
        assert store.stats().skipped_open == skipped + 2
        kv_server.start()  # same port, empty
        async def probed_closed() -> bool:
            await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes)  # the half-open probe, from a thread
            return store.breaker_state == "closed"

        await wait_for_async(probed_closed, "the breaker to close", 5, poll_s=0.1)
        assert (await store.store_blocks(FP.short(), hashes, frames)).value == 4
        assert (await asyncio.to_thread(store.fetch_blocking, FP.short(), hashes)).value == frames
    finally:
        await store.close()


async def test_unix_socket_url() -> None:
    sock = f"/tmp/kvstash-test-{os.getpid()}.sock"
    server = RedisProcess(extra_args=("--unixsocket", sock, "--unixsocketperm", "700")).start()
    store = BlockStore(StoreSettings.from_url(f"unix://{sock}?db=0", namespace="unix"))
    try:
        hashes, frames = hashes_for(list(range(32))), frames_for(2)
        assert (await store.store_blocks(FP.short(), hashes, frames)).value == 2
        assert (await store.fetch(FP.short(), hashes)).value == frames
    finally:
        await store.close()
        server.cleanup()
