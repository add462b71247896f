"""`kvstash bench budget`: replay a conversation trace through the real store, byte budget and Lua scripts on a real
Redis, no model, under each eviction policy, and set its hit rate beside the offline optimum's (Belady).

Per request, its prompt's blocks are looked up as a pod does (`BlockStore.count_present`: the longest present
prefix, TTLs slid, the budget's touch), and the missing ones written (`store_blocks`, values of the model's block
size, under the budget). The budget is the working set (every distinct block of the trace) over each
`--budget-ratios` value. Rows, per workload, budget ratio and policy: hit rate (blocks served / blocks an infinite
cache serves), the optimum's on the same trace at the same budget, dead bytes (blocks whose chain is broken, as
`kvstash admin stats` counts them: the most seen at any of ten checkpoints), evictions, and the Lua time per write
(Redis' own EVAL microseconds while the write runs, INFO commandstats). Time is a virtual clock, `--interval-ms`
a request, so a run is reproducible and takes seconds, not the trace's hours.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from cachestore.errors import KvstashError
from cachestore.eviction import DEFAULT_POLICY, POLICIES
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops.bench.budget.trace import Blocks, Trace, Workload, belady_hits, cut, generate, possible_hits, read_trace
from ops.bench.common import machine, print_table, write_json

SMOLLM2_BLOCK_BYTES = 64 * 23_040  # the default 64-token block of SmolLM2-135M, fp16 (exact): 1,474,560 bytes
MODEL = "bench00000000000"
CHECKPOINTS = 10
COLUMNS = [("workload", "workload", ""), ("budget_ratio", "ratio", ".1f"), ("policy", "policy", ""),
           ("hit_rate", "hit rate", ".3f"), ("optimum_hit_rate", "optimum", ".3f"),
           ("vs_optimum", "vs opt", ".3f"), ("dead_fraction", "dead/budget", ".3f"), ("evictions", "evictions", "d"),
           ("lua_us_per_write", "Lua us/write", ".0f"), ("seconds", "s", ".1f")]


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("budget", help="eviction policies replayed on a trace vs the offline optimum")
    p.add_argument("--redis-url", help="use this Redis (default: start a private redis-server)")
    p.add_argument("--trace", metavar="FILE", help="replay this JSON-lines trace instead of generating one")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies (%(default)s)")
    p.add_argument("--budget-ratios", default="1,2", help="working set / budget values (%(default)s)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per block (%(default)s)")
    p.add_argument("--block-bytes", type=int, default=SMOLLM2_BLOCK_BYTES,
                   help="bytes of a block's value (%(default)s: SmolLM2-135M's 64-token block in fp16)")
    p.add_argument("--interval-ms", type=int, default=1000, help="virtual time between requests (%(default)s)")
    w = Workload()
    p.add_argument("--users", type=int, default=w.users, help="generated: users (%(default)s)")
    p.add_argument("--turns", type=int, default=w.turns, help="generated: mean turns per user (%(default)s)")
    p.add_argument("--system-prompts", type=int, default=w.system_prompts,
                   help="generated: shared system prompts, users spread over them (%(default)s; 0: none)")
    p.add_argument("--system-tokens", type=int, default=w.system_tokens, help="generated: their length (%(default)s)")
    p.add_argument("--turn-tokens", type=int, default=w.turn_tokens,
                   help="generated: mean tokens a turn adds (%(default)s)")
    p.add_argument("--history-tokens", type=int, default=w.history_tokens,
                   help="generated: mean history a session starts with (%(default)s)")
    p.add_argument("--max-tokens", type=int, default=w.max_tokens,
                   help="generated: context length; a longer session starts over (%(default)s)")
    p.add_argument("--skews", default="0",
                   help="generated: comma-separated Zipf exponents of the users' activity, a workload each "
                        "(%(default)s; e.g. 0,1.2)")
    p.add_argument("--arrival", choices=["interleaved", "sequential"], default=w.arrival,
                   help="generated: users' turns interleaved at random, or each user's one after another")
    p.add_argument("--think", type=float, default=w.think,
                   help="generated: mean time between a user's turns, in user starts (%(default)s)")
    p.add_argument("--seed", type=int, default=0, help="generated: seed (%(default)s)")
    p.add_argument("--json", dest="json_path", help="write the rows as JSON to this path")
    p.set_defaults(func=run)


def workloads(args: argparse.Namespace) -> list[tuple[str, Trace]]:
    if args.trace:
        return [(args.trace.rsplit("/", 1)[-1], read_trace(args.trace))]
    out = []
    for text in args.skews.split(","):
        skew = float(text)
        w = Workload(args.users, args.turns, args.system_prompts, args.system_tokens, args.turn_tokens,
                     args.history_tokens, args.max_tokens, skew, args.arrival, args.think, args.seed)
        out.append(("default" if skew == 0 else f"skew {skew:g}", generate(w)))
    return out


async def eval_usec(client: Any) -> int:
    """Microseconds Redis spent in EVAL/EVALSHA so far (INFO commandstats)."""
    stats = await client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("usec", 0)) for c in ("eval", "evalsha"))


async def replay(url: str, blocks: Blocks, policy: str, budget_bytes: int, block_bytes: int, interval_ms: int,
                 label: str) -> dict[str, Any]:
    """One replay of the trace under `policy`, in a namespace of its own (cleared after)."""
    clock = {"now": int(time.time() * 1000)}
    store = BlockStore(StoreSettings.from_url(
        url, namespace=f"bench-budget-{policy}", budget_bytes=budget_bytes, max_value_bytes=block_bytes,
        block_ttl_s=7 * 86400, op_timeout_s=30.0, write_timeout_s=60.0, eviction_policy=policy),
        clock_ms=lambda: clock["now"])
    value = bytes(block_bytes)
    hits = writes = lua_us = 0
    dead_max = 0
    every = max(1, len(blocks.requests) // CHECKPOINTS)
    start = time.perf_counter()
    try:
        await store.clear_namespace()
        for r, chain in enumerate(blocks.requests):
            clock["now"] += interval_ms
            hashes = [blocks.hashes[b] for b in chain]
            present = (await store.count_present(MODEL, hashes)).value if hashes else 0
            hits += present
            if present < len(hashes):
                before = await eval_usec(store.client)
                missing = hashes[present:]
                result = await store.store_blocks(MODEL, missing, [value] * len(missing), None, present,
                                                  hashes[present - 1] if present else None)
                if result.unavailable:
                    raise RuntimeError(f"Redis refused a write at request {r}")
                lua_us += await eval_usec(store.client) - before
                writes += 1
            if (r + 1) % every == 0 or r + 1 == len(blocks.requests):
                dead_max = max(dead_max, (await store.dead()).bytes)
                print(f"  {label} {policy}: {r + 1}/{len(blocks.requests)} requests", file=sys.stderr, flush=True)
        usage = await store.usage()
        stats = store.stats()
        if stats.errors or stats.dropped_writes:
            raise RuntimeError(f"{stats.errors} Redis errors, {stats.dropped_writes} dropped writes")
        return {"hit_blocks": hits, "dead_bytes": dead_max, "evictions": stats.evictions,
                "bytes_held": usage.bytes_held, "lua_us_per_write": lua_us / max(writes, 1),
                "seconds": time.perf_counter() - start}
    finally:
        await store.clear_namespace()
        await store.close()


async def bench(url: str, name: str, trace: Trace, policies: list[str], ratios: list[float],
                args: argparse.Namespace) -> list[dict[str, Any]]:
    blocks = cut(trace, args.block_tokens)
    working_set = len(blocks.hashes) * args.block_bytes
    possible = sum(possible_hits(blocks))
    high = StoreSettings.high_watermark
    rows = []
    for ratio in ratios:
        budget_bytes = max(args.block_bytes, int(working_set / ratio))
        optimum = sum(belady_hits(blocks, int(high * budget_bytes) // args.block_bytes)) / max(possible, 1)
        for policy in policies:
            got = await replay(url, blocks, policy, budget_bytes, args.block_bytes, args.interval_ms,
                               f"{name} x{ratio:g}")
            hit_rate = got["hit_blocks"] / max(possible, 1)
            rows.append({
                "workload": name, "policy": policy, "budget_ratio": ratio, "default": policy == DEFAULT_POLICY,
                "requests": len(blocks.requests), "blocks": len(blocks.hashes), "block_bytes": args.block_bytes,
                "working_set_bytes": working_set, "budget_bytes": budget_bytes,
                "hit_rate": round(hit_rate, 4), "optimum_hit_rate": round(optimum, 4),
                "vs_optimum": round(hit_rate / optimum, 4) if optimum else None,
                "dead_bytes": got["dead_bytes"], "dead_fraction": round(got["dead_bytes"] / budget_bytes, 4),
                "evictions": got["evictions"], "lua_us_per_write": round(got["lua_us_per_write"], 1),
                "seconds": round(got["seconds"], 2),
            })
    return rows


def run(args: argparse.Namespace) -> int:
    from ops.redisproc import RedisProcess  # noqa: PLC0415

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise KvstashError(f"unknown policy {unknown[0] if unknown else '(none)'}; policies: {', '.join(POLICIES)}")
    try:
        ratios = [float(x) for x in args.budget_ratios.split(",") if x.strip()]
    except ValueError:
        raise KvstashError("--budget-ratios takes numbers, e.g. 1,2") from None
    if not ratios or any(r <= 0 for r in ratios) or args.block_bytes < 1 or args.block_tokens < 1:
        raise KvstashError("budget ratios, --block-bytes and --block-tokens must be positive")
    loads = workloads(args)
    server = None
    url = args.redis_url
    if not url:
        server = RedisProcess().start()
        url = server.url
    rows: list[dict[str, Any]] = []
    try:
        for name, trace in loads:
            rows.extend(asyncio.run(bench(url, name, trace, policies, ratios, args)))
    finally:
        if server is not None:
            server.cleanup()
    print(f"block {args.block_bytes} bytes ({args.block_tokens} tokens); hit rate = blocks served / blocks an "
          f"infinite cache serves; optimum = Belady offline; default policy {DEFAULT_POLICY}")
    print_table(rows, COLUMNS)
    if args.json_path:
        write_json(args.json_path, {"rows": rows, "machine": machine(), "block_tokens": args.block_tokens,
                                    "interval_ms": args.interval_ms, "trace": args.trace or None})
    return 0
