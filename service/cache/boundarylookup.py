"""The lookup of a sliding-window or hybrid model: the longest boundary of the prompt with its blocks and a record.

Such a model resumes only at a boundary P some pod stopped at (service.cache.boundaries): every full block before P and
the boundary record at P. One concurrent round trip reads the records under the chain root and every block hash of
the prompt, the prompt's blocks Redis holds (blocks past the last record are present only where another
continuation left them) and the session record; the longest candidate whose blocks and record are what this pod
writes is decoded into one tensor. A record or block that is missing, corrupt or another layout's ends the hit at
an earlier boundary, or makes it a miss.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from cachestore.codec.arrays import empty
from cachestore.sessions import SessionRecord
from cachestore.store import BlockStore
from service.cache import boundaries
from service.cache.cacheview import CacheView, bypass
from service.cache.chain import Chain
from service.cache.framegate import FrameGate, Rejection
from service.cache.lookup import RedisLookup
from service.engines import Engine, Generation
from service.runtime.metrics import PodMetrics
from service.settings import PodSettings


class BoundaryLookup:
    """`Lookup` of a pod whose engine resumes at boundary records (`Engine.boundary_problem`)."""

    def __init__(self, settings: PodSettings, engine: Engine, store: BlockStore, chain: Chain, model_key: str,
                 gate: FrameGate, replies: RedisLookup, metrics: PodMetrics) -> None:
        self.settings, self.engine, self.store, self.chain = settings, engine, store, chain
        self.model_key, self.gate, self.metrics = model_key, gate, metrics
        self.block_tokens = chain.block_tokens
        self._replies = replies  # reply ids are read as for any other model

    def close(self) -> None:
        self._replies.close()

    def keep_from(self, view: CacheView) -> int:
        """The blocks before the boundary are in Redis: a write-back starts after them."""
        return view.held_blocks * self.block_tokens

    def remember(self, view: CacheView, gen: Generation) -> None:
        """Redis keeps what the write-back stores: nothing here."""

    async def known_replies(self, tenant_salt: bytes, messages: list[dict[str, str]]) -> dict[int, list[int]]:
        return await self._replies.known_replies(tenant_salt, messages)

    async def lookup(
        self,
        tenant_salt: bytes,
        prompt_ids: list[int],
        *,
        session: SessionRecord | None = None,
        session_key: tuple[str, str] | None = None,
        tenant: str | None = None,
    ) -> tuple[CacheView, SessionRecord | None]:
        if self.store.breaker_state == "open":
            return bypass(), session
        usable = len(prompt_ids) - 1  # the last prompt token is always re-fed for logits
        hashes = self.chain.hashes(tenant_salt, prompt_ids[:usable])
        keys = [self.store.keys.boundary(self.model_key, p)
                for p in boundaries.record_parents(self.chain.root(tenant_salt), hashes)]
        fetch_session = self._read_session(*session_key) if session_key else asyncio.sleep(0, None)
        t0 = time.perf_counter()
        try:
            values, blocks, fetched_session = await asyncio.wait_for(
                asyncio.gather(self.store.get_entries(keys), self.store.fetch(self.model_key, hashes), fetch_session),
                self.settings.redis_timeout_s)
        except TimeoutError:
            return bypass(), session
        session = session or fetched_session
        if blocks.unavailable:
            return bypass(), session
        found = boundaries.candidates(values, prompt_ids, usable, self.block_tokens,
                                      lambda detail: self.gate.reject(Rejection("corrupt", detail)))
        view = (await asyncio.to_thread(self._at_boundary, found, blocks.value, usable) if found
                else CacheView(None, 0, 0, "miss", stored_blocks=len(blocks.value)))
        self.metrics.redis_seconds.labels("lookup").observe(time.perf_counter() - t0)
        return replace(view, salt=tenant_salt, tenant=tenant), session

    async def _read_session(self, tenant: str, session_id: str) -> SessionRecord | None:
        return (await self.store.read_session(tenant, session_id)).value

    def _at_boundary(self, found: list[boundaries.Candidate], frames: list[bytes], usable: int) -> CacheView:
        """The view of the longest candidate whose blocks all decode and whose record is what this pod writes, its KV
        decoded into one tensor (only the blocks before that candidate's boundary)."""
        b, geo = self.block_tokens, self.engine.geometry
        out = empty((geo.num_layers, 2, geo.kv_heads, found[0].position, geo.head_dim), geo.dtype)
        decoded = 0  # leading blocks in `out`
        for candidate in found:
            record = candidate.record
            if candidate.blocks > len(frames):
                continue
            problem = self.engine.boundary_problem(record.state, candidate.position)
            if problem is not None:
                self.gate.reject(Rejection("model", f"boundary record: {problem}"))
                continue
            while decoded < candidate.blocks and self.gate.decode_into(frames[decoded], out, decoded * b, b, decoded):
                decoded += 1
            if decoded < candidate.blocks:
                frames = frames[:decoded]  # a bad block ends every longer candidate too
                continue
            start, n = candidate.blocks * b, len(record.token_ids)
            if n and not self.gate.decode_into(record.frame, out, start, n, candidate.blocks):
                continue
            fetched = sum(len(f) for f in frames[:candidate.blocks]) + candidate.nbytes
            status = "hit" if candidate.position >= (usable // b) * b else "partial"
            return CacheView(out[:, :, :, :candidate.position], candidate.position, candidate.blocks, status, fetched,
                             boundary=record.state)
        return CacheView(None, 0, 0, "miss", stored_blocks=decoded)
