"""The request path of a pod, composed: look up what the cache holds, generate on the engine, write back.

One `Pipeline` per pod wires the pieces, each a module of its own in service/cache/: the hash chain (chain), the gate
for untrusted bytes (framegate), where a hit's bytes go (placement), the lookup (lookup, or the sticky baseline of
sticky behind the same interface) and the write-back (writeback). It owns the inference threads; admission is the
HTTP layer's (service.http.admission).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from cachestore.codec import Codec, OpenFrame
from cachestore.codec.arrays import Array
from cachestore.codec.blockcodec import BlockCodecs
from cachestore.errors import ConfigError
from cachestore.hashing import BlockHash
from cachestore.outcome import Outcome
from cachestore.sessions import SessionRecord
from cachestore.store import BlockStore
from cachestore.wire import Target
from service.cache.boundarylookup import BoundaryLookup
from service.cache.cacheview import CacheView
from service.cache.chain import Chain
from service.cache.fetchplan import FetchPlanner
from service.cache.framegate import FrameGate
from service.cache.lookup import Lookup, RedisLookup, publish_estimates
from service.cache.placement import Placement
from service.cache.sticky import StickyLookup
from service.cache.writeback import SessionWrite, WriteBack
from service.cache.writer import BackgroundWriter
from service.engines import Engine, Generation, GenParams, GenRequest
from service.runtime import threads
from service.runtime.metrics import PodMetrics
from service.settings import PodSettings


class Pipeline:
    """One per pod; owns the inference threads, and composes the lookup and the write-back.

    A request goes through its methods alone (`lookup`, `generate` or `in_engine`, `finish`), never through its parts:
    what they share per request is the `CacheView` the lookup returns."""

    def __init__(
        self,
        settings: PodSettings,
        engine: Engine,
        store: BlockStore | None,
        codec: Codec | BlockCodecs | str,
        metrics: PodMetrics,
        writer: BackgroundWriter | None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        geo = engine.geometry
        self.store = store if settings.cache_enabled else None
        # an engine that takes sequence states gets exact and fp16 frames as token rows: a hit is received in place
        self.codecs = (codec if isinstance(codec, BlockCodecs)
                       else BlockCodecs.for_spec(codec, rows=engine.kv_layout.row_frames,
                                                 rope=engine.kv_layout.rope))
        self.codecs.main.spec.check_model(geo.num_layers, geo.head_dim)  # refuse to start rather than drop writes
        self.metrics = metrics
        self.writer = writer
        self.block_tokens = settings.block_tokens
        self.fingerprint = engine.fingerprint(settings.block_tokens, self.codecs.name())
        self.model_key = self.fingerprint.short()
        self.chain = Chain(self.fingerprint, settings.block_tokens)
        # as many generations in flight as the engine runs at once (1 for hf; llama.cpp batches them)
        # An engine that runs torch on the calling thread gets the process's one compute thread
        # (service.runtime.threads);
        # llama.cpp computes on its own scheduler thread, and these threads only hand requests over.
        self._own_executor = not engine.runs_torch
        self._executor = (threads.io_executor(engine.parallel, "kvstash-infer") if self._own_executor
                          else threads.compute_executor())
        block_shape = (geo.num_layers, 2, geo.kv_heads, settings.block_tokens, geo.head_dim)
        # every block a signing store returns passed its MAC, which covers the frame's checksum
        signed = self.store is not None and self.store.signer is not None
        self.gate = FrameGate(self.codecs, block_shape, geo.dtype, metrics, engine, mac_verified=signed)
        self.placement = Placement(engine, self.codecs, settings.block_tokens, settings.max_tokens_limit, signed)
        # fetch or recompute: a hit is read only while reading a block beats prefilling it (service.cache.fetchplan)
        self.planner = FetchPlanner(settings.fetch_policy, settings.block_tokens, settings.redis_timeout_s,
                                    link_bytes_s=settings.link_bytes_s, prefill_tokens_s=settings.prefill_tokens_s)
        publish_estimates(self.planner, metrics)
        # the sticky-sessions baseline keeps KV in this pod's memory instead of Redis (the pod runs without it)
        redis = RedisLookup(settings, engine, self.store, self.chain, self.model_key, self.gate, self.placement,
                            self.planner, metrics)
        if engine.boundary_records and settings.memory_kv_bytes:
            raise ConfigError("memory_kv_bytes keeps full-attention KV only; this model has sliding-window or "
                              "recurrent layers")
        self.cache: Lookup = (
            StickyLookup(settings.memory_kv_bytes, engine, self.placement, metrics) if settings.memory_kv_bytes
            # sliding-window and hybrid models resume at boundary records (service.cache.boundarylookup)
            else BoundaryLookup(settings, engine, self.store, self.chain, self.model_key, self.gate, redis, metrics)
            if engine.boundary_records and self.store is not None else redis)
        self.writes = WriteBack(settings, engine, self.store, writer, self.chain, self.model_key, metrics)

    def close(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self.cache.close()

    @property
    def writes_back(self) -> bool:
        """Whether this pod keeps what it computes (a store, the cache enabled): else `finish` writes nothing."""
        return self.store is not None

    def decode(self, ids: list[int]) -> str:
        """The engine's text of `ids`."""
        return self.engine.decode(ids)

    def hashes(self, tenant_salt: bytes, token_ids: list[int]) -> list[BlockHash]:
        return self.chain.hashes(tenant_salt, token_ids)

    # -- lookup ------------------------------------------------------------------------------
    async def lookup(
        self,
        tenant_salt: bytes,
        prompt_ids: list[int],
        *,
        session: SessionRecord | None = None,
        session_key: tuple[str, str] | None = None,
        tenant: str | None = None,
    ) -> tuple[CacheView, SessionRecord | None]:
        """What the cache holds for the prompt (`Lookup.lookup`), counted."""
        view, session = await self.cache.lookup(tenant_salt, prompt_ids, session=session, session_key=session_key,
                                                tenant=tenant)
        self.metrics.lookups.labels(view.status).inc()
        self.metrics.prompt_tokens.labels("cached").inc(view.cached_tokens)
        self.metrics.prompt_tokens.labels("computed").inc(len(prompt_ids) - view.cached_tokens)
        self.metrics.bytes_fetched.inc(view.fetched_bytes)
        return view, session

    async def known_replies(self, tenant_salt: bytes, messages: list[dict[str, str]]) -> dict[int, list[int]]:
        """Assistant messages whose exact text some pod generated: message index -> the generated ids."""
        return await self.cache.known_replies(tenant_salt, messages)

    def landing_for(self, blocks: int, out: Array | None = None
                    ) -> tuple[Array | None, Sequence[Target] | None]:
        return self.placement.landing_for(blocks, out)

    def open_block(self, frame: bytes | Target, index: int) -> OpenFrame | None:
        return self.gate.open_block(frame, index)

    # -- generation --------------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: list[int],
        view: CacheView,
        params: GenParams,
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        early = self.writes.early_writer(asyncio.get_running_loop(), prompt_ids, view)
        request = GenRequest(prompt_ids, view.kv, params, on_text, early, view.ready, self.keep_from(view),
                             view.boundary)
        gen: Generation = await self.in_engine(view, self.engine.generate, request)
        self.metrics.ttft.labels(view.status).observe(gen.ttft_s)
        self.planner.observe_prefill(len(prompt_ids) - view.cached_tokens, gen.ttft_s)  # for the next fetch plans
        publish_estimates(self.planner, self.metrics)
        self.cache.remember(view, gen)
        return gen

    def keep_from(self, view: CacheView) -> int:
        """The first token whose KV a write-back after `view` needs (the lookup's `keep_from`)."""
        return self.cache.keep_from(view)

    # -- write-back --------------------------------------------------------------------------
    def record(self, tenant: str, session_id: str, messages: list[dict[str, Any]], gen: Generation,
               previous: SessionRecord | None) -> SessionRecord:
        """The record of a session after `gen` (`WriteBack.record`)."""
        return self.writes.record(tenant, session_id, messages, gen, previous)

    async def finish(self, tenant_salt: bytes, gen: Generation, view: CacheView, session: SessionWrite | None = None,
                     prompt_tokens: int = 0) -> Outcome:
        """Write back a finished generation on `view` and wait for it within the write budget (`WriteBack.finish`):
        STORED, CONFLICT (a strict session record changed meanwhile) or UNAVAILABLE."""
        return await self.writes.finish(tenant_salt, gen, view, session, prompt_tokens)

    async def in_engine(self, view: CacheView, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the engine's threads (where it may read `view`'s KV), then `view`'s lease released: its pooled
        buffers back to their pools once it and the rehydration are done, even if the caller is cancelled meanwhile."""
        work = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        if view.lease is not None:
            view.lease.release_after(work)
        return await work
