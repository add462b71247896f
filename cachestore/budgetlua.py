"""The byte budget's Lua scripts (cachestore/budget.py runs them): each touches keys of one shard's slot only.

Every script takes the shard's index keys in KEYS[1..5] (ShardKeys.all(): lru, size, bytes, owner, tbytes) and
derives the others from KEYS[1]: a tenant's LRU (`<ns>:idx:tlru:<tenant>:{tag}`), the chain facts of each entry
(`<ns>:idx:chain:{tag}`: key -> "depth" or "depth:parent hash hex"), its hit counts (`<ns>:idx:hits:{tag}`) and
the entries of each parent (`<ns>:idx:kids:{tag}`: a lexicographic ZSET of "<parent hex>|<key>", so REAP finds the
children in this shard of entries gone from any shard, O(log n) each). A
derived name ends in the shard's hash tag, so it lies in the slot of the declared keys (Redis Cluster runs a script
on undeclared keys of its own slot). Scores are integers below 2^53 (cachestore/eviction.py makes them), written
back with %.17g so no digit is lost.
"""

from __future__ import annotations

_PRELUDE = """
local function derived(kind)
  local at = string.find(KEYS[1], ':idx:lru:', 1, true)
  return string.sub(KEYS[1], 1, at - 1) .. ':idx:' .. kind .. ':' .. string.sub(KEYS[1], at + 9)
end
local function tlru(t) return derived('tlru:' .. t) end
local CHAIN, HITS, KIDS = derived('chain'), derived('hits'), derived('kids')
local function kid(k, facts)  -- entry k's member of KIDS ("<parent hex>|<key>"), from its chain facts; nil: no parent
  local parent = facts and string.match(facts, ':(%x+)$')
  if parent then return parent .. '|' .. k end
  return nil
end
local function num(x) return string.format('%.17g', x) end
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
local function unindex(k, size)  -- an entry leaves the index: its score, size, chain facts, hits and owner
  redis.call('HDEL', KEYS[2], k)
  redis.call('ZREM', KEYS[1], k)
  local m = kid(k, redis.call('HGET', CHAIN, k))
  if m then redis.call('ZREM', KIDS, m) end
  redis.call('HDEL', CHAIN, k)
  redis.call('HDEL', HITS, k)
  forget(k, size)
end
local function bonus(k, unit)  -- the frequency policy's lift: `unit` per doubling of an entry's hits
  if unit <= 0 then return 0 end
  local hits = tonumber(redis.call('HGET', HITS, k) or '0')
  return unit * math.floor(math.log(1 + hits) / math.log(2) + 1e-9)
end
local function refresh_ttls(ttl)
  for j = 1, 5 do redis.call('PEXPIRE', KEYS[j], ttl) end
  redis.call('PEXPIRE', CHAIN, ttl)
  redis.call('PEXPIRE', HITS, ttl)
  redis.call('PEXPIRE', KIDS, ttl)
end
local function drop(k, n, freed, stale_n, stale)  -- unindex and delete an indexed entry; the counts with it added
  local size = tonumber(redis.call('HGET', KEYS[2], k) or '0')
  unindex(k, size)
  if redis.call('UNLINK', k) == 1 then  -- UNLINK: a big value is freed off the main thread
    return n + 1, freed + size, stale_n, stale
  end
  return n, freed, stale_n + 1, stale + size
end
local function uncount(bytes)
  if bytes > 0 and redis.call('DECRBY', KEYS[3], bytes) < 0 then redis.call('SET', KEYS[3], 0, 'KEEPTTL') end
end
"""

ACCOUNT = _PRELUDE + """
-- KEYS[1..5] the shard's index, KEYS[6..] entries just written
-- ARGV[1] score of an entry given none of its own, ARGV[2] index ttl (ms), ARGV[3] 'adopt' to keep an indexed
-- entry's score (and give none of its own), ARGV[4] the tenant that wrote them ('' for none: an entry keeps the
-- owner it has), ARGV[5] the frequency unit (0: off); then per entry i (from 0) ARGV[6 + 2i] its score and
-- ARGV[7 + 2i] its chain facts ('' for none)
-- returns {bytes newly accounted, shard byte total}
local added = 0
local tenant = ARGV[4]
local unit = tonumber(ARGV[5])
local touched = {}
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
    local score, chain = ARGV[1], ''
    if ARGV[3] ~= 'adopt' then  -- a write starts its entries' hits afresh: a rewritten parent has none either
      redis.call('HDEL', HITS, k)
      score, chain = ARGV[2 * i - 6], ARGV[2 * i - 5]
      if chain ~= '' then
        redis.call('HSET', CHAIN, k, chain)
        local m = kid(k, chain)
        if m then redis.call('ZADD', KIDS, 0, m) end
      end
    end
    local function zadd(z)  -- an adopted entry keeps the score it has
      if ARGV[3] == 'adopt' then redis.call('ZADD', z, 'NX', score, k) else redis.call('ZADD', z, score, k) end
    end
    zadd(KEYS[1])
    local owner = redis.call('HGET', KEYS[4], k)
    local now_owner = owner
    if tenant ~= '' then now_owner = tenant end
    if owner and owner ~= now_owner then forget(k, was); owner = false; was = 0 end
    if now_owner then
      if not owner then redis.call('HSET', KEYS[4], k, now_owner) end
      tenant_add(now_owner, n - was)
      zadd(tlru(now_owner))
      touched[now_owner] = true
    end
  elseif old >= 0 then
    unindex(k, old)
    added = added - old
  end
end
local total = redis.call('INCRBY', KEYS[3], added)
refresh_ttls(ARGV[2])
for t in pairs(touched) do redis.call('PEXPIRE', tlru(t), ARGV[2]) end
return {added, total}
"""

TOUCH = _PRELUDE + """
-- KEYS[1..5] the shard's index, KEYS[6..] entries just read
-- ARGV[1] the score of this read's time, ARGV[2] index ttl (ms), ARGV[3] '1' when an entry ranks by its depth
-- (deeper ones lower: a chain leaves from its end), ARGV[4] the frequency unit (0: off, no hits counted),
-- ARGV[5] the rank scale (ranks 0..scale-1)
-- returns bytes of stale index entries removed (entries Redis evicted or expired itself)
local stale = 0
local base, chained, unit, scale = tonumber(ARGV[1]), ARGV[3] == '1', tonumber(ARGV[4]), tonumber(ARGV[5])
for i = 6, #KEYS do
  local k = KEYS[i]
  if redis.call('EXISTS', k) == 1 then
    local score = base
    if chained then
      local depth = tonumber(string.match(redis.call('HGET', CHAIN, k) or '0', '^%d+') or '0')
      score = score + scale - 1 - math.min(depth, scale - 1)
    end
    if unit > 0 and redis.call('HEXISTS', KEYS[2], k) == 1 then redis.call('HINCRBY', HITS, k, 1) end
    score = num(score + bonus(k, unit))
    redis.call('ZADD', KEYS[1], 'XX', 'GT', score, k)  -- GT: a read in the tick of a later write never lowers it
    local owner = redis.call('HGET', KEYS[4], k)
    if owner then
      local z = tlru(owner)
      redis.call('ZADD', z, 'XX', 'GT', score, k)
      redis.call('PEXPIRE', z, ARGV[2])
    end
  else
    local old = redis.call('HGET', KEYS[2], k)
    if old then
      unindex(k, tonumber(old))
      stale = stale + tonumber(old)
    end
  end
end
if stale > 0 then redis.call('DECRBY', KEYS[3], stale) end
refresh_ttls(ARGV[2])
return stale
"""

PEEK = """
-- KEYS[1] an lru zset (the shard's, or one tenant's in it), KEYS[2] size hash
-- ARGV[1] how many of the lowest-scored entries to return
-- returns a flat list {key, score, bytes, key, ...}, lowest first
local out = {}
local entries = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
for i = 1, #entries, 2 do
  out[#out + 1] = entries[i]
  out[#out + 1] = entries[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[2], entries[i]) or '0'
end
return out
"""

EVICT = _PRELUDE + """
-- KEYS[1..5] the shard's index, KEYS[6..] victim entries
-- ARGV[1] '' when PEEK read the shard's LRU, else the tenant whose LRU it read (only its entries are victims)
-- ARGV[i + 1] the score PEEK saw for KEYS[i + 5] ('*': any); a victim touched since survives
-- returns {entries evicted, bytes evicted, stale entries removed, stale bytes removed, key of each entry removed...}
local n, freed, stale_n, stale = 0, 0, 0, 0
local gone = {}
local lru = KEYS[1]
if ARGV[1] ~= '' then lru = tlru(ARGV[1]) end
for i = 6, #KEYS do
  local k = KEYS[i]
  local score = redis.call('ZSCORE', lru, k)
  if score and (ARGV[i - 4] == '*' or tonumber(score) == tonumber(ARGV[i - 4])) then
    n, freed, stale_n, stale = drop(k, n, freed, stale_n, stale)
    if ARGV[1] ~= '' then redis.call('ZREM', lru, k) end  -- an entry its owner hash had lost
    gone[#gone + 1] = k
  end
end
uncount(freed + stale)
return {n, freed, stale_n, stale, unpack(gone)}
"""

REAP = _PRELUDE + """
-- KEYS[1..5] the shard's index; ARGV[1..] "<parent hex>|<ns>:blk:<model>:" of entries gone from the index (of any
-- shard): every entry of this shard whose parent is one of them goes too (it is dead: no lookup reaches it)
-- returns {entries evicted, bytes evicted, stale entries removed, stale bytes removed, key of each entry removed...}
local n, freed, stale_n, stale = 0, 0, 0, 0
local gone = {}
for i = 1, #ARGV do
  for _, m in ipairs(redis.call('ZRANGEBYLEX', KIDS, '[' .. ARGV[i], '[' .. ARGV[i] .. '\255')) do
    local k = string.sub(m, string.find(m, '|', 1, true) + 1)
    redis.call('ZREM', KIDS, m)
    if redis.call('HEXISTS', KEYS[2], k) == 1 then
      n, freed, stale_n, stale = drop(k, n, freed, stale_n, stale)
      gone[#gone + 1] = k
    end
  end
end
uncount(freed + stale)
return {n, freed, stale_n, stale, unpack(gone)}
"""

CHECK = _PRELUDE + """
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
    unindex(k, old)
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
  for _, facts in ipairs({CHAIN, HITS}) do
    for _, k in ipairs(redis.call('HKEYS', facts)) do
      if redis.call('HEXISTS', KEYS[2], k) == 0 then redis.call('HDEL', facts, k) end
    end
  end
  for _, m in ipairs(redis.call('ZRANGE', KIDS, 0, -1)) do
    local k = string.sub(m, string.find(m, '|', 1, true) + 1)
    if redis.call('HEXISTS', KEYS[2], k) == 0 then redis.call('ZREM', KIDS, m) end
  end
  redis.call('SET', KEYS[3], total, 'KEEPTTL')
  redis.call('DEL', KEYS[5])
  for t, n in pairs(by_tenant) do redis.call('HSET', KEYS[5], t, n) end
else
  total = tonumber(redis.call('DECRBY', KEYS[3], stale))
end
refresh_ttls(ARGV[2])
return {stale_n, stale, total}
"""
