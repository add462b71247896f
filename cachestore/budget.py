"""Byte accounting and eviction of blocks by policy (cachestore/eviction.py), sharded by hash tag.

Design (see cachestore/keys.py for the key names, cachestore/budgetlua.py for the scripts):

* Each block lives in one of `index_shards` hash slots (`{<ns>:sNN}`); its shard keeps a
  ZSET of block key -> score (the policy's: last access, then rank; lowest leaves first), a HASH of block key ->
  bytes, a byte counter, and a HASH of each block's chain facts (depth, parent) that chain-aware policies rank by.
  Every script below touches keys of one slot only, so it runs unchanged on Redis Cluster.
* Tenants: the shard also keeps which tenant wrote each entry (owner HASH), the bytes each
  tenant holds in it (tbytes HASH) and, per tenant, a ZSET of its own entries with the same scores. The
  scripts keep them in step with the shard's own index, so the namespace's and a tenant's
  figures change together, atomically.
* Writes: `SET key frame PX ttl NX` for each block, then ACCOUNT in the same pipeline.
  ACCOUNT is idempotent and reads the size from Redis itself (STRLEN), so a retried or
  interleaved write never counts a block twice. The scores of new blocks come from the client: a chained policy
  scores them just below their parent's score, read (ZSCORE) in the budget check's round trip.
* The budget check happens on the client *before* writing: it sums the shard counters
  (one pipelined round trip) and, if the write would take the total over the high
  watermark, evicts the lowest-scored blocks (PEEK every shard, merge by score, EVICT the lowest, re-checking
  each victim's score so a block touched in the meantime survives) until held + incoming <= the low watermark.
  A single writer therefore never takes the namespace over its budget (one store serialises its own
  puts); W concurrent writers on other pods can overshoot by at most their in-flight
  batches, which the next put evicts again.
* A tenant's quota works the same way, first: if its own bytes (the sum of its tbytes
  fields, read in the same round trip) plus the write would cross the high watermark of
  its quota, its own lowest-scored entries are evicted (PEEK and EVICT on its ZSETs) to the low watermark. A tenant
  over its quota never evicts another tenant's.
* Redis evicting or expiring blocks itself leaves stale index entries; TOUCH (on every
  lookup), EVICT and CHECK (reconcile) notice a missing block and subtract its bytes. A block whose parent is gone
  is dead (held, unreachable): `dead_entries` finds them from the index, `kvstash admin verify --fix` reclaims them.
* Under a chained policy no writer or evictor leaves one: shards are separate slots, so no script can check a
  parent in another, but ordering does it. A writer asks whether its parent is still indexed after its blocks'
  ACCOUNT (on the same connection; a Cluster's in a round trip after) and removes them again if not (`drop`); an
  evictor, after its EVICTs, removes the blocks indexed on what it took (`reap`, REAP on every shard, generation by
  generation). A parent evicted before the writer's question is seen by it; one evicted after it was evicted after
  the blocks' ACCOUNT, so the evictor's REAP finds them.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachestore.budgetlua import ACCOUNT, CHECK, EVICT, PEEK, REAP, TOUCH
from cachestore.eviction import POLICIES, RANKS, Policy, now_ms, parse_facts
from cachestore.keys import INDEX_KEYS, KeySpace, ShardKeys

__all__ = ["ACCOUNT", "CHECK", "EVICT", "PEEK", "REAP", "TOUCH", "DeadEntries", "EvictionResult", "account", "adopt",
           "dead_entries", "drop", "evict", "held", "now_ms", "reap", "reconcile", "touch"]

@dataclass(frozen=True)
class EvictionResult:
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    stale_blocks: int = 0
    stale_bytes: int = 0

    def plus(self, reply: Sequence[Any]) -> EvictionResult:
        """This with the counts of an EVICT or REAP reply added ({n, freed, stale n, stale bytes, keys...})."""
        n, freed, stale_n, stale = (int(x) for x in reply[:4])
        return EvictionResult(self.evicted_blocks + n, self.evicted_bytes + freed, self.stale_blocks + stale_n,
                              self.stale_bytes + stale)

    @property
    def freed(self) -> int:
        return self.evicted_bytes + self.stale_bytes


def account(pipe: Any, shard: ShardKeys, block_keys: Sequence[str], index_ttl_ms: int, tenant: str | None = None,
            scores: Sequence[int] | None = None, chains: Sequence[str] | None = None,
            policy: Policy = POLICIES["lru"]) -> None:
    """Queue ACCOUNT for entries of one shard on `pipe` (after their SETs), owned by `tenant` when given, each with
    its score (default: `policy`'s of a write now) and chain facts (eviction.chain_facts; default none)."""
    now = policy.write_scores(now_ms(), 0, 1, None)[0]
    per_entry: list[Any] = []
    for i in range(len(block_keys)):
        per_entry += [scores[i] if scores is not None else now, chains[i] if chains is not None else ""]
    pipe.execute_command("EVAL", ACCOUNT, INDEX_KEYS + len(block_keys), *shard.all(), *block_keys, now,
                         index_ttl_ms, "put", tenant or "", policy.freq_unit, *per_entry)


async def adopt(client: Any, shard: ShardKeys, block_keys: Sequence[str], index_ttl_ms: int) -> None:
    """Index entries Redis holds but the index lacks (an indexed one keeps its score), as written now."""
    await client.eval(ACCOUNT, INDEX_KEYS + len(block_keys), *shard.all(), *block_keys,
                      POLICIES["lru"].write_scores(now_ms(), 0, 1, None)[0], index_ttl_ms, "adopt", "", 0)


def touch(pipe: Any, shard: ShardKeys, block_keys: Sequence[str], index_ttl_ms: int,
          policy: Policy = POLICIES["lru"], at_ms: int | None = None) -> None:
    """Queue TOUCH for blocks of one shard on `pipe` (after their GETEXs): any pipeline, asyncio or blocking,
    standalone or Cluster (redis-py's blocking ClusterPipeline refuses `.eval()` but routes EVAL by its keys)."""
    pipe.execute_command("EVAL", TOUCH, INDEX_KEYS + len(block_keys), *shard.all(), *block_keys,
                         policy.read_base(now_ms() if at_ms is None else at_ms), index_ttl_ms,
                         "1" if policy.chained else "0", policy.freq_unit, RANKS)


async def shard_totals(client: Any, keys: KeySpace) -> list[int]:
    """The byte counter of every shard, in one pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    for shard in keys.all_shards():
        pipe.get(shard.bytes)
    return [max(int(v or 0), 0) for v in await pipe.execute()]


async def held(client: Any, keys: KeySpace, tenant: str | None = None,
               parent: tuple[int, str] | None = None) -> tuple[int, int, int | None]:
    """(bytes the namespace holds, bytes `tenant` holds in it: 0 for None, the score of entry `parent` (shard,
    key): None when not given or not indexed), in one pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    shards = keys.all_shards()
    for shard in shards:
        pipe.get(shard.bytes)
    if tenant is not None:
        for shard in shards:
            pipe.hget(shard.tenant_bytes, tenant)
    if parent is not None:
        pipe.zscore(shards[parent[0]].lru, parent[1])
    flat = await pipe.execute()
    score = flat.pop() if parent is not None else None
    total = sum(max(int(v or 0), 0) for v in flat[:len(shards)])
    return total, sum(max(int(v or 0), 0) for v in flat[len(shards):]), None if score is None else int(score)


async def tenant_totals(client: Any, keys: KeySpace) -> dict[str, int]:
    """Bytes each tenant's entries hold in the namespace (tenants named by the writers), in one round trip."""
    pipe = client.pipeline(transaction=False)
    for shard in keys.all_shards():
        pipe.hgetall(shard.tenant_bytes)
    totals: dict[str, int] = defaultdict(int)
    for mapping in await pipe.execute():
        for tenant, n in (mapping or {}).items():
            totals[_text(tenant)] += max(int(n), 0)
    return dict(sorted(totals.items()))


async def evict(client: Any, keys: KeySpace, need_bytes: int, max_rounds: int = 8,
                tenant: str | None = None, keep: str | None = None, reap_dead: bool = False) -> EvictionResult:
    """Evict the least-recently-used entries until `need_bytes` are freed (or none remain): the namespace's, or
    with `tenant` only that tenant's own (its LRU index in every shard), never another's. `keep`: an
    entry never to evict (the parent of the blocks the caller is about to write). `reap_dead` (a chained policy's):
    the entries whose chain an eviction broke go too (`reap`), whatever left them behind: a writer adding to the
    chain between this one's PEEK and EVICT, a reader touching a child but not yet its parent."""
    totals = EvictionResult()
    peek = 32
    for _ in range(max_rounds):
        if need_bytes <= 0:
            break
        pipe = client.pipeline(transaction=False)
        shards = keys.all_shards()
        for shard in shards:
            pipe.eval(PEEK, 2, shard.lru if tenant is None else shard.tenant_lru(tenant), shard.size, peek)
        candidates: list[tuple[float, int, str, int]] = []
        for index, flat in enumerate(await pipe.execute()):
            for i in range(0, len(flat), 3):
                if _text(flat[i]) != keep:
                    candidates.append((float(flat[i + 1]), index, _text(flat[i]), int(flat[i + 2])))
        if not candidates:
            break
        victims: dict[int, list[tuple[str, float]]] = defaultdict(list)
        chosen = 0
        for score, index, key, size in heapq.nsmallest(len(candidates), candidates):
            if chosen >= need_bytes:
                break
            victims[index].append((key, score))
            chosen += size
        pipe = client.pipeline(transaction=False)
        for index, items in victims.items():
            shard = shards[index]
            pipe.eval(EVICT, INDEX_KEYS + len(items), *shard.all(), *(k for k, _ in items), tenant or "",
                      *(f"{s:.17g}" for _, s in items))
        gone: list[str] = []
        before = totals.freed
        for reply in await pipe.execute():
            totals = totals.plus(reply)
            gone += [_text(k) for k in reply[4:]]
        if reap_dead and gone:
            totals = await reap(client, keys, gone, totals)
        need_bytes -= totals.freed - before
        peek *= 2
    return totals


def _kin(key: str) -> str:
    """The start of the KIDS members of block `key`'s children: "<its hash hex>|<ns>:blk:<model>:"."""
    head, _, block_hex = key[:key.rfind(":{")].rpartition(":")
    ns, _, model = head.rpartition(":")
    ns = ns[:ns.rfind(":")]
    return f"{block_hex}|{ns}:blk:{model}:"


async def reap(client: Any, keys: KeySpace, gone: Sequence[str],
               totals: EvictionResult = EvictionResult()) -> EvictionResult:
    """Remove every indexed block whose parent is one of `gone` (entries no longer indexed), then theirs, until
    none: REAP on every shard, a round trip per generation, O(log n) a block. `totals` plus what it removed."""
    while gone:
        prefixes = list(dict.fromkeys(_kin(k) for k in gone))
        pipe = client.pipeline(transaction=False)
        for shard in keys.all_shards():
            pipe.execute_command("EVAL", REAP, INDEX_KEYS, *shard.all(), *prefixes)
        gone = []
        for reply in await pipe.execute():
            totals = totals.plus(reply)
            gone += [_text(k) for k in reply[4:]]
    return totals


async def drop(client: Any, keys: KeySpace, keyed: Sequence[tuple[int, str]]) -> EvictionResult:
    """Remove the entries `keyed` ((shard, key)) whatever their scores, and the blocks their removal leaves dead."""
    by_shard: dict[int, list[str]] = defaultdict(list)
    for shard, key in keyed:
        by_shard[shard].append(key)
    shards = keys.all_shards()
    pipe = client.pipeline(transaction=False)
    for index, items in by_shard.items():
        pipe.execute_command("EVAL", EVICT, INDEX_KEYS + len(items), *shards[index].all(), *items, "",
                             *("*" for _ in items))
    totals, gone = EvictionResult(), []
    for reply in await pipe.execute():
        totals = totals.plus(reply)
        gone += [_text(k) for k in reply[4:]]
    return await reap(client, keys, gone, totals)


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


async def reconcile(client: Any, keys: KeySpace, index_ttl_ms: int, chunk: int = 256) -> EvictionResult:
    """Bring the index back in line with what Redis holds, after Redis evicted or expired keys
    itself (blocks or index keys): adopt blocks missing from the index (SCAN), drop entries of
    blocks that are gone, and recount every shard's bytes. O(keys of the namespace)."""
    by_tag = {shard.lru[shard.lru.rfind("{"):]: index for index, shard in enumerate(keys.all_shards())}
    orphans: dict[int, list[str]] = defaultdict(list)
    for pattern in keys.entry_patterns():
        async for raw in client.scan_iter(match=pattern, count=1000):
            key = _text(raw)
            index = by_tag.get(key[key.rfind("{"):])
            if index is not None:
                orphans[index].append(key)
    stale_n = stale = 0
    shards = keys.all_shards()
    for index, shard in enumerate(shards):
        found = orphans.get(index, [])
        for i in range(0, len(found), chunk):
            await adopt(client, shard, found[i:i + chunk], index_ttl_ms)
        indexed = {_text(m) for m in await client.hkeys(shard.size)}
        indexed.update(_text(m) for m in await client.zrange(shard.lru, 0, -1))
        members = sorted(indexed)
        batches = [members[i:i + chunk] for i in range(0, len(members), chunk)] or [[]]
        for i, batch in enumerate(batches):
            recount = "1" if i == len(batches) - 1 else "0"
            n, b, _ = await client.eval(CHECK, INDEX_KEYS + len(batch), *shard.all(), *batch, recount,
                                        index_ttl_ms)
            stale_n += int(n)
            stale += int(b)
    return EvictionResult(stale_blocks=stale_n, stale_bytes=stale)


@dataclass(frozen=True)
class DeadEntries:
    """Blocks the index holds whose chain is broken: a parent (or an ancestor's) is not indexed, so no lookup
    reaches them."""

    blocks: int
    bytes: int
    keys_by_shard: dict[int, list[str]]


async def dead_entries(client: Any, keys: KeySpace) -> DeadEntries:
    """The dead blocks of the namespace, from its index (sizes and chain facts of every shard, one round trip;
    O(entries))."""
    pipe = client.pipeline(transaction=False)
    shards = keys.all_shards()
    for shard in shards:
        pipe.hgetall(shard.size)
        pipe.hgetall(shard.chain)
    flat = await pipe.execute()
    sizes: dict[str, tuple[int, int]] = {}
    parents: dict[str, str] = {}
    for index in range(len(shards)):
        for k, v in (flat[2 * index] or {}).items():
            sizes[_text(k)] = (index, int(v))
        for k, v in (flat[2 * index + 1] or {}).items():
            _, parent_hex = parse_facts(_text(v))
            key = _text(k)
            if parent_hex and key in sizes:
                parents[key] = keys.sibling(key, parent_hex)
    alive: dict[str, bool] = {}

    def reachable(key: str) -> bool:
        path: list[str] = []
        while key not in alive:
            parent = parents.get(key)
            if len(path) > len(sizes):  # a cycle: only a forged index has one
                parent = ""
            if parent is None:
                alive[key] = True
                break
            if parent not in sizes:
                alive[key] = False
                break
            path.append(key)
            key = parent
        verdict = alive[key]
        for k in path:
            alive[k] = verdict
        return verdict

    by_shard: dict[int, list[str]] = defaultdict(list)
    nbytes = 0
    for key, (index, size) in sizes.items():
        if not reachable(key):
            by_shard[index].append(key)
            nbytes += size
    return DeadEntries(sum(len(v) for v in by_shard.values()), nbytes, dict(by_shard))
