"""The sticky-sessions baseline behind the lookup interface: KV this pod itself computed, kept in its memory.

What `kvstash serve --no-cache --memory-kv-bytes N` runs for benchmarks (service.cache.memkv holds the sequences): a hit
only on the pod that computed the prefix, so it pays only behind a balancer that keeps a session on one pod.
"""

from __future__ import annotations

import asyncio

from cachestore.codec.arrays import Array
from cachestore.sessions import SessionRecord
from service.cache.cacheview import CacheView
from service.cache.memkv import MemoryKV
from service.cache.placement import Lease, Placement
from service.engines import Engine, Generation
from service.runtime.metrics import PodMetrics


class StickyLookup:
    """A `Lookup` (service.cache.lookup) over this pod's own memory; Redis takes no part (the pod runs without it)."""

    def __init__(self, memory_bytes: int, engine: Engine, placement: Placement, metrics: PodMetrics) -> None:
        self.memory = MemoryKV(memory_bytes)
        self.engine = engine
        self.placement = placement
        self.metrics = metrics
        metrics.budget.set(self.memory.max_bytes)

    def close(self) -> None:
        """Nothing runs on threads of its own."""

    async def lookup(
        self, tenant_salt: bytes, prompt_ids: list[int], *, session: SessionRecord | None = None,
        session_key: tuple[str, str] | None = None, tenant: str | None = None,
    ) -> tuple[CacheView, SessionRecord | None]:
        """The longest prefix this pod itself computed, copied into a pooled buffer: the engine appends into the
        buffer it is handed (hfcache.GrowingLayer), and the kept tensor must never change. The copy is part of
        this TTFT; an engine-native prefix cache would not copy. No session record is read (there is no store)."""
        found = self.memory.find(tenant_salt, prompt_ids[:-1])  # the last prompt token is always re-fed
        if found is None:
            return CacheView(None, 0, 0, "miss", salt=tenant_salt), session
        n = found.tokens
        out = self.placement.context_for(prompt_ids)
        await asyncio.to_thread(_copy, out[:, :, :, :n], found.kv[:, :, :, :n])  # [L, 2, H, n, D]
        return CacheView(out[:, :, :, :n], n, 0, found.status, salt=tenant_salt,
                         lease=Lease(self.placement, out)), session

    async def known_replies(self, tenant_salt: bytes, messages: list[dict[str, str]]) -> dict[int, list[int]]:
        return self.memory.known_replies(tenant_salt, messages)

    def keep_from(self, view: CacheView) -> int:
        """The whole sequence: the baseline keeps it all in memory."""
        return 0

    def remember(self, view: CacheView, gen: Generation) -> None:
        """Keep what this generation computed in the pod's memory (event loop only)."""
        if view.salt is None:
            return
        self.memory.put(view.salt, gen.seq_ids, gen.kv)  # gen.kv is the engine's own fresh copy: handed over
        self.memory.remember_reply(view.salt, gen.text, gen.reply_ids, self.engine.decode)
        self.metrics.bytes_held.set(self.memory.bytes_held)
        self.metrics.entries_held.set(len(self.memory))


def _copy(dst: Array, src: Array) -> None:
    """dst = src, element by element (numpy arrays or torch tensors alike)."""
    dst[...] = src
