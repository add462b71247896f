"""Block writes: frames (and tail and reply-ids entries) written under the namespace's byte budget and a tenant's
quota, evicting the eviction policy's lowest-scored entries first; the budget's usage, reconciliation and the
namespace's clearing."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachestore import budget
from cachestore.errors import StoreError, ValueTooLarge
from cachestore.eviction import RANKS, chain_facts
from cachestore.hashing import BlockHash
from cachestore.keys import check_model, check_tenant
from cachestore.outcome import Outcome, Result
from cachestore.stats import Usage
from cachestore.store.base import StoreBase
from cachestore.store.guard import Failed


@dataclass(frozen=True)
class Chain:
    """Where a batch of blocks sits in its chain: the depth of the first, each one's chain facts, and the parent's
    (shard, key) (None: the first block is a chain's first, or its parent is unknown)."""

    first: int
    facts: list[str]
    parent: tuple[int, str] | None


class BlockWriter(StoreBase):
    """The write side of the store, and its budget."""

    async def store_blocks(self, model: str, hashes: Sequence[BlockHash], frames: Sequence[bytes],
                           tenant: str | None = None, first_block: int = 0,
                           parent: BlockHash | None = None, prefix: Sequence[BlockHash] = ()) -> Result[int]:
        """Write blocks (present ones are left as they are): STORED (how many were new) or UNAVAILABLE (none
        written). `tenant`: whose they are (its quota applies, `usage().by_tenant` counts them); None: the
        namespace's, under its budget only. `hashes` are consecutive blocks of one chain from block `first_block`,
        whose parent (block `first_block - 1`) is `parent`: the eviction policy ranks blocks by their place in
        their chain, and a block whose parent is gone counts as dead. `prefix`: the chain's blocks before
        `first_block` (block 0 on; its last is the parent), when the caller knows them: if Redis lost the parent
        (a flush, a restart, an eviction) while this store's local tier holds the prefix's frames, the prefix is
        written again from them, then these blocks on it; otherwise blocks on a lost parent are not written (no
        lookup could reach them)."""
        if prefix:
            if len(prefix) != first_block or (parent is not None and parent != prefix[-1]):
                raise StoreError("prefix must be the chain's first_block blocks, its last the parent")
            parent = prefix[-1]
        check_model(model)
        if tenant is not None:
            check_tenant(tenant)
        if len(hashes) != len(frames):
            raise StoreError("store_blocks needs one frame per hash")
        limit = self.settings.max_value_bytes
        for frame in frames:
            if len(frame) + self._overhead > limit:
                raise ValueTooLarge(f"a block frame of {len(frame)} bytes exceeds max_value_bytes={limit}")
            if not frame:
                raise StoreError("a block frame cannot be empty")
        if not frames:
            return Result(Outcome.STORED, 0)
        keyed = [self.keys.block(model, h) for h in hashes]
        if self._local is not None:
            for (_, key), frame in zip(keyed, frames, strict=True):
                self._local.put(key, bytes(frame))
        chain = self._chain(model, hashes, first_block, parent)

        async def write() -> int | None | Failed:
            return await self._guard.run(lambda: self._write(keyed, frames, tenant=tenant, chain=chain),
                                         self.settings.write_timeout_s, write=True)

        async with self._put_lock:
            written = await write()
            if written is None and await self._restore(model, prefix, tenant):
                written = await write()
        if isinstance(written, Failed):
            return Result(Outcome.UNAVAILABLE, 0)
        if written is None:
            self._counters.add("lost_parent_writes")
        return Result(Outcome.STORED, written or 0)

    async def _restore(self, model: str, prefix: Sequence[BlockHash], tenant: str | None) -> bool:
        """Write the chain `prefix` (block 0 on) again from the local tier's frames, if it holds them all: Redis lost
        a block of it while this pod still holds it. Blocks Redis holds are left as they are."""
        if not prefix or self._local is None:
            return False
        keyed = [self.keys.block(model, h) for h in prefix]
        frames: list[bytes] = []
        for _, key in keyed:
            frame = self._local.peek(key)
            if frame is None:
                return False
            frames.append(frame)
        chain = self._chain(model, prefix, 0, None)
        restored = await self._guard.run(lambda: self._write(keyed, frames, tenant=tenant, chain=chain),
                                         self.settings.write_timeout_s, write=True)
        if isinstance(restored, Failed) or restored is None:
            return False
        self._counters.add("blocks_restored", restored)
        return True

    def _chain(self, model: str, hashes: Sequence[BlockHash], first_block: int, parent: BlockHash | None) -> Chain:
        """Where blocks `hashes` sit: from block `first_block`, on `parent` (None: the first is a chain's first)."""
        hexes = ([parent.hex()] if parent is not None else [""]) + [h.hex() for h in hashes[:-1]]
        return Chain(first_block, [chain_facts(first_block + i, p) for i, p in enumerate(hexes)],
                     self.keys.block(model, parent) if parent is not None else None)

    async def put_entries(self, keyed: Sequence[tuple[int, str]], values: Sequence[bytes],
                          tenant: str | None = None) -> int:
        """Write tail or reply-ids values, replacing what is there (the newest tail of a prefix wins),
        under the byte budget (and `tenant`'s quota) like blocks; returns how many were written, 0 if Redis
        failed."""
        if len(keyed) != len(values) or any(not v for v in values):
            raise StoreError("put_entries needs one non-empty value per key")
        for value in values:
            if len(value) + self._overhead > self.settings.max_value_bytes:
                raise ValueTooLarge(f"a value of {len(value)} bytes exceeds max_value_bytes")
        if not values:
            return 0
        async with self._put_lock:
            written = await self._guard.run(lambda: self._write(list(keyed), values, nx=False, tenant=tenant),
                                            self.settings.write_timeout_s, write=True)
        return 0 if isinstance(written, Failed) else written or 0

    async def _write(self, keyed: list[tuple[int, str]], frames: Sequence[bytes], nx: bool = True,
                     tenant: str | None = None, chain: Chain | None = None) -> int | None:
        items = [((shard, key), self._seal(key, frame)) for (shard, key), frame in zip(keyed, frames, strict=True)]
        scores: list[int] = []
        # a chained policy holds no block whose parent the index lacks (no lookup reaches it): one gone before this
        # write, none written; gone while it ran (another writer's eviction), the blocks go again (`_orphaned`)
        parent = chain.parent if chain is not None and self.policy.chained and self.settings.budget_enabled else None
        if self.settings.budget_enabled:
            quota = self.settings.quota_of(tenant) if tenant is not None else 0
            items = _fit_budget(items, min(quota, self.settings.budget_bytes) or self.settings.budget_bytes)
            parent_score = await self._make_room(sum(len(f) for _, f in items), tenant, quota, parent)
            if parent is not None and parent_score is None:
                return None  # the parent is gone: nothing written
            # entries off a chain (tails, reply ids) end one: they rank as its deepest
            scores = self.policy.write_scores(self.clock_ms(), chain.first if chain is not None else RANKS,
                                              len(items), parent_score)
        pipe = self._client.pipeline(transaction=False)
        by_shard: dict[int, list[str]] = defaultdict(list)
        replacing = False  # from a rejected value on, the chain's blocks were unreadable: all are replaced
        for (shard, key), frame in items:
            replacing = replacing or self._replaces(key)
            pipe.set(key, frame, px=self._block_ttl_ms, nx=nx and not replacing)
            by_shard[shard].append(key)
        if self.settings.budget_enabled:
            at = {key: i for i, ((_, key), _) in enumerate(items)}
            for shard, keys in by_shard.items():
                budget.account(pipe, self.keys.shard(shard), keys, self._index_ttl_ms, tenant,
                               [scores[at[k]] for k in keys],
                               [chain.facts[at[k]] for k in keys] if chain is not None else None, self.policy)
        ordered = parent is not None and not self._cluster
        if ordered:  # after the ACCOUNTs on this connection: an eviction of the parent before it is seen here
            assert parent is not None
            pipe.hexists(self.keys.shard(parent[0]).size, parent[1])
        self._counters.add("round_trips")
        results = await pipe.execute(raise_on_error=False)
        written = errors = nbytes = 0
        for ((_, _), frame), ok in zip(items, results, strict=False):
            if ok is True:
                written += 1
                nbytes += len(frame)
            elif isinstance(ok, Exception):
                errors += 1
        if parent is not None and await self._orphaned(parent, [k for k, _ in items], results[-1] if ordered else None):
            written = nbytes = 0
        self._counters.add_all(blocks_written=written, bytes_written=nbytes, errors=errors)
        return written

    async def _orphaned(self, parent: tuple[int, str], keyed: list[tuple[int, str]], indexed: Any) -> bool:
        """Whether the parent of the blocks `keyed` just written left the index while they were written (a Cluster
        asks now: its nodes answer a pipeline in no set order); if so they are removed again, with any block written
        on them. An evictor that took the parent after the question reaps them itself (budget.reap): its REAP runs
        after its EVICT, which ran after the question, which ran after these blocks' ACCOUNT."""
        if indexed is None:
            self._counters.add("round_trips")
            indexed = await self._client.hexists(self.keys.shard(parent[0]).size, parent[1])
        if isinstance(indexed, Exception) or indexed:
            return False
        self._count_eviction(await budget.drop(self._client, self.keys, keyed))
        return True

    async def _make_room(self, incoming: int, tenant: str | None = None, quota: int = 0,
                         parent: tuple[int, str] | None = None) -> int | None:
        """Evict the lowest-scored entries first if writing `incoming` bytes would cross a high watermark:
        `tenant`'s own if it would cross its `quota`'s (to the low watermark of its quota), then the namespace's if
        it would cross the budget's. Returns the score of entry `parent` (None: not asked, or not indexed), read in
        the same round trip."""
        s = self.settings
        self._counters.add("round_trips")
        held, own, parent_score = await budget.held(self._client, self.keys, tenant if quota else None, parent)
        if quota and own + incoming > s.high_watermark * quota:
            target = max(0, int(s.low_watermark * quota) - incoming)
            result = await budget.evict(self._client, self.keys, own - target, tenant=tenant,
                                        keep=parent[1] if parent else None, reap_dead=self.policy.chained)
            self._count_eviction(result, tenant_evictions=result.evicted_blocks)
            held -= result.evicted_bytes + result.stale_bytes
        if held + incoming <= s.high_watermark * s.budget_bytes:
            return parent_score
        # evict so that after this write the namespace sits at the low watermark
        target = max(0, int(s.low_watermark * s.budget_bytes) - incoming)
        self._count_eviction(await budget.evict(self._client, self.keys, held - target,
                                                keep=parent[1] if parent else None, reap_dead=self.policy.chained))
        return parent_score

    def _count_eviction(self, result: budget.EvictionResult, tenant_evictions: int = 0) -> None:
        self._counters.add_all(evictions=result.evicted_blocks, evicted_bytes=result.evicted_bytes,
                               stale_removed=result.stale_blocks, tenant_evictions=tenant_evictions)

    async def usage(self) -> Usage:
        """Bytes held (as accounted) against the budget."""

        async def read() -> Usage:
            pipe = self._client.pipeline(transaction=False)
            for shard in self.keys.all_shards():
                pipe.get(shard.bytes)
                pipe.zcard(shard.lru)
            flat = await pipe.execute()
            held = sum(max(int(v or 0), 0) for v in flat[0::2])
            return Usage(held, self.settings.budget_bytes, sum(int(v) for v in flat[1::2]), self.keys.shards,
                         await budget.tenant_totals(self._client, self.keys))

        return await self._admin(read)

    async def dead(self) -> budget.DeadEntries:
        """The blocks held whose chain is broken (unreachable), from the budget index: O(entries)."""
        return await self._admin(lambda: budget.dead_entries(self._client, self.keys))

    async def reconcile(self) -> budget.EvictionResult:
        """Drop index entries of blocks Redis removed itself and recount the bytes held."""
        result = await self._admin(lambda: budget.reconcile(self._client, self.keys, self._index_ttl_ms))
        self._counters.add("stale_removed", result.stale_blocks)
        return result

    async def clear_namespace(self) -> int:
        """Delete every key of this namespace (SCAN + UNLINK); returns how many."""

        async def clear() -> int:
            deleted = 0
            async for raw in self._client.scan_iter(match=f"{self.settings.namespace}:*", count=1000):
                deleted += int(await self._client.unlink(raw))
            return deleted

        if self._local is not None:
            self._local.clear()
        return await self._admin(clear)


def _fit_budget(items: list[Any], limit: int) -> list[Any]:
    """The longest prefix of the batch that fits in the whole budget or quota `limit` (normally all of it)."""
    total, keep = 0, 0
    for _, frame in items:
        if total + len(frame) > limit:
            break
        total += len(frame)
        keep += 1
    return items[:keep]
