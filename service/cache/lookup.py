"""Lookup: what the cache holds for a prompt, read from Redis in pipelined chunks while it is dequantized.

`Lookup` is the interface the request path uses (`RedisLookup` here; the sticky baseline of service.cache.sticky behind
the same one). A lookup plans how many blocks to read (service.cache.fetchplan), reads them on a reader thread
(`_read_blocks`) into the places service.cache.placement gives, verifies them through the one gate
(service.cache.framegate),
dequantizes them (service.cache.rehydrate) and extends the hit with a tail or the session's partial block
(service.cache.partials). Redis failing or out of time is a "bypass": the pod recomputes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Generator, Sequence
from dataclasses import replace
from typing import Any, Protocol

from cachestore.hashing import BlockHash
from cachestore.outcome import Result
from cachestore.sessions import SessionRecord
from cachestore.store import BlockStore
from cachestore.tails import reply_digest
from cachestore.wire import Target
from service.cache.cacheview import CacheView, bypass
from service.cache.chain import Chain
from service.cache.fetchplan import FetchPlanner
from service.cache.framegate import FrameGate
from service.cache.partials import Partials
from service.cache.placement import Lease, Placement
from service.cache.readreport import ReadReport
from service.cache.rehydrate import Rehydration
from service.engines import Engine, Generation
from service.runtime import threads
from service.runtime.metrics import PodMetrics
from service.settings import PodSettings

log = logging.getLogger("kvstash.lookup")
# Blocks per pipelined read: small enough that decoding one chunk overlaps the next chunk's read,
# large enough that round trips stay few.
FETCH_CHUNK_BLOCKS = 8
LAST_CHUNK_BLOCKS = 2  # a short final chunk: little is left to dequantize once the last bytes arrive


def chunk_plan(blocks: int, size: int = FETCH_CHUNK_BLOCKS, last: int = LAST_CHUNK_BLOCKS) -> list[range]:
    """Consecutive block ranges covering `blocks`: `size` blocks each, then a final chunk of `last`."""
    if blocks <= size:
        return [range(0, blocks)] if blocks else []
    body = blocks - last
    plan = [range(i, min(body, i + size)) for i in range(0, body, size)]
    return [*plan, range(body, blocks)]


def publish_estimates(planner: FetchPlanner, metrics: PodMetrics) -> None:
    """The fetch plan's current link and prefill estimates, as gauges."""
    metrics.link_estimate.set(planner.link_bytes_s or 0.0)
    metrics.prefill_estimate.set(planner.prefill_tokens_s or 0.0)


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("a block reader failed: %r", future.exception())


async def _nothing() -> None:
    return None


class Lookup(Protocol):
    """What the request path asks of a cache: what it holds for a prompt, and what it keeps of a generation."""

    async def lookup(
        self, tenant_salt: bytes, prompt_ids: list[int], *, session: SessionRecord | None = None,
        session_key: tuple[str, str] | None = None, tenant: str | None = None,
    ) -> tuple[CacheView, SessionRecord | None]:
        """The prompt's cached KV (and the session record named by `session_key`, read along)."""
        ...

    async def known_replies(self, tenant_salt: bytes, messages: list[dict[str, str]]) -> dict[int, list[int]]:
        """Assistant messages whose exact text some pod generated: message index -> the generated ids."""
        ...

    def keep_from(self, view: CacheView) -> int:
        """The first token whose KV a write-back after `view` needs."""
        ...

    def remember(self, view: CacheView, gen: Generation) -> None:
        """After a generation on `view` (event loop): keep what the cache keeps itself, if anything."""
        ...

    def close(self) -> None: ...


class RedisLookup:
    """The lookup of a pod with Redis (or with no cache at all: `store` None, every view a bypass)."""

    def __init__(self, settings: PodSettings, engine: Engine, store: BlockStore | None, chain: Chain,
                 model_key: str, gate: FrameGate, placement: Placement, planner: FetchPlanner,
                 metrics: PodMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.store = store
        self.chain = chain
        self.model_key = model_key
        self.block_tokens = chain.block_tokens
        self.gate = gate
        self.placement = placement
        self.partials = Partials(gate, metrics, chain.block_tokens, model_key)
        self.planner = planner
        self.metrics = metrics
        # one rehydration per lookup, each on its own thread while its lookup is fed, and one reader feeding it
        self._decoder = threads.io_executor(2 * engine.parallel + 6, "kvstash-decode")
        self._readers = threads.io_executor(2 * engine.parallel + 6, "kvstash-read")
        self._looking_up = 0  # lookups in flight (on the event loop): one alone gets a second thread for its tail

    def close(self) -> None:
        self._decoder.shutdown(wait=False, cancel_futures=True)
        self._readers.shutdown(wait=False, cancel_futures=True)

    def keep_from(self, view: CacheView) -> int:
        """The blocks this hit read are in Redis: a write-back starts after them."""
        return view.held_blocks * self.block_tokens

    def remember(self, view: CacheView, gen: Generation) -> None:
        """Redis keeps what the write-back stores: nothing here."""

    async def lookup(
        self,
        tenant_salt: bytes,
        prompt_ids: list[int],
        *,
        session: SessionRecord | None = None,
        session_key: tuple[str, str] | None = None,
        tenant: str | None = None,
    ) -> tuple[CacheView, SessionRecord | None]:
        """The prompt's cached blocks (and the session record named by `session_key`, fetched
        concurrently); the session's partial block extends a full hit.

        A reader thread reads the blocks in pipelined chunks (`chunk_plan`), back to back on a blocking client
        (it moves large values with far less CPU than the event loop). For a
        layer-by-layer engine the frames land in one pooled buffer and the reader verifies each chunk itself; the
        forward step dequantizes a layer of every block at a time from there (service.cache.rehydrate).
        For any other engine they land likewise, and a `Rehydration` thread verifies and dequantizes each chunk
        as it arrives, straight into one preallocated context. Token-row frames for llama.cpp are received into
        the rows of the sequence state it lent, checksummed as they arrive, and the reader verifies each chunk:
        nothing is left to dequantize (`Placement.landing_for`). The hit is known when the last chunk is verified;
        what is not dequantized by then is handed to the engine through the view's `ready` gate, and the pooled
        buffers go with the view's `lease`.
        """
        if self.store is None or self.store.breaker_state == "open":
            return bypass(), session
        usable = len(prompt_ids) - 1  # the last prompt token is always re-fed for logits
        hashes = self.chain.hashes(tenant_salt, prompt_ids[:usable])
        local, local_bytes = self.store.held_locally(self.model_key, hashes)
        planned = local + self._plan(len(hashes) - local)
        if planned == 0 and hashes:  # reading any of them would take longer than prefilling them
            return await self._recompute(tenant_salt, prompt_ids, hashes, session, session_key, tenant)
        shortened = planned < len(hashes)  # then neither the prompt's tail nor the session's partial block follow
        hashes = hashes[:planned]
        b = self.block_tokens
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        deadline = loop.time() + self.settings.redis_timeout_s
        chunks = [hashes[r.start:r.stop] for r in chunk_plan(len(hashes))]
        tail_parent = self.chain.parent(tenant_salt, hashes, len(hashes))
        wants_tail = not shortened and len(hashes) * b < usable
        tail_task: asyncio.Future[bytes | None] | None = None

        def last_chunk_sent(_: object) -> None:  # on the loop: the prompt's tail goes along with the last chunk
            nonlocal tail_task
            if wants_tail and tail_task is None and not stop.is_set():
                tail_task = asyncio.ensure_future(self._fetch_tail(tail_parent))

        out = self.placement.context_for(prompt_ids)  # a hit fills at most `usable` tokens; views are handed on
        decode_seconds = self.metrics.codec_seconds.labels("decode")
        stage, slots = self.placement.landing_for(len(hashes), out)
        # nothing to dequantize while the frames come in: a layer-by-layer engine reads them from the landing, and
        # token rows received into the engine's state are in place already
        inline = slots is not None and (self.engine.layerwise or stage is None)
        # what is left to dequantize once the last chunk is in is shared with a second thread only by a lookup that
        # has the pod to itself: beside others' threads it would only take a core from them (nothing is awaited from
        # here to the count below, so no other lookup starts in between)
        alone = self._looking_up == 0
        rehydration = Rehydration(out, b, self.gate.open_block, layerwise=self.engine.layerwise,
                                  on_decoded=decode_seconds.observe, landing=stage,
                                  helper=self._decoder if alone else None)
        report = ReadReport(loop)  # what the threads below tell this loop
        report.last.add_done_callback(last_chunk_sent)
        stop = threading.Event()
        # the reader goes first: the first chunk is on the wire before anything else is computed;
        # frames that land are only verified during the fetch: the reader does it between chunks, on its own thread
        reader = loop.run_in_executor(self._readers, self._read_blocks, chunks, slots, rehydration, stop,
                                      time.monotonic() + (deadline - loop.time()), report, inline)
        worker = reader if inline else loop.run_in_executor(self._decoder, rehydration.run, report.frames_verified)
        if not chunks:
            last_chunk_sent(None)
        fetch_session = self._read_session(*session_key) if session_key else _nothing()
        lease = Lease(self.placement, out, stage, (reader, worker))  # the hit's, or back to the pools below
        view = bypass()
        self._looking_up += 1
        try:
            try:
                head, fetched_session = await asyncio.wait_for(asyncio.gather(report.first, fetch_session),
                                                               self.settings.redis_timeout_s)
            except TimeoutError:
                return view, session
            session = session or fetched_session
            if head is not None and head.unavailable:  # Redis failed: recompute
                return view, session
            try:  # the last chunk verified, or out of time: then what already arrived
                await asyncio.wait_for(asyncio.shield(reader), max(0.0, deadline - loop.time()))
            except TimeoutError:
                stop.set()
            rehydration.end()
            hit_blocks, fetched = await report.verified
            self._observe_fetch(hit_blocks - local, fetched - local_bytes, time.perf_counter() - t0)
            if slots is not None and stage is None:  # token rows received into the engine's state
                self.engine.mark_placed(out, hit_blocks * b)
            tail = None if shortened else await self._tail(tail_task, hit_blocks, len(hashes), hashes, tenant_salt,
                                                           usable, session, deadline)  # a prefetched tail of
            # another parent is cancelled below
            self.metrics.redis_seconds.labels("lookup").observe(time.perf_counter() - t0)
            if tail is None and not self.partials.continues(session, hit_blocks):
                view = self.partials.view(out, hit_blocks, fetched, session, prompt_ids, usable)
            else:  # decoding a tail or a session's partial block: off the event loop
                view = await asyncio.to_thread(self.partials.view, out, hit_blocks, fetched, session, prompt_ids,
                                               usable, tail)
            if view.kv is not None:  # the pipeline releases the lease after generation
                view = replace(view, ready=rehydration.gate, lease=lease)
        finally:
            self._looking_up -= 1
            stop.set()
            reader.add_done_callback(_log_failure)  # awaited above unless the lookup gave up first
            if tail_task is not None:
                tail_task.cancel()  # a no-op once done
            rehydration.end()  # a second end after the first is never read: harmless
            if view.lease is None:  # no hit: back to the pools once both threads are done with them
                lease.release_after()
        return replace(view, salt=tenant_salt, tenant=tenant), session

    async def _read_session(self, tenant: str, session_id: str) -> SessionRecord | None:
        assert self.store is not None
        return (await self.store.read_session(tenant, session_id)).value

    def _plan(self, remote: int) -> int:
        """How many of `remote` blocks (after those held locally) to read: the fetch plan's, counted."""
        if remote <= 0:
            return 0
        plan = self.planner.plan(remote, self.placement.block_bytes)
        self.metrics.fetch_plans.labels(plan.decision).inc()
        if plan.decision == "shortened":
            self.metrics.fetch_skipped_blocks.inc(remote - plan.blocks)
        return plan.blocks

    async def _recompute(
        self, tenant_salt: bytes, prompt_ids: list[int], hashes: list[BlockHash], session: SessionRecord | None,
        session_key: tuple[str, str] | None, tenant: str | None,
    ) -> tuple[CacheView, SessionRecord | None]:
        """The lookup of a plan that reads nothing: only how many blocks Redis holds (so the write-back skips them)
        and the session record, in one concurrent round trip each."""
        assert self.store is not None
        fetch_session = self._read_session(*session_key) if session_key else _nothing()
        try:
            present, fetched_session = await asyncio.wait_for(
                asyncio.gather(self.store.count_present(self.model_key, hashes), fetch_session),
                self.settings.redis_timeout_s)
        except TimeoutError:
            return bypass(), session
        if present.unavailable:
            return bypass(), session or fetched_session
        self.metrics.fetch_skipped_blocks.inc(present.value)
        view = CacheView(None, 0, 0, "recompute" if present.value else "miss", stored_blocks=present.value,
                         salt=tenant_salt, tenant=tenant)
        return view, session or fetched_session

    def _observe_fetch(self, blocks: int, nbytes: int, seconds: float) -> None:
        """A lookup read `blocks` blocks from Redis (`nbytes`) in `seconds`, request to verified."""
        if blocks > 0:
            self.planner.observe_fetch(nbytes, blocks, seconds)
            publish_estimates(self.planner, self.metrics)

    def _read_blocks(
        self, chunks: list[list[BlockHash]], slots: Sequence[Target] | None, rehydration: Rehydration,
        stop: threading.Event, deadline: float, report: ReadReport, verifies: bool,
    ) -> None:
        """On a reader thread: each chunk in one blocking round trip, fed to the rehydration as it arrives, until a
        chunk comes back short, a frame is bad, the lookup gives up, or `deadline` (time.monotonic) passes; what
        happens goes to `report`. With `slots` (one per block), frames are received into them; with `verifies`, this
        thread verifies each chunk itself (`Rehydration.take`) and then runs the rehydration's end."""
        assert self.store is not None
        head: Result[list[bytes | Target]] | None = None
        store = self.store

        def each() -> Generator[Result[list[bytes | Target]], None, None]:  # closing it closes the store's reads
            if slots is not None:  # the next chunk is requested before this one is verified: it comes in meanwhile
                cuts = [sum(map(len, chunks[:i])) for i in range(len(chunks) + 1)]
                yield from store.fetch_chunks_blocking(self.model_key, chunks,
                                                       [slots[a:b] for a, b in zip(cuts, cuts[1:], strict=False)])
            else:
                yield from (store.fetch_blocking(self.model_key, chunk) for chunk in chunks)

        results = each()
        try:
            with contextlib.closing(results):
                if stop.is_set() or time.monotonic() >= deadline:
                    return
                if len(chunks) <= 1 + (slots is not None):
                    report.last_requested()  # the prompt's tail goes along
                for index, result in enumerate(results):
                    if index == 0:
                        head = result
                        report.first_read(head)
                    if verifies:
                        rehydration.take(result.value)
                    else:
                        rehydration.feed(result.value)
                    if len(result.value) < len(chunks[index]) or index + 1 == len(chunks):
                        break
                    if stop.is_set() or rehydration.stopped.is_set() or time.monotonic() >= deadline:
                        break
                    if index + 2 + (slots is not None) == len(chunks):
                        report.last_requested()
        finally:
            if head is None:
                report.first_read(None)
            rehydration.end()
            if verifies:
                rehydration.run(report.frames_verified)

    async def _tail(
        self, prefetched: asyncio.Future[bytes | None] | None, hit_blocks: int, blocks: int,
        hashes: list[BlockHash], tenant_salt: bytes, usable: int, session: SessionRecord | None, deadline: float,
    ) -> bytes | None:
        """The tokens after the last full block some pod computed: prefetched with the last chunk when every
        block hit, else one more short round trip (none when the session's partial block continues the hit)."""
        loop = asyncio.get_running_loop()
        if hit_blocks * self.block_tokens >= usable or self.partials.continues(session, hit_blocks):
            return None
        try:
            if prefetched is not None and hit_blocks == blocks:
                return await asyncio.wait_for(prefetched, max(0.0, deadline - loop.time()))
            if loop.time() >= deadline:
                return None
            parent = self.chain.parent(tenant_salt, hashes, hit_blocks)
            return await asyncio.wait_for(self._fetch_tail(parent), max(0.0, deadline - loop.time()))
        except TimeoutError:
            return None

    async def _fetch_tail(self, parent: BlockHash) -> bytes | None:
        assert self.store is not None
        return (await self.store.get_entries([self.store.keys.tail(self.model_key, parent)]))[0]

    async def known_replies(self, tenant_salt: bytes, messages: list[dict[str, str]]) -> dict[int, list[int]]:
        """Assistant messages whose exact text some pod generated: message index -> the generated ids
        (one round trip; only ids that decode to exactly the message's text, of this tenant and model)."""
        wanted = [(i, m["content"]) for i, m in enumerate(messages)
                  if m.get("role") == "assistant" and m.get("content")]
        if self.store is None or not wanted or self.store.breaker_state == "open":
            return {}
        root = self.chain.root(tenant_salt)
        keys = [self.store.keys.reply_ids(self.model_key, reply_digest(root, text)) for _, text in wanted]
        try:
            values = await asyncio.wait_for(self.store.get_entries(keys), self.settings.redis_timeout_s)
        except TimeoutError:
            return {}
        known: dict[int, list[int]] = {}
        for (index, text), value in zip(wanted, values, strict=True):
            if value is None:
                self.metrics.reply_ids.labels("absent").inc()
                continue
            ids = self.gate.reply_ids(value)
            if ids is None:
                continue
            if not ids or self.engine.decode(ids) != text:  # edited, forged or another tokenizer's
                self.metrics.reply_ids.labels("mismatch").inc()
                continue
            known[index] = ids
            self.metrics.reply_ids.labels("used").inc()
        return known
