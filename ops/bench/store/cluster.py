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

import argparse
import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis

from cachestore.errors import ConfigError
from cachestore.redisclient import make_client
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops import netlink
from ops.bench.common import machine, write_json
from ops.bench.store.parts import MODEL, fresh_hashes, print_link, split, summarize, timed_blocking, timeout_s

TARGET_RATIO = 0.80  # kvstash's landing read against raw redis-py reading every node at once (issue 35)


def bench_cluster(url: str, payload: bytes, block_bytes: int, reps: int, limit_s: float = 30.0) -> list[dict[str, Any]]:
    frames = split(payload, block_bytes)
    settings = StoreSettings.from_url(url, cluster=True, namespace="bench-c", index_shards=64, op_timeout_s=limit_s,
                                      write_timeout_s=2 * limit_s, max_value_bytes=max(block_bytes, 8 << 20),
                                      budget_bytes=len(payload) * 4, block_ttl_s=3600)
    store = BlockStore(settings)
    raw = make_client(settings, asynchronous=False)  # the URL as a pod parses it (redis+cluster://, TLS, a password)
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

        def busiest(keys: list[str]) -> int:  # the bytes of the node holding most of them: its link is the bound
            per: dict[str, int] = {}
            for key, frame in zip(keys, frames, strict=True):
                name = raw.get_node_from_key(key).name
                per[name] = per.get(name, 0) + len(frame)
            return max(per.values())

        layout = {"busiest_node_bytes": busiest([store.keys.block(MODEL, h)[1] for h in hashes]),
                  "raw_busiest_node_bytes": busiest(raw_keys)}
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
        return [{**summarize(block_bytes, "get_cluster", n, times["get_cluster"], times["raw_pipeline"]), **layout},
                {**summarize(block_bytes, "get_landing", n, times["get_landing"], times["raw_every"]), **layout}]
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


def primaries(url: str) -> int:
    """How many primaries the Cluster at `url` has (a URL as a pod takes it)."""
    client = make_client(StoreSettings.from_url(url, cluster=True, op_timeout_s=5.0), asynchronous=False)
    try:
        return len(client.get_primaries())
    finally:
        client.close()


def run_cluster(args: argparse.Namespace, sizes: list[int], payload: bytes, spec: netlink.LinkSpec | None) -> int:
    """`bench store --cluster N` (a private N-primary Cluster, each primary behind its own link with --link-gbit) or
    `--redis-url redis+cluster://...` (an operator's Cluster, at least N primaries with --cluster N)."""
    from ops.redisproc import RedisCluster  # noqa: PLC0415

    if args.cluster < 0 or args.cluster > 64:
        raise ConfigError(f"--cluster takes 1 to 64 primaries, got {args.cluster}")
    if args.redis_url:
        settings = StoreSettings.from_url(args.redis_url)
        if not settings.is_cluster:
            raise ConfigError(f"--cluster {args.cluster} reads a Cluster: --redis-url must be redis+cluster://...")
        have = primaries(args.redis_url)
        if have < args.cluster:
            raise ConfigError(f"the Cluster at {settings.masked_url} has {have} primaries, fewer than --cluster "
                              f"{args.cluster} asks")
    rows: list[dict[str, Any]] = []
    with netlink.opened(spec) as link:
        cluster = None if args.redis_url else RedisCluster(primaries=args.cluster, flavor=args.server).start()
        try:
            url = args.redis_url or cluster.url  # type: ignore[union-attr]
            count = primaries(url)
            if link is not None and cluster is not None:
                link.shape(*(n.port for n in cluster.nodes))
                print(link.describe(), flush=True)
            where = (StoreSettings.from_url(url).masked_url if args.redis_url
                     else f"a private {args.cluster}-primary {args.server} Cluster")
            print(f"context: {args.tokens} tokens x {args.bytes_per_token} B = {len(payload) / 1e6:.1f} MB of random "
                  f"bytes; {args.reps} reps per cell; {where} ({count} primaries)", flush=True)
            for size in sizes:
                rows.extend(bench_cluster(url, payload, size, args.reps, timeout_s(spec, len(payload))))
        finally:
            if cluster is not None:
                cluster.cleanup()
    print_rows(rows, count)
    if spec is not None:
        print_link(rows, spec, count)
    if args.json_path:
        write_json(args.json_path, {"rows": rows, "machine": machine(), "reps": args.reps, "tokens": args.tokens,
                                    "cluster": count, "server": args.server,
                                    **({"link": link.as_json()} if link is not None else {})})
    return 0
