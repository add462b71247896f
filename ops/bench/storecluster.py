"""`kvstash bench store --cluster N`: a whole context read from an N-primary Cluster, kvstash against raw redis-py.

The same random bytes are written as blocks, spread over the nodes by their budget shards' hash tags, and read on
one worker thread, rep by rep, the order alternating. Rows:

    get_cluster    BlockStore.fetch_blocking without buffers: redis-py's cluster pipeline, a node after another
                                                vs a raw redis-py cluster pipeline of the same GETs
    get_landing    BlockStore.fetch_blocking into one buffer: every node's share at once, landing in place
                                                vs raw redis-py reading every node at once (a thread and a
                                                pipeline of GETs per node: `raw_mb_s`)
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
import redis.cluster

from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops.bench.store import MODEL, fresh_hashes, split, summarize, timed_blocking

TARGET_RATIO = 0.80  # kvstash's landing read against raw redis-py reading every node at once (issue 35)


def bench_cluster(url: str, payload: bytes, block_bytes: int, reps: int) -> list[dict[str, Any]]:
    frames = split(payload, block_bytes)
    settings = StoreSettings.from_url(url, cluster=True, namespace="bench-c", index_shards=64, op_timeout_s=30.0,
                                      write_timeout_s=60.0, max_value_bytes=max(block_bytes, 8 << 20),
                                      budget_bytes=len(payload) * 4, block_ttl_s=3600)
    store = BlockStore(settings)
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    raw = redis.cluster.RedisCluster(host=host, port=int(port))
    raw_keys = [f"bench-raw:{i}" for i in range(len(frames))]
    by_node: dict[str, tuple[Any, list[str]]] = {}
    for key in raw_keys:
        node = raw.get_node_from_key(key)
        by_node.setdefault(node.name, (raw.get_redis_connection(node), []))[1].append(key)
    pool = ThreadPoolExecutor(len(by_node))
    loop = asyncio.new_event_loop()  # the store's asyncio client lives on one loop: the write and the clean-up

    def raw_pipeline() -> list[Any]:
        pipe = raw.pipeline(transaction=False)
        for key in raw_keys:
            pipe.get(key)
        return list(pipe.execute())

    def one_node(node: redis.Redis, keys: list[str]) -> list[Any]:
        pipe = node.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return list(pipe.execute())

    def raw_every_node() -> list[Any]:
        return [v for f in [pool.submit(one_node, n, k) for n, k in by_node.values()] for v in f.result()]

    try:
        for key, frame in zip(raw_keys, frames, strict=True):
            raw.set(key, frame, px=3600_000)
        hashes = fresh_hashes(len(frames))
        assert loop.run_until_complete(store.store_blocks(MODEL, hashes, frames)).value == len(frames)
        landing = bytearray(len(payload))
        offsets = [sum(len(f) for f in frames[:i]) for i in range(len(frames))]
        slots = [memoryview(landing)[at:at + len(f)] for at, f in zip(offsets, frames, strict=True)]

        def pipelined() -> list[Any]:
            return store.fetch_blocking(MODEL, hashes).value

        def landed() -> list[Any]:
            return store.fetch_blocking(MODEL, hashes, slots).value

        got = landed()
        assert all(g is s for g, s in zip(got, slots, strict=True)) and bytes(landing) == payload
        assert len(pipelined()) == len(frames) and len(raw_every_node()) == len(raw_pipeline()) == len(frames)
        times: dict[str, list[float]] = {k: [] for k in ("get_cluster", "raw_pipeline", "get_landing", "raw_every")}
        for rep in range(reps):
            for pair in ((("get_cluster", pipelined), ("raw_pipeline", raw_pipeline)),
                         (("get_landing", landed), ("raw_every", raw_every_node))):
                for name, fn in pair[::1 if rep % 2 else -1]:
                    times[name].append(timed_blocking(fn))
        assert store.stats().errors == 0, store.stats()
        n = len(payload)
        return [summarize(block_bytes, "get_cluster", n, times["get_cluster"], times["raw_pipeline"]),
                summarize(block_bytes, "get_landing", n, times["get_landing"], times["raw_every"])]
    finally:
        pool.shutdown()
        for key in raw_keys:  # one slot per DEL on a cluster
            raw.delete(key)
        loop.run_until_complete(_close(store))
        loop.close()
        raw.close()


async def _close(store: BlockStore) -> None:
    await store.clear_namespace()
    await store.close()


def print_rows(rows: list[dict[str, Any]], primaries: int) -> None:
    head = f"{'block':>8} {'op':<12} {'kvstash MB/s':>12} {'raw MB/s':>9} {'paired':>6} {'p50 ms':>8} {'raw p50':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['block_bytes'] // 1024:>6}Ki {r['op']:<12} {r['kvstash_mb_s']:>12.1f} {r['raw_mb_s']:>9.1f} "
              f"{r['paired_ratio']:>6.2f} {r['p50_ms']:>8.1f} {r['raw_p50_ms']:>8.1f}")
    landings = [r for r in rows if r["op"] == "get_landing"]
    if landings:
        worst = min(r["paired_ratio"] for r in landings)
        print(f"\nfetch into one buffer from {primaries} primaries at once: >= {worst:.3f} of raw redis-py reading "
              f"every node at once (target >= {TARGET_RATIO:.2f}) {'met' if worst >= TARGET_RATIO else 'MISSED'}")
