"""Byte accounting and least-recently-used eviction of blocks, sharded by hash tag.

Design (see cachestore/keys.py for the key names):

* Each block lives in one of `index_shards` hash slots (`{<ns>:sNN}`); its shard keeps a
  ZSET of block key -> last access (ms), a HASH of block key -> bytes, and a byte counter.
  Every script below touches keys of one slot only, so it runs unchanged on Redis Cluster.
* Tenants: the shard also keeps which tenant wrote each entry (owner HASH), the bytes each
  tenant holds in it (tbytes HASH) and, per tenant, an LRU ZSET of its own entries. The
  scripts keep them in step with the shard's own index, so the namespace's and a tenant's
  figures change together, atomically.
* Writes: `SET key frame PX ttl NX` for each block, then ACCOUNT in the same pipeline.
  ACCOUNT is idempotent and reads the size from Redis itself (STRLEN), so a retried or
  interleaved write never counts a block twice.
* The budget check happens on the client *before* writing: it sums the shard counters
  (one pipelined round trip) and, if the write would take the total over the high
  watermark, evicts the globally least-recently-used blocks (PEEK every shard, merge by
  last access, EVICT the oldest, re-checking each victim's score so a block touched in the
  meantime survives) until held + incoming <= the low watermark. A single writer
  therefore never takes the namespace over its budget (one store serialises its own
  puts); W concurrent writers on other pods can overshoot by at most their in-flight
  batches, which the next put evicts again.
* A tenant's quota works the same way, first: if its own bytes (the sum of its tbytes
  fields, read in the same round trip) plus the write would cross the high watermark of
  its quota, its own least-recently-used entries are evicted (PEEK and EVICT on its LRU
  ZSETs) to the low watermark. A tenant over its quota never evicts another tenant's.
* Redis evicting or expiring blocks itself leaves stale index entries; TOUCH (on every
  lookup), EVICT and CHECK (reconcile) notice a missing block and subtract its bytes.
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachestore.keys import INDEX_KEYS, KeySpace, ShardKeys

# Every script takes the shard's index keys in KEYS[1..5] (ShardKeys.all(): lru, size, bytes, owner, tbytes) and
# derives a tenant's LRU index (`<ns>:idx:tlru:<tenant>:{tag}`) from KEYS[1] and the owner hash: a reader holds only
# a block's content-addressed key, not its tenant. The derived name ends in the shard's hash tag, so it lies in the
# slot of the declared keys (Redis Cluster runs a script on undeclared keys of its own slot).
_TENANT_LRU = """
local function tlru(t)
  local at = string.find(KEYS[1], ':idx:lru:', 1, true)
  return string.sub(KEYS[1], 1, at - 1) .. ':idx:tlru:' .. t .. ':' .. string.sub(KEYS[1], at + 9)
end
local function tenant_add(t, n)
  if n ~= 0 and redis.call('HINCRBY', KEYS[5], t, n) <= 0 then redis.call('HDEL', KEYS[5], t) end
end
local function forget(k, size)  -- drop an entry from the tenant accounting of its owner (if any)
  local owner = redis.call('HGET', KEYS[4], k)
  if owner then
    redis.call('HDEL', KEYS[4], k)
    redis.call('ZREM', tlru(owner), k)
    tenant_add(owner, -size)
  end
end
"""

ACCOUNT = _TENANT_LRU + """
-- KEYS[1..5] the shard's index, KEYS[6..] entries just written
-- ARGV[1] now (ms), ARGV[2] index ttl (ms), ARGV[3] 'adopt' to keep an indexed entry's last access,
-- ARGV[4] the tenant that wrote them ('' for none: an entry keeps the owner it has)
-- returns {bytes newly accounted, shard byte total}
local added = 0
local tenant = ARGV[4]
local touched = {}
local function zadd(z, k)  -- an adopted entry keeps the last access it has
  if ARGV[3] == 'adopt' then redis.call('ZADD', z, 'NX', ARGV[1], k) else redis.call('ZADD', z, ARGV[1], k) end
end
for i = 6, #KEYS do
  local k = KEYS[i]
  local n = redis.call('STRLEN', k)
  local old = tonumber(redis.call('HGET', KEYS[2], k) or '-1')
  local was = math.max(old, 0)
  if n > 0 then
    if old ~= n then
      redis.call('HSET', KEYS[2], k, n)
      added = added + n - was
    end
    zadd(KEYS[1], k)
    local owner = redis.call('HGET', KEYS[4], k)
    local now_owner = owner
    if tenant ~= '' then now_owner = tenant end
    if owner and owner ~= now_owner then forget(k, was); owner = false; was = 0 end
    if now_owner then
      if not owner then redis.call('HSET', KEYS[4], k, now_owner) end
      tenant_add(now_owner, n - was)
      zadd(tlru(now_owner), k)
      touched[now_owner] = true
    end
  elseif old >= 0 then
    redis.call('HDEL', KEYS[2], k)
    redis.call('ZREM', KEYS[1], k)
    forget(k, old)
    added = added - old
  end
end
local total = redis.call('INCRBY', KEYS[3], added)
for j = 1, 5 do redis.call('PEXPIRE', KEYS[j], ARGV[2]) end
for t in pairs(touched) do redis.call('PEXPIRE', tlru(t), ARGV[2]) end
return {added, total}
"""

TOUCH = _TENANT_LRU + """
-- KEYS[1..5] the shard's index, KEYS[6..] entries just read
-- ARGV[1] now (ms), ARGV[2] index ttl (ms)
-- returns bytes of stale index entries removed (entries Redis evicted or expired itself)
local stale = 0
for i = 6, #KEYS do
  local k = KEYS[i]
  if redis.call('EXISTS', k) == 1 then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], k)
    local owner = redis.call('HGET', KEYS[4], k)
    if owner then
      local z = tlru(owner)
      redis.call('ZADD', z, 'XX', ARGV[1], k)
      redis.call('PEXPIRE', z, ARGV[2])
    end
  else
    local old = redis.call('HGET', KEYS[2], k)
    if old then
      redis.call('HDEL', KEYS[2], k)
      redis.call('ZREM', KEYS[1], k)
      forget(k, tonumber(old))
      stale = stale + tonumber(old)
    end
  end
end
if stale > 0 then redis.call('DECRBY', KEYS[3], stale) end
for j = 1, 5 do redis.call('PEXPIRE', KEYS[j], ARGV[2]) end
return stale
"""

PEEK = """
-- KEYS[1] an lru zset (the shard's, or one tenant's in it), KEYS[2] size hash
-- ARGV[1] how many of the least recently used entries to return
-- returns a flat list {key, last access ms, bytes, key, ...}, oldest first
local out = {}
local entries = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
for i = 1, #entries, 2 do
  out[#out + 1] = entries[i]
  out[#out + 1] = entries[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[2], entries[i]) or '0'
end
return out
"""

EVICT = _TENANT_LRU + """
-- KEYS[1..5] the shard's index, KEYS[6..] victim entries
-- ARGV[1] '' when PEEK read the shard's LRU, else the tenant whose LRU it read (only its entries are victims)
-- ARGV[i + 1] the last access (ms) PEEK saw for KEYS[i + 5]; a victim touched since survives
-- returns {entries evicted, bytes evicted, stale entries removed, stale bytes removed}
local n, freed, stale_n, stale = 0, 0, 0, 0
local lru = KEYS[1]
if ARGV[1] ~= '' then lru = tlru(ARGV[1]) end
for i = 6, #KEYS do
  local k = KEYS[i]
  local score = redis.call('ZSCORE', lru, k)
  if score and tonumber(score) == tonumber(ARGV[i - 4]) then
    local size = tonumber(redis.call('HGET', KEYS[2], k) or '0')
    redis.call('ZREM', KEYS[1], k)
    redis.call('HDEL', KEYS[2], k)
    forget(k, size)
    if ARGV[1] ~= '' then redis.call('ZREM', lru, k) end  -- an entry its owner hash had lost
    if redis.call('UNLINK', k) == 1 then  -- UNLINK: a big value is freed off the main thread
      n = n + 1; freed = freed + size
    else
      stale_n = stale_n + 1; stale = stale + size
    end
  end
end
if freed + stale > 0 then
  if redis.call('DECRBY', KEYS[3], freed + stale) < 0 then redis.call('SET', KEYS[3], 0, 'KEEPTTL') end
end
return {n, freed, stale_n, stale}
"""

CHECK = _TENANT_LRU + """
-- KEYS[1..5] the shard's index, KEYS[6..] indexed entries
-- ARGV[1] 1 to also recount the shard's byte counters (its own and each tenant's) from the size hash,
-- ARGV[2] index ttl (ms)
-- returns {stale entries removed, stale bytes removed, shard byte total}
local stale_n, stale = 0, 0
for i = 6, #KEYS do
  local k = KEYS[i]
  local n = redis.call('STRLEN', k)
  local old = tonumber(redis.call('HGET', KEYS[2], k) or '0')
  if n == 0 then
    redis.call('HDEL', KEYS[2], k)
    redis.call('ZREM', KEYS[1], k)
    forget(k, old)
    stale_n = stale_n + 1; stale = stale + old
  elseif n ~= old then
    redis.call('HSET', KEYS[2], k, n)
    local owner = redis.call('HGET', KEYS[4], k)
    if owner then tenant_add(owner, n - old) end
  end
end
local total = 0
if ARGV[1] == '1' then
  local sizes = redis.call('HGETALL', KEYS[2])
  local by_tenant = {}
  for i = 1, #sizes, 2 do
    local n = tonumber(sizes[i + 1])
    total = total + n
    local owner = redis.call('HGET', KEYS[4], sizes[i])
    if owner then by_tenant[owner] = (by_tenant[owner] or 0) + n end
  end
  local owners = redis.call('HGETALL', KEYS[4])
  for i = 1, #owners, 2 do
    if redis.call('HEXISTS', KEYS[2], owners[i]) == 0 then
      redis.call('HDEL', KEYS[4], owners[i])
      redis.call('ZREM', tlru(owners[i + 1]), owners[i])
    end
  end
  redis.call('SET', KEYS[3], total, 'KEEPTTL')
  redis.call('DEL', KEYS[5])
  for t, n in pairs(by_tenant) do redis.call('HSET', KEYS[5], t, n) end
else
  total = tonumber(redis.call('DECRBY', KEYS[3], stale))
end
for j = 1, 5 do redis.call('PEXPIRE', KEYS[j], ARGV[2]) end
return {stale_n, stale, total}
"""


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class EvictionResult:
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    stale_blocks: int = 0
    stale_bytes: int = 0


def account(pipe: Any, shard: ShardKeys, block_keys: Sequence[str], index_ttl_ms: int,
            tenant: str | None = None) -> None:
    """Queue ACCOUNT for entries of one shard on `pipe` (after their SETs), owned by `tenant` when given."""
    pipe.eval(ACCOUNT, INDEX_KEYS + len(block_keys), *shard.all(), *block_keys, now_ms(), index_ttl_ms, "put",
              tenant or "")


def touch(pipe: Any, shard: ShardKeys, block_keys: Sequence[str], index_ttl_ms: int) -> None:
    """Queue TOUCH for blocks of one shard on `pipe` (after their GETEXs): any pipeline, asyncio or blocking,
    standalone or Cluster (redis-py's blocking ClusterPipeline refuses `.eval()` but routes EVAL by its keys)."""
    pipe.execute_command("EVAL", TOUCH, INDEX_KEYS + len(block_keys), *shard.all(), *block_keys, now_ms(),
                         index_ttl_ms)


async def shard_totals(client: Any, keys: KeySpace) -> list[int]:
    """The byte counter of every shard, in one pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    for shard in keys.all_shards():
        pipe.get(shard.bytes)
    return [max(int(v or 0), 0) for v in await pipe.execute()]


async def held(client: Any, keys: KeySpace, tenant: str | None = None) -> tuple[int, int]:
    """(bytes the namespace holds, bytes `tenant` holds in it: 0 for None), in one pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    shards = keys.all_shards()
    for shard in shards:
        pipe.get(shard.bytes)
    if tenant is not None:
        for shard in shards:
            pipe.hget(shard.tenant_bytes, tenant)
    flat = await pipe.execute()
    total = sum(max(int(v or 0), 0) for v in flat[:len(shards)])
    return total, sum(max(int(v or 0), 0) for v in flat[len(shards):])


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
                tenant: str | None = None) -> EvictionResult:
    """Evict the least-recently-used entries until `need_bytes` are freed (or none remain): the namespace's, or
    with `tenant` only that tenant's own (its LRU index in every shard), never another's."""
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
        for n, freed, stale_n, stale in await pipe.execute():
            totals = EvictionResult(totals.evicted_blocks + int(n), totals.evicted_bytes + int(freed),
                                    totals.stale_blocks + int(stale_n), totals.stale_bytes + int(stale))
            need_bytes -= int(freed) + int(stale)
        peek *= 2
    return totals


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
            await client.eval(ACCOUNT, INDEX_KEYS + len(found[i:i + chunk]), *shard.all(), *found[i:i + chunk],
                              now_ms(), index_ttl_ms, "adopt", "")
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
