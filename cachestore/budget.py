"""Byte accounting and least-recently-used eviction of blocks, sharded by hash tag.

Design (see cachestore/keys.py for the key names):

* Each block lives in one of `index_shards` hash slots (`{<ns>:sNN}`); its shard keeps a
  ZSET of block key -> last access (ms), a HASH of block key -> bytes, and a byte counter.
  Every script below declares all the keys it touches in KEYS, all in one slot, so it
  runs unchanged on Redis Cluster.
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

from cachestore.keys import KeySpace, ShardKeys

ACCOUNT = """
-- KEYS[1] lru zset, KEYS[2] size hash, KEYS[3] bytes counter, KEYS[4..] blocks just written
-- ARGV[1] now (ms), ARGV[2] index ttl (ms), ARGV[3] 'adopt' to keep an indexed block's last access
-- returns {bytes newly accounted, shard byte total}
local added = 0
for i = 4, #KEYS do
  local k = KEYS[i]
  local n = redis.call('STRLEN', k)
  local old = tonumber(redis.call('HGET', KEYS[2], k) or '-1')
  if n > 0 then
    if old ~= n then
      redis.call('HSET', KEYS[2], k, n)
      added = added + n - math.max(old, 0)
    end
    if ARGV[3] == 'adopt' then
      redis.call('ZADD', KEYS[1], 'NX', ARGV[1], k)
    else
      redis.call('ZADD', KEYS[1], ARGV[1], k)
    end
  elseif old >= 0 then
    redis.call('HDEL', KEYS[2], k)
    redis.call('ZREM', KEYS[1], k)
    added = added - old
  end
end
local total = redis.call('INCRBY', KEYS[3], added)
for j = 1, 3 do redis.call('PEXPIRE', KEYS[j], ARGV[2]) end
return {added, total}
"""

TOUCH = """
-- KEYS[1] lru zset, KEYS[2] size hash, KEYS[3] bytes counter, KEYS[4..] blocks just read
-- ARGV[1] now (ms), ARGV[2] index ttl (ms)
-- returns bytes of stale index entries removed (blocks Redis evicted or expired itself)
local stale = 0
for i = 4, #KEYS do
  local k = KEYS[i]
  if redis.call('EXISTS', k) == 1 then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], k)
  else
    local old = redis.call('HGET', KEYS[2], k)
    if old then
      redis.call('HDEL', KEYS[2], k)
      redis.call('ZREM', KEYS[1], k)
      stale = stale + tonumber(old)
    end
  end
end
if stale > 0 then redis.call('DECRBY', KEYS[3], stale) end
for j = 1, 3 do redis.call('PEXPIRE', KEYS[j], ARGV[2]) end
return stale
"""

PEEK = """
-- KEYS[1] lru zset, KEYS[2] size hash
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

EVICT = """
-- KEYS[1] lru zset, KEYS[2] size hash, KEYS[3] bytes counter, KEYS[4..] victim blocks
-- ARGV[i] the last access (ms) PEEK saw for KEYS[i + 3]; a victim touched since survives
-- returns {blocks evicted, bytes evicted, stale entries removed, stale bytes removed}
local n, freed, stale_n, stale = 0, 0, 0, 0
for i = 4, #KEYS do
  local k = KEYS[i]
  local score = redis.call('ZSCORE', KEYS[1], k)
  if score and tonumber(score) == tonumber(ARGV[i - 3]) then
    local size = tonumber(redis.call('HGET', KEYS[2], k) or '0')
    redis.call('ZREM', KEYS[1], k)
    redis.call('HDEL', KEYS[2], k)
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

CHECK = """
-- KEYS[1] lru zset, KEYS[2] size hash, KEYS[3] bytes counter, KEYS[4..] indexed blocks
-- ARGV[1] 1 to also recount the shard's byte counter from the size hash, ARGV[2] index ttl (ms)
-- returns {stale entries removed, stale bytes removed, shard byte total}
local stale_n, stale = 0, 0
for i = 4, #KEYS do
  local k = KEYS[i]
  local n = redis.call('STRLEN', k)
  local old = tonumber(redis.call('HGET', KEYS[2], k) or '0')
  if n == 0 then
    redis.call('HDEL', KEYS[2], k)
    redis.call('ZREM', KEYS[1], k)
    stale_n = stale_n + 1; stale = stale + old
  elseif n ~= old then
    redis.call('HSET', KEYS[2], k, n)
  end
end
local total = 0
if ARGV[1] == '1' then
  local sizes = redis.call('HVALS', KEYS[2])
  for i = 1, #sizes do total = total + tonumber(sizes[i]) end
  redis.call('SET', KEYS[3], total, 'KEEPTTL')
else
  total = tonumber(redis.call('DECRBY', KEYS[3], stale))
end
for j = 1, 3 do redis.call('PEXPIRE', KEYS[j], ARGV[2]) end
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


def account(pipe: Any, shard: ShardKeys, block_keys: Sequence[str], index_ttl_ms: int) -> None:
    """Queue ACCOUNT for blocks of one shard on `pipe` (after their SETs)."""
    pipe.eval(ACCOUNT, 3 + len(block_keys), *shard.all(), *block_keys, now_ms(), index_ttl_ms, "put")


def touch(pipe: Any, shard: ShardKeys, block_keys: Sequence[str], index_ttl_ms: int) -> None:
    """Queue TOUCH for blocks of one shard on `pipe` (after their GETEXs): any pipeline, asyncio or blocking,
    standalone or Cluster (redis-py's blocking ClusterPipeline refuses `.eval()` but routes EVAL by its keys)."""
    pipe.execute_command("EVAL", TOUCH, 3 + len(block_keys), *shard.all(), *block_keys, now_ms(), index_ttl_ms)


async def shard_totals(client: Any, keys: KeySpace) -> list[int]:
    """The byte counter of every shard, in one pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    for shard in keys.all_shards():
        pipe.get(shard.bytes)
    return [max(int(v or 0), 0) for v in await pipe.execute()]


async def evict(client: Any, keys: KeySpace, need_bytes: int, max_rounds: int = 8) -> EvictionResult:
    """Evict the globally least-recently-used blocks until `need_bytes` are freed (or none remain)."""
    totals = EvictionResult()
    peek = 32
    for _ in range(max_rounds):
        if need_bytes <= 0:
            break
        pipe = client.pipeline(transaction=False)
        shards = keys.all_shards()
        for shard in shards:
            pipe.eval(PEEK, 2, shard.lru, shard.size, peek)
        candidates: list[tuple[float, int, str, int]] = []
        for index, flat in enumerate(await pipe.execute()):
            for i in range(0, len(flat), 3):
                key = flat[i].decode() if isinstance(flat[i], bytes) else str(flat[i])
                candidates.append((float(flat[i + 1]), index, key, int(flat[i + 2])))
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
            pipe.eval(EVICT, 3 + len(items), *shard.all(), *(k for k, _ in items),
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
            await client.eval(ACCOUNT, 3 + len(found[i:i + chunk]), *shard.all(), *found[i:i + chunk],
                              now_ms(), index_ttl_ms, "adopt")
        indexed = {_text(m) for m in await client.hkeys(shard.size)}
        indexed.update(_text(m) for m in await client.zrange(shard.lru, 0, -1))
        members = sorted(indexed)
        batches = [members[i:i + chunk] for i in range(0, len(members), chunk)] or [[]]
        for i, batch in enumerate(batches):
            recount = "1" if i == len(batches) - 1 else "0"
            n, b, _ = await client.eval(CHECK, 3 + len(batch), *shard.all(), *batch, recount, index_ttl_ms)
            stale_n += int(n)
            stale += int(b)
    return EvictionResult(stale_blocks=stale_n, stale_bytes=stale)
