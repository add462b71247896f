"""Read-only inspection of a namespace in Redis by SCAN (never KEYS): key kinds, sizes, sessions, stats."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cachestore.budget import dead_entries, shard_totals, tenant_totals
from cachestore.errors import StoreError
from cachestore.eviction import score_ms
from cachestore.hashing import HASH_BYTES, BlockHash
from cachestore.keys import ENTRY_KINDS, KeySpace
from cachestore.sessions import SessionRecord, from_fields

Progress = Callable[[int], None]
SCAN_COUNT = 1000
BATCH = 256
# session fields that are small; token_ids, messages and partial are measured, not fetched
_SESSION_SUMMARY = ("model", "n_tokens", "version", "created_at", "updated_at")


def text(raw: Any) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def is_cluster(client: Any) -> bool:
    return hasattr(client, "get_primaries")


@dataclass(frozen=True)
class BlockKey:
    """A parsed block key; `reachable` is False when its hash tag is not the shard its hash maps to."""

    key: str
    model: str
    block_hash: BlockHash
    shard: int
    reachable: bool
    kind: str = "blk"  # blk | tail | ids | bnd (keys.ENTRY_KINDS)


def parse_block_key(keys: KeySpace, key: str) -> BlockKey | None:
    """`<ns>:<blk|tail|ids|bnd>:<model16>:<hash32hex>:{<ns>:sNN}` -> BlockKey, or None if it is not one."""
    kind = next((k for k in ENTRY_KINDS if key.startswith(f"{keys.namespace}:{k}:")), None)
    if kind is None:
        return None
    prefix = f"{keys.namespace}:{kind}:"
    body, sep, tag = key[len(prefix):].rpartition(":{")
    model, _, hex_hash = body.partition(":")
    if not sep or not model or len(hex_hash) != 2 * HASH_BYTES:
        return None
    try:
        block_hash = BlockHash(bytes.fromhex(hex_hash))
    except ValueError:
        return None
    shard = keys.shard_of(block_hash)
    try:
        _, expected = keys.block(model, block_hash, kind)
    except StoreError:  # a malformed model id
        return None
    return BlockKey(key, model, block_hash, shard, expected == key, kind)


def classify(keys: KeySpace, key: str) -> str:
    """block | tail | ids | boundary | index | session | plan | other (a key of the namespace kvstash does not
    write)."""
    ns = keys.namespace
    if key.startswith(f"{ns}:blk:"):
        return "block"
    if key.startswith(f"{ns}:tail:"):
        return "tail"
    if key.startswith(f"{ns}:ids:"):
        return "ids"
    if key.startswith(f"{ns}:bnd:"):
        return "boundary"
    if key.startswith(f"{ns}:idx:"):
        return "index"
    if key.startswith(f"{ns}:sess:"):
        return "session"
    if key.startswith(f"{ns}:plan:"):
        return "plan"
    return "other"


async def scan(client: Any, pattern: str, progress: Progress | None = None) -> AsyncIterator[str]:
    """Every key matching `pattern` on every primary (SCAN, COUNT 1000); may repeat a key, as SCAN does."""
    seen = 0
    async for raw in client.scan_iter(match=pattern, count=SCAN_COUNT):
        seen += 1
        if progress is not None and seen % SCAN_COUNT == 0:
            progress(seen)
        yield text(raw)
    if progress is not None:
        progress(seen)


async def scan_batches(client: Any, pattern: str, progress: Progress | None = None,
                       size: int = BATCH) -> AsyncIterator[list[str]]:
    """Distinct keys matching `pattern`, in batches of at most `size` (SCAN may repeat a key)."""
    seen: set[str] = set()
    batch: list[str] = []
    async for key in scan(client, pattern, progress):
        if key in seen:
            continue
        seen.add(key)
        batch.append(key)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


async def server_info(client: Any) -> dict[str, Any]:
    """Counters of INFO summed over every primary, plus the memory policy of the first."""
    sections: list[dict[str, Any]] = []
    if is_cluster(client):
        for node in client.get_primaries():
            sections.append(await client.info(target_nodes=node))
    else:
        sections.append(await client.info())
    flat = [s for s in sections if isinstance(s, dict)]
    summed: dict[str, Any] = {name: sum(int(s.get(name, 0)) for s in flat) for name in (
        "keyspace_hits", "keyspace_misses", "evicted_keys", "expired_keys", "used_memory", "maxmemory")}
    summed["primaries"] = len(flat)
    summed["maxmemory_policy"] = text(flat[0].get("maxmemory_policy", "")) if flat else ""
    summed["redis_version"] = text(flat[0].get("redis_version", "")) if flat else ""
    return summed


@dataclass(frozen=True)
class SessionInfo:
    """One session record as `sessions` lists it (sizes, not contents)."""

    tenant: str
    session_id: str
    model: str
    n_tokens: int
    version: int
    created_at: float
    updated_at: float
    messages_bytes: int
    partial_bytes: int
    ttl_s: float | None  # None: no TTL set

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(raw: Any, default: int = 0) -> int:
    try:
        return int(text(raw))
    except (TypeError, ValueError):
        return default


def _float(raw: Any) -> float:
    try:
        value = float(text(raw))
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) else 0.0


def ttl_seconds(pttl: Any) -> float | None:
    ms = _int(pttl, -1)
    return None if ms < 0 else ms / 1000.0


async def session_infos(client: Any, keys: KeySpace, tenant: str | None = None,
                        progress: Progress | None = None, limit: int = 100_000) -> list[SessionInfo]:
    """Every session of the namespace (or of one tenant), sorted by tenant and id."""
    found: list[SessionInfo] = []
    async for batch in scan_batches(client, keys.session_pattern(tenant), progress):
        named = [(k, p) for k in batch if (p := keys.parse_session(k)) is not None]
        pipe = client.pipeline(transaction=False)
        for key, _ in named:
            pipe.hmget(key, *_SESSION_SUMMARY)
            pipe.hstrlen(key, "messages")
            pipe.hstrlen(key, "partial")
            pipe.pttl(key)
        results = await pipe.execute()
        for i, (_, (ten, sid)) in enumerate(named):
            fields, msg_len, partial_len, pttl = results[4 * i:4 * i + 4]
            if fields is None or all(f is None for f in fields):
                continue  # expired between SCAN and now
            model, n_tokens, version, created, updated = fields
            found.append(SessionInfo(ten, sid, text(model or b""), _int(n_tokens), _int(version),
                                     _float(created), _float(updated), int(msg_len), int(partial_len),
                                     ttl_seconds(pttl)))
        if len(found) >= limit:
            break
    return sorted(found, key=lambda s: (s.tenant, s.session_id))[:limit]


async def read_session(client: Any, keys: KeySpace, tenant: str,
                       session_id: str) -> tuple[SessionRecord | None, dict[bytes, bytes], float | None]:
    """(parsed record or None if malformed, the raw hash, TTL in seconds); the raw hash is {} if absent.

    A plain read: unlike a pod's read it does not slide the session's TTL."""
    key = keys.session(tenant, session_id)
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(key)
    pipe.pttl(key)
    raw, pttl = await pipe.execute()
    raw = {(k if isinstance(k, bytes) else str(k).encode()): v for k, v in (raw or {}).items()}
    if not raw:
        return None, {}, None
    return from_fields(raw, tenant, session_id), raw, ttl_seconds(pttl)


async def _memory(client: Any, batch: Sequence[str]) -> list[int]:
    pipe = client.pipeline(transaction=False)
    for key in batch:
        pipe.memory_usage(key, samples=0)
    return [_int(v) for v in await pipe.execute(raise_on_error=False)]


async def namespace_stats(client: Any, keys: KeySpace, budget_bytes: int,
                          progress: Progress | None = None) -> dict[str, Any]:
    """Keys and bytes by kind and by model, budget use, server counters, oldest and newest entries."""
    kinds: dict[str, dict[str, int]] = {k: {"keys": 0, "bytes": 0}
                                        for k in ("block", "tail", "ids", "boundary", "index", "session", "plan",
                                                  "other")}
    models: dict[str, dict[str, int]] = defaultdict(lambda: {"blocks": 0, "block_bytes": 0, "sessions": 0})
    tenants: dict[str, int] = defaultdict(int)
    times: dict[str, float | None] = {"session_created_min": None, "session_updated_max": None}
    async for batch in scan_batches(client, f"{keys.namespace}:*", progress):
        memory = await _memory(client, batch)
        blocks = [(k, parse_block_key(keys, k)) for k in batch if classify(keys, k) == "block"]
        sessions: list[tuple[str, tuple[str, str] | None]] = [
            (k, keys.parse_session(k)) for k in batch if classify(keys, k) == "session"]
        pipe = client.pipeline(transaction=False)
        for key, _ in blocks:
            pipe.strlen(key)
        for key, _ in sessions:
            pipe.hmget(key, "model", "created_at", "updated_at")
        results = await pipe.execute(raise_on_error=False)
        for key, size in zip(batch, memory, strict=True):
            kind = kinds[classify(keys, key)]
            kind["keys"] += 1
            kind["bytes"] += size
        for (_, parsed), length in zip(blocks, results[:len(blocks)], strict=True):
            model = models[parsed.model if parsed else "(malformed)"]
            model["blocks"] += 1
            model["block_bytes"] += _int(length)
        for (_, owner), fields in zip(sessions, results[len(blocks):], strict=True):
            if not isinstance(fields, list) or fields[0] is None:
                continue
            models[text(fields[0])]["sessions"] += 1
            if owner is not None:
                tenants[owner[0]] += 1
            created, updated = _float(fields[1]), _float(fields[2])
            low, high = times["session_created_min"], times["session_updated_max"]
            times["session_created_min"] = created if low is None else min(low, created)
            times["session_updated_max"] = updated if high is None else max(high, updated)
    held = sum(await shard_totals(client, keys))
    by_tenant = await tenant_totals(client, keys)
    access = await _lru_range(client, keys)
    dead = await dead_entries(client, keys)
    return {
        "namespace": keys.namespace,
        "kinds": kinds,
        "budget": {"bytes_held": held, "budget_bytes": budget_bytes,
                   "fraction": held / budget_bytes if budget_bytes else 0.0,
                   "block_value_bytes": sum(m["block_bytes"] for m in models.values()),
                   "dead_blocks": dead.blocks, "dead_bytes": dead.bytes},
        "models": dict(sorted(models.items())),
        "tenants": dict(sorted(tenants.items())),
        "tenant_bytes": by_tenant,
        "oldest_block_access": access[0],
        "newest_block_access": access[1],
        "oldest_session_created": times["session_created_min"],
        "newest_session_updated": times["session_updated_max"],
        "server": await server_info(client),
    }


async def _lru_range(client: Any, keys: KeySpace) -> tuple[float | None, float | None]:
    """Least and most recent block access (seconds since the epoch) over every shard's LRU index."""
    pipe = client.pipeline(transaction=False)
    for shard in keys.all_shards():
        pipe.zrange(shard.lru, 0, 0, withscores=True)
        pipe.zrange(shard.lru, -1, -1, withscores=True)
    scores = [score_ms(float(entry[0][1])) / 1000.0 for entry in await pipe.execute() if entry]
    return (min(scores), max(scores)) if scores else (None, None)
