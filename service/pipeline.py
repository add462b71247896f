"""The request path of a pod: look up cached KV, rehydrate it, prefill the rest, generate, write back."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from cachestore.blockcodec import BlockCodecs
from cachestore.codec import Codec, OpenFrame, PlacedFrame, read_header, verify_placed
from cachestore.errors import CodecError
from cachestore.frame import HEADER_SIZE, RunningChecksum
from cachestore.hashing import BlockHash, chain_hashes, root_hash
from cachestore.landing import Scatter, Target
from cachestore.outcome import Result
from cachestore.sessions import SessionRecord
from cachestore.store import BlockStore
from cachestore.tails import pack_ids, reply_digest, unpack_ids, unpack_tail
from service import threads
from service.contextpool import ContextPool, LandingPool
from service.engines import Engine, Generation, GenParams
from service.errors import overloaded
from service.fetchplan import FetchPlanner
from service.framecheck import Rejection, frame_problem
from service.memkv import MemoryKV
from service.metrics import PodMetrics
from service.rehydrate import LayerGate, Rehydration
from service.settings import PodSettings
from service.writer import BackgroundWriter, WriteJob

log = logging.getLogger("kvstash.pipeline")
# Blocks per pipelined read: small enough that decoding one chunk overlaps the next chunk's read,
# large enough that round trips stay few (8 x 64 SmolLM2 tokens of int8 = ~6 MB).
FETCH_CHUNK_BLOCKS = 8
LAST_CHUNK_BLOCKS = 2  # a short final chunk: little is left to dequantize once the last bytes arrive
MAX_REPLY_TOKENS = 8192  # replies longer than this are re-tokenized rather than remembered
LANDING_ALIGN = 64  # each frame's slot in a lookup's landing starts on a cache line
# compressors under which frames are mostly stored plainly (lz4 gains nothing on quantized KV), so their length is
# known before they are read: they land in place (a frame of another length is read and decoded as before)
LANDING_COMPRESSORS = frozenset({"none", "lz4"})


_NO_BYTES = torch.empty(0, dtype=torch.uint8)


class _Made(Sequence[Target]):
    """`make(i)` for i in [start, stop), made when read; a slice is another such sequence."""

    def __init__(self, make: Callable[[int], Target], start: int, stop: int) -> None:
        self._make, self._start, self._stop = make, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> Target: ...

    @overload
    def __getitem__(self, index: slice) -> _Made: ...

    def __getitem__(self, index: int | slice) -> Target | _Made:
        if isinstance(index, slice):
            first, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("slices of a _Made take no step")
            return _Made(self._make, self._start + first, self._start + max(first, stop))
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self._make(self._start + index % len(self))


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@dataclass
class CacheView:
    """What the cache contributed to one request."""

    kv: torch.Tensor | None  # [layers, 2, kv_heads, cached_tokens, head_dim]
    cached_tokens: int
    hit_blocks: int  # leading full blocks found in Redis
    status: str  # "hit" | "partial" | "miss" | "bypass" | "recompute" (Redis held blocks; prefilling them was faster)
    fetched_bytes: int = 0
    buffer: torch.Tensor | None = None  # the pooled buffer `kv` is a view of; back to the pool after generation
    salt: bytes | None = None  # the tenant's salt when the cache is writable: the prompt's blocks go early
    tenant: str | None = None  # whose entries the write-back stores (its quota applies); None: the namespace's
    early_blocks: int = 0  # blocks [hit_blocks, early_blocks) were queued while the reply was generated
    stored_blocks: int = 0  # leading blocks known to be in Redis though not read (a recompute plan): not rewritten
    ready: LayerGate | None = None  # layers of `kv` still being dequantized: the engine waits per layer
    landing: torch.Tensor | None = None  # the pooled buffer the frames were received into, read by `ready`'s work
    rehydrating: asyncio.Future[Any] | None = None  # the threads writing into `buffer` and `landing`, until done

    @property
    def held_blocks(self) -> int:
        """Leading blocks Redis holds already (read, or known to be there): a write-back starts after them."""
        return max(self.hit_blocks, self.stored_blocks)

    def complete(self) -> torch.Tensor | None:
        """`kv` with every layer in place (blocks the calling thread until then); engines wait on `ready`."""
        if self.ready is not None:
            self.ready.wait_all()
        return self.kv


def chunk_plan(blocks: int, size: int = FETCH_CHUNK_BLOCKS, last: int = LAST_CHUNK_BLOCKS) -> list[range]:
    """Consecutive block ranges covering `blocks`: `size` blocks each, then a final chunk of `last`."""
    if blocks <= size:
        return [range(0, blocks)] if blocks else []
    body = blocks - last
    plan = [range(i, min(body, i + size)) for i in range(0, body, size)]
    return [*plan, range(body, blocks)]


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("a block reader failed: %r", future.exception())


def _settle(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Pipeline:
    """One per pod; owns the inference thread, the admission bound and the write-back."""

    def __init__(
        self,
        settings: PodSettings,
        engine: Engine,
        store: BlockStore | None,
        codec: Codec | BlockCodecs,
        metrics: PodMetrics,
        writer: BackgroundWriter | None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.geometry = geo = engine.geometry
        self.store = store if settings.cache_enabled else None
        # an engine that takes sequence states gets exact and fp16 frames as token rows: a hit is received in place
        self.codecs = (codec if isinstance(codec, BlockCodecs)
                       else BlockCodecs.for_spec(codec, rows=getattr(engine, "row_frames", False)))
        self.codecs.main.spec.check_model(geo.num_layers, geo.head_dim)  # refuse to start rather than drop writes
        self.metrics = metrics
        self.writer = writer
        self.block_tokens = settings.block_tokens
        self.fingerprint = engine.fingerprint(settings.block_tokens, self.codecs.name())
        self.model_key = self.fingerprint.short()
        # as many generations in flight as the engine runs at once (1 for hf; llama.cpp batches them)
        # An engine that runs torch on the calling thread gets the process's one compute thread (service.threads);
        # llama.cpp computes on its own scheduler thread, and these threads only hand requests over.
        self._own_executor = not engine.runs_torch
        self._executor = (threads.io_executor(engine.parallel, "kvstash-infer") if self._own_executor
                          else threads.compute_executor())
        # one rehydration per lookup, each on its own thread while its lookup is fed, and one reader feeding it
        self._decoder = threads.io_executor(2 * engine.parallel + 6, "kvstash-decode")
        self._readers = threads.io_executor(2 * engine.parallel + 6, "kvstash-read")
        self._admitted = 0
        self._looking_up = 0  # lookups in flight (on the event loop): one alone gets a second thread for its tail
        self._roots: dict[str, BlockHash] = {}
        self._contexts = ContextPool(geo.num_layers, geo.kv_heads, geo.head_dim, geo.dtype,
                                     max_idle=max(2, engine.parallel))
        # [layers, 2, kv_heads, block_tokens, head_dim]
        self._block_shape = (geo.num_layers, 2, geo.kv_heads, settings.block_tokens, geo.head_dim)
        # frames stored plainly (int8, fp16 and exact under lz4 or none) are received into one buffer (one copy on the
        # wire, cachestore.landing), and a layer-by-layer engine dequantizes them from there a layer at a time
        # (service.rehydrate); block 0 may have its own codec
        self._slot_sizes = ((self.codecs.sink.plain_size(self._block_shape, geo.dtype),
                             self.codecs.main.plain_size(self._block_shape, geo.dtype))
                            if self.codecs.main.spec.compressor in LANDING_COMPRESSORS else None)
        self._landings = LandingPool(max_idle=max(2, engine.parallel))
        # fetch or recompute: a hit is read only while reading a block beats prefilling it (service.fetchplan)
        self.planner = FetchPlanner(settings.fetch_policy, settings.block_tokens, settings.redis_timeout_s,
                                    link_bytes_s=settings.link_bytes_s, prefill_tokens_s=settings.prefill_tokens_s)
        self._publish_estimates()
        # the sticky-sessions baseline: KV kept in this pod's memory instead of Redis
        self.memory = MemoryKV(settings.memory_kv_bytes) if settings.memory_kv_bytes else None
        if self.memory is not None:
            metrics.budget.set(self.memory.max_bytes)

    def close(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._decoder.shutdown(wait=False, cancel_futures=True)
        self._readers.shutdown(wait=False, cancel_futures=True)

    # -- admission ---------------------------------------------------------------------------
    def admit(self) -> None:
        """Admit a request or refuse it with 503 when `max_queue` are already admitted."""
        if self._admitted >= self.settings.max_queue:
            self.metrics.rejected.inc()
            raise overloaded(f"pod is busy ({self._admitted} requests admitted); retry shortly")
        self._admitted += 1
        self.metrics.inflight.set(self._admitted)

    def release(self) -> None:
        self._admitted -= 1
        self.metrics.inflight.set(self._admitted)

    # -- lookup ------------------------------------------------------------------------------
    def root(self, tenant_salt: bytes) -> BlockHash:
        """The parent of the tenant's first block (and the key of a tail shorter than one block)."""
        root = self._roots.get(tenant_salt.hex())
        if root is None:
            root = self._roots.setdefault(tenant_salt.hex(), root_hash(self.fingerprint, tenant_salt))
        return root

    def hashes(self, tenant_salt: bytes, token_ids: list[int]) -> list[BlockHash]:
        return chain_hashes(token_ids, self.block_tokens, self.root(tenant_salt))

    async def _none(self) -> None:
        return None

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
        forward step dequantizes a layer of every block at a time from there (service.rehydrate).
        For any other engine they land likewise, and a `Rehydration` thread verifies and dequantizes each chunk
        as it arrives, straight into one preallocated context. Token-row frames for llama.cpp are received into
        the rows of the sequence state it lent, checksummed as they arrive, and the reader verifies each chunk:
        nothing is left to dequantize (`landing_for`). The hit is known when the last chunk is verified;
        what is not dequantized by then is handed to the engine through the view's `ready` gate.
        """
        if self.memory is not None:
            return self._account(await self._memory_view(tenant_salt, prompt_ids), prompt_ids), session
        if self.store is None or self.store.breaker_state == "open":
            return self._account(CacheView(None, 0, 0, "bypass"), prompt_ids), session
        usable = len(prompt_ids) - 1  # the last prompt token is always re-fed for logits
        hashes = self.hashes(tenant_salt, prompt_ids[:usable])
        local, local_bytes = self.store.held_locally(self.model_key, hashes)
        planned = local + self._plan(len(hashes) - local)
        if planned == 0 and hashes:  # reading any of them would take longer than prefilling them
            return await self._recompute(tenant_salt, prompt_ids, hashes, session, session_key)
        shortened = planned < len(hashes)  # then neither the prompt's tail nor the session's partial block follow
        hashes = hashes[:planned]
        b = self.block_tokens
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        deadline = loop.time() + self.settings.redis_timeout_s
        chunks = [hashes[r.start:r.stop] for r in chunk_plan(len(hashes))]
        tail_parent = hashes[-1] if hashes else self.root(tenant_salt)
        wants_tail = not shortened and len(hashes) * b < usable
        tail_task: asyncio.Future[bytes | None] | None = None

        def last_chunk_sent() -> None:  # on the loop: the prompt's tail goes along with the last chunk
            nonlocal tail_task
            if wants_tail and tail_task is None and not stop.is_set():
                tail_task = asyncio.ensure_future(self._fetch_tail(tail_parent))

        out = self._context_for(prompt_ids)  # a hit fills at most `usable` tokens; views are handed on
        decode_seconds = self.metrics.codec_seconds.labels("decode")
        stage, slots = self.landing_for(len(hashes), out)
        # nothing to dequantize while the frames come in: a layer-by-layer engine reads them from the landing, and
        # token rows received into the engine's state are in place already
        inline = slots is not None and (self.engine.layerwise or stage is None)
        # what is left to dequantize once the last chunk is in is shared with a second thread only by a lookup that
        # has the pod to itself: beside others' threads it would only take a core from them (nothing is awaited from
        # here to the count below, so no other lookup starts in between)
        alone = self._looking_up == 0
        rehydration = Rehydration(out, b, self.open_block, layerwise=self.engine.layerwise,
                                  on_decoded=decode_seconds.observe, landing=stage,
                                  helper=self._decoder if alone else None)
        verified: asyncio.Future[tuple[int, int]] = loop.create_future()
        first: asyncio.Future[Result[list[bytes]] | None] = loop.create_future()
        stop = threading.Event()
        # the reader goes first: the first chunk is on the wire before anything else is computed
        def on_verified(n: int, nbytes: int) -> None:
            loop.call_soon_threadsafe(_settle, verified, (n, nbytes))

        # frames that land are only verified during the fetch: the reader does it between chunks, on its own thread
        reader = loop.run_in_executor(
            self._readers, self._read_blocks, chunks, slots, rehydration, stop,
            time.monotonic() + (deadline - loop.time()),
            lambda result: loop.call_soon_threadsafe(_settle, first, result),
            lambda: loop.call_soon_threadsafe(last_chunk_sent), on_verified if inline else None)
        worker = reader if inline else loop.run_in_executor(self._decoder, rehydration.run, on_verified)
        if not chunks:
            last_chunk_sent()
        fetch_session = self.store.get_session(*session_key) if session_key else self._none()
        given = False
        view = CacheView(None, 0, 0, "bypass")
        self._looking_up += 1
        try:
            try:
                head, fetched_session = await asyncio.wait_for(asyncio.gather(first, fetch_session),
                                                               self.settings.redis_timeout_s)
            except TimeoutError:
                return self._account(view, prompt_ids), session
            session = session or fetched_session
            if head is not None and head.unavailable:  # Redis failed: recompute
                return self._account(view, prompt_ids), session
            try:  # the last chunk verified, or out of time: then what already arrived
                await asyncio.wait_for(asyncio.shield(reader), max(0.0, deadline - loop.time()))
            except TimeoutError:
                stop.set()
            rehydration.end()
            hit_blocks, fetched = await verified
            self._observe_fetch(hit_blocks - local, fetched - local_bytes, time.perf_counter() - t0)
            if slots is not None and stage is None:  # token rows received into the engine's state
                mark = getattr(self.engine, "mark_placed", None)
                if mark is not None:
                    mark(out, hit_blocks * b)
            tail = None if shortened else await self._tail(tail_task, hit_blocks, len(hashes), hashes, tenant_salt,
                                                           usable, session, deadline)  # a prefetched tail of
            # another parent is cancelled below
            self.metrics.redis_seconds.labels("lookup").observe(time.perf_counter() - t0)
            if tail is None and not self._session_partial(session, hit_blocks):
                view = self._with_session(out, hit_blocks, fetched, session, prompt_ids, usable)
            else:  # decoding a tail or a session's partial block: off the event loop
                view = await asyncio.to_thread(self._with_session, out, hit_blocks, fetched, session, prompt_ids,
                                               usable, tail)
            if view.kv is not None:
                view.buffer, view.ready, view.landing = out, rehydration.gate, stage
                view.rehydrating = worker  # with a landing, the reader: it may still be receiving into it
                given = True
        finally:
            self._looking_up -= 1
            stop.set()
            reader.add_done_callback(_log_failure)  # awaited above unless the lookup gave up first
            if tail_task is not None:
                tail_task.cancel()  # a no-op once done
            rehydration.end()  # a second end after the first is never read: harmless
            if not given:  # back to the pool once both threads are done with them
                worker.add_done_callback(lambda _: self._give_context(out))
                if stage is not None:
                    reader.add_done_callback(lambda _: self._landings.give(stage))
        view.salt, view.tenant = tenant_salt, tenant
        return self._account(view, prompt_ids), session

    def _plan(self, remote: int) -> int:
        """How many of `remote` blocks (after those held locally) to read: the fetch plan's, counted."""
        if remote <= 0:
            return 0
        plan = self.planner.plan(remote, self._slot_sizes[1] if self._slot_sizes is not None else None)
        self.metrics.fetch_plans.labels(plan.decision).inc()
        if plan.decision == "shortened":
            self.metrics.fetch_skipped_blocks.inc(remote - plan.blocks)
        return plan.blocks

    async def _recompute(
        self, tenant_salt: bytes, prompt_ids: list[int], hashes: list[BlockHash], session: SessionRecord | None,
        session_key: tuple[str, str] | None,
    ) -> tuple[CacheView, SessionRecord | None]:
        """The lookup of a plan that reads nothing: only how many blocks Redis holds (so the write-back skips them)
        and the session record, in one concurrent round trip each."""
        assert self.store is not None
        fetch_session = self.store.get_session(*session_key) if session_key else self._none()
        try:
            present, fetched_session = await asyncio.wait_for(
                asyncio.gather(self.store.count_present(self.model_key, hashes), fetch_session),
                self.settings.redis_timeout_s)
        except TimeoutError:
            return self._account(CacheView(None, 0, 0, "bypass"), prompt_ids), session
        if present.unavailable:
            return self._account(CacheView(None, 0, 0, "bypass"), prompt_ids), session or fetched_session
        self.metrics.fetch_skipped_blocks.inc(present.value)
        view = CacheView(None, 0, 0, "recompute" if present.value else "miss", stored_blocks=present.value,
                         salt=tenant_salt)
        return self._account(view, prompt_ids), session or fetched_session

    def _observe_fetch(self, blocks: int, nbytes: int, seconds: float) -> None:
        """A lookup read `blocks` blocks from Redis (`nbytes`) in `seconds`, request to verified."""
        if blocks > 0:
            self.planner.observe_fetch(nbytes, blocks, seconds)
            self._publish_estimates()

    def _publish_estimates(self) -> None:
        self.metrics.link_estimate.set(self.planner.link_bytes_s or 0.0)
        self.metrics.prefill_estimate.set(self.planner.prefill_tokens_s or 0.0)

    def _read_blocks(
        self, chunks: list[list[BlockHash]], slots: Sequence[Target] | None, rehydration: Rehydration,
        stop: threading.Event, deadline: float, on_first: Callable[[Result[list[bytes | Target]] | None], None],
        on_last: Callable[[], None], on_verified: Callable[[int, int], None] | None = None,
    ) -> None:
        """On a reader thread: each chunk in one blocking round trip, fed to the rehydration as it arrives, until a
        chunk comes back short, a frame is bad, the lookup gives up, or `deadline` (time.monotonic) passes. With
        `slots` (one per block), frames are received into them; with `on_verified`, this thread verifies each chunk
        itself and then runs the rehydration's end (`Rehydration.take`)."""
        assert self.store is not None
        head: Result[list[bytes | Target]] | None = None
        results: Iterator[Result[list[bytes | Target]]]
        if slots is not None:  # the next chunk is requested before this one is verified: it comes in meanwhile
            cuts = [sum(map(len, chunks[:i])) for i in range(len(chunks) + 1)]
            results = self.store.fetch_chunks_blocking(self.model_key, chunks,
                                                       [slots[a:b] for a, b in zip(cuts, cuts[1:], strict=False)])
        else:
            results = (self.store.fetch_blocking(self.model_key, chunk) for chunk in chunks)
        try:
            with contextlib.closing(results):
                if stop.is_set() or time.monotonic() >= deadline:
                    return
                if len(chunks) <= 1 + (slots is not None):
                    on_last()  # the last chunk is (about to be) requested: the prompt's tail goes along
                for index, result in enumerate(results):
                    if index == 0:
                        head = result
                        on_first(head)
                    if on_verified is not None:
                        rehydration.take(result.value)
                    else:
                        rehydration.feed(result.value)
                    if len(result.value) < len(chunks[index]) or index + 1 == len(chunks):
                        break
                    if stop.is_set() or rehydration.stopped.is_set() or time.monotonic() >= deadline:
                        break
                    if index + 2 + (slots is not None) == len(chunks):
                        on_last()
        finally:
            if head is None:
                on_first(None)
            rehydration.end()
            if on_verified is not None:
                rehydration.run(on_verified)

    def landing_for(self, blocks: int, out: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor | None, Sequence[Target] | None]:
        """A pooled buffer the lookup's frames are received into, and each block's slot in it (64-byte aligned, at
        one stride after block 0, whose codec may differ); (None, None) when this pod's frames are compressed (their
        lengths vary). Token-row frames for a context the engine lent (`out`, a llama.cpp sequence state) land in it
        instead: (None, a `Scatter` per block, its header apart and its rows where the state holds them)."""
        if not blocks or self._slot_sizes is None:
            return None, None
        placed = self._rows_into(out, blocks) if out is not None else None
        if placed is not None:
            return None, placed
        sizes = [self._slot_sizes[0 if i == 0 else 1] for i in range(blocks)]
        offsets, end = [], 0
        for size in sizes:
            offsets.append(end)
            end += -(-size // LANDING_ALIGN) * LANDING_ALIGN
        stage = self._landings.take(end)
        view = memoryview(stage.numpy())
        return stage, [view[at:at + size] for at, size in zip(offsets, sizes, strict=True)]

    def _rows_into(self, out: torch.Tensor, blocks: int) -> Sequence[Target] | None:
        """Each block's `Scatter` into the context `out` an engine lent, when this pod writes uncompressed-length
        token rows of its element type (`CodecSpec.rows`); else None. Each is made when the reader asks for its chunk
        (~17 µs a block: 2 ms before the first request at 8128 tokens)."""
        rows_of = getattr(self.engine, "context_rows", None)
        codec, b = self.codecs.main, self.block_tokens
        if (rows_of is None or not codec.spec.rows or self.codecs.sink is not codec or out.dtype != self.geometry.dtype
                or rows_of(out, (blocks - 1) * b, b) is None):
            return None
        headers = memoryview(bytearray(HEADER_SIZE * blocks))

        def scatter(i: int) -> Target:
            rows = rows_of(out, i * b, b)
            assert rows is not None
            return Scatter([headers[i * HEADER_SIZE:(i + 1) * HEADER_SIZE], *rows], RunningChecksum())

        targets = _Made(scatter, 0, blocks)
        return targets if len(targets[0]) == self._slot_sizes[1] else None  # type: ignore[index]

    def _context_for(self, prompt_ids: list[int]) -> torch.Tensor:
        """Where a hit is dequantized: the engine's own context when it lends one (llama.cpp: a sequence state, set
        as it is), else a pooled [layers, 2, kv_heads, capacity, head_dim] buffer with room for the prompt and the
        longest reply, so generation appends in place (hfcache.GrowingLayer); pages never written are never touched."""
        lent = self.engine.context_for(len(prompt_ids) - 1)  # a hit fills at most the prompt but its last token
        if lent is not None:
            return lent
        return self._contexts.take(min(len(prompt_ids) + self.settings.max_tokens_limit,
                                       self.geometry.max_context + 1))

    def _give_context(self, buffer: torch.Tensor) -> None:
        if not self.engine.give_context(buffer):
            self._contexts.give(buffer)

    def _session_partial(self, session: SessionRecord | None, hit_blocks: int) -> bool:
        """Whether the session's partial block continues this hit (then it extends the hit)."""
        return (session is not None and session.model == self.model_key and bool(session.partial)
                and hit_blocks == len(session.token_ids) // self.block_tokens)

    async def _tail(
        self, prefetched: asyncio.Future[bytes | None] | None, hit_blocks: int, blocks: int,
        hashes: list[BlockHash], tenant_salt: bytes, usable: int, session: SessionRecord | None, deadline: float,
    ) -> bytes | None:
        """The tokens after the last full block some pod computed: prefetched with the last chunk when every
        block hit, else one more short round trip (none when the session's partial block continues the hit)."""
        loop = asyncio.get_running_loop()
        if hit_blocks * self.block_tokens >= usable or self._session_partial(session, hit_blocks):
            return None
        try:
            if prefetched is not None and hit_blocks == blocks:
                return await asyncio.wait_for(prefetched, max(0.0, deadline - loop.time()))
            if loop.time() >= deadline:
                return None
            parent = hashes[hit_blocks - 1] if hit_blocks else self.root(tenant_salt)
            return await asyncio.wait_for(self._fetch_tail(parent), max(0.0, deadline - loop.time()))
        except TimeoutError:
            return None

    def open_block(self, frame: bytes | Target, index: int) -> OpenFrame | None:
        """Block `index`'s frame verified and decompressed, or None (counted) if it is not what this pod
        would have written. A frame received as a `Scatter` (`landing_for`) is verified where its rows lie."""
        codec = self.codecs.at(index)
        if isinstance(frame, Scatter):
            return self._open_placed(frame, index)
        problem = frame_problem(frame, codec.spec, self._block_shape, self.geometry.dtype)
        if problem is not None:
            return self._reject(problem)
        try:
            return codec.open(frame, max_elements=math.prod(self._block_shape))
        except CodecError as exc:
            return self._reject(Rejection("corrupt", str(exc)))

    def _open_placed(self, frame: Scatter, index: int) -> OpenFrame | None:
        """A frame received into a lent context's rows, verified there; one of the same length in another layout
        (a pod that wrote head-major fp16) is gathered out of them and opened as bytes."""
        head, rows = frame.pieces[0], frame.pieces[1:]
        problem = frame_problem(head, self.codecs.at(index).spec, self._block_shape, self.geometry.dtype)
        if problem is not None:
            return self._reject(problem)
        apart = getattr(self.engine, "rows_apart", False)  # rows in a state beside the lent tensor (q8_0)
        if not read_header(head).rows:
            if apart:  # decoded into the tensor it would be missing from the state: never a wrong answer
                return self._reject(Rejection("codec", "a frame of another layout than the state's rows"))
            return self.open_block(frame.tobytes(), index)
        try:
            running = frame.filled  # the checksum of the bytes as they came in, unless some did not come that way
            digest = running.value() if isinstance(running, RunningChecksum) and running.fed == len(frame) else None
            header = verify_placed(head, rows, digest=digest, max_elements=math.prod(self._block_shape))
        except CodecError as exc:
            return self._reject(Rejection("corrupt", str(exc)))
        if apart:  # its place is the state alone: the tensor's tokens for it stay unwritten (`mark_placed`)
            return PlacedFrame(header, _NO_BYTES)
        at = [_address(piece) for piece in rows[:3:2]]  # layer 0's K rows, and layer 1's
        return PlacedFrame(header, _NO_BYTES, at=at[0], layer_stride=at[-1] - at[0])

    async def _memory_view(self, tenant_salt: bytes, prompt_ids: list[int]) -> CacheView:
        """The longest prefix this pod itself computed, copied into a pooled buffer: the engine appends into the
        buffer it is handed (hfcache.GrowingLayer), and the kept tensor must never change. The copy is part of
        this TTFT; an engine-native prefix cache would not copy."""
        assert self.memory is not None
        found = self.memory.find(tenant_salt, prompt_ids[:-1])  # the last prompt token is always re-fed
        if found is None:
            return CacheView(None, 0, 0, "miss", salt=tenant_salt)
        n = found.tokens
        out = self._context_for(prompt_ids)
        await asyncio.to_thread(out[:, :, :, :n].copy_, found.kv[:, :, :, :n])  # [L, 2, H, n, D]
        return CacheView(out[:, :, :, :n], n, 0, found.status, buffer=out, salt=tenant_salt)

    def _remember(self, view: CacheView, gen: Generation) -> None:
        """Keep what this generation computed in the pod's memory (the sticky baseline; event loop only)."""
        assert self.memory is not None and view.salt is not None
        self.memory.put(view.salt, gen.seq_ids, gen.kv)  # gen.kv is the engine's own fresh copy: handed over
        self.memory.remember_reply(view.salt, gen.text, gen.reply_ids, self.engine.decode)
        self.metrics.bytes_held.set(self.memory.bytes_held)
        self.metrics.entries_held.set(len(self.memory))

    async def _fetch_tail(self, parent: BlockHash) -> bytes | None:
        assert self.store is not None
        return (await self.store.get_entries([self.store.keys.tail(self.model_key, parent)]))[0]

    def _apply_tail(self, value: bytes, out: torch.Tensor, start: int, prompt_ids: list[int], usable: int) -> int:
        """Decode a tail of n tokens and place the KV of its first m in out[..., start:start + m], m being as many
        as the prompt continues (a token's KV depends only on the tokens up to it: the same prompt sent again
        reuses the tail its last request left, reply tokens and all, up to the prompt's end; an edited last
        message, up to the edit); returns m, or 0 when the tail is foreign, forged, corrupt or shares nothing."""
        try:
            tokens, frame = unpack_tail(value)
        except CodecError as exc:
            self._reject(Rejection("corrupt", f"tail: {exc}"))
            return 0
        n = len(tokens)
        take = common_prefix(tokens, prompt_ids[start:usable]) if n < self.block_tokens else 0
        if take == 0:
            self.metrics.tail_lookups.labels("mismatch").inc()
            return 0
        kv = self._decode(frame, n, start // self.block_tokens)  # [L, 2, H, n, D]
        if kv is None:
            return 0
        out[:, :, :, start:start + take] = kv[:, :, :, :take]
        self.metrics.tail_lookups.labels("used").inc()
        return take

    def _decode(self, frame: bytes, tokens: int, block_index: int) -> torch.Tensor | None:
        """A partial block's frame (a tail's, a session's) of `tokens` tokens that starts block `block_index`."""
        expected = list(self._block_shape)
        expected[3] = tokens
        codec = self.codecs.partial_at(block_index)
        problem = frame_problem(frame, codec.spec, expected, self.geometry.dtype)
        if problem is not None:
            return self._reject(problem)
        try:
            kv = codec.decode(frame, max_elements=math.prod(expected))
        except CodecError as exc:
            return self._reject(Rejection("corrupt", str(exc)))
        return kv.to(self.geometry.dtype)

    def _reject(self, problem: Rejection) -> None:
        """Bytes from Redis are untrusted: anything but what this pod would have written is a counted miss."""
        log.warning("discarding a cached frame (%s): %s", problem.reason, problem.detail)
        self.metrics.cache_rejected.labels(problem.reason).inc()

    def _with_session(
        self, out: torch.Tensor, hit_blocks: int, fetched: int, session: SessionRecord | None,
        prompt_ids: list[int], usable: int, tail: bytes | None = None,
    ) -> CacheView:
        b = self.block_tokens
        cached = hit_blocks * b
        if tail is not None:
            added = self._apply_tail(tail, out, cached, prompt_ids, usable)
            cached, fetched = cached + added, fetched + (len(tail) if added else 0)
        # "hit": everything reusable was reused: the whole known history of a session, else every
        # full block of the prompt. "partial": some of it. "miss": none.
        target = (usable // b) * b
        if session is not None and session.model == self.model_key:
            session_full = len(session.token_ids) // b
            common = min(common_prefix(session.token_ids, prompt_ids), usable)
            target = common
            if session.partial and hit_blocks == session_full and common > cached:
                tail = self._decode(session.partial, len(session.token_ids) - session_full * b, session_full)
                if tail is not None:
                    take = common - cached
                    out[:, :, :, cached:common] = tail[:, :, :, :take]
                    cached = common
                    fetched += len(session.partial)
        kv = out[:, :, :, :cached] if cached else None  # [L, 2, H, cached, D]
        status = "miss" if cached == 0 else ("hit" if cached >= target else "partial")
        return CacheView(kv, cached, hit_blocks, status, fetched)

    def _account(self, view: CacheView, prompt_ids: list[int]) -> CacheView:
        self.metrics.lookups.labels(view.status).inc()
        self.metrics.prompt_tokens.labels("cached").inc(view.cached_tokens)
        self.metrics.prompt_tokens.labels("computed").inc(len(prompt_ids) - view.cached_tokens)
        self.metrics.bytes_fetched.inc(view.fetched_bytes)
        return view

    # -- generation --------------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: list[int],
        view: CacheView,
        params: GenParams,
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        early = self._early_writer(asyncio.get_running_loop(), prompt_ids, view)
        gen = await self.in_engine(view, self.engine.generate, prompt_ids, view.kv, params, on_text, early, view.ready,
                                   self.keep_from(view))
        self.metrics.ttft.labels(view.status).observe(gen.ttft_s)
        self.planner.observe_prefill(len(prompt_ids) - view.cached_tokens, gen.ttft_s)  # for the next fetch plans
        self._publish_estimates()
        if self.memory is not None and view.salt is not None:
            self._remember(view, gen)
        return gen

    def keep_from(self, view: CacheView) -> int:
        """The first token whose KV a write-back after `view` needs: the blocks this hit read are in Redis (the
        sticky baseline keeps the whole sequence in memory)."""
        return 0 if self.memory is not None else view.held_blocks * self.block_tokens

    async def in_engine(self, view: CacheView, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the engine's threads (where it may read `view`'s KV), then `view`'s pooled buffers back to
        their pools once it and the rehydration are done, even if the caller is cancelled meanwhile."""
        work = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        if view.buffer is not None:  # back to the pool once the inference and the rehydration threads are done
            buffer, view.buffer = view.buffer, None  # with it, even if this request is cancelled meanwhile
            stage, view.landing = view.landing, None
            rehydrating = view.rehydrating

            def give_all(_: object = None) -> None:
                self._give_context(buffer)
                if stage is not None:
                    self._landings.give(stage)

            def give(_: object) -> None:
                if rehydrating is not None and not rehydrating.done():
                    rehydrating.add_done_callback(give_all)
                else:
                    give_all()

            work.add_done_callback(give)
        return await work

    def _early_writer(
        self, loop: asyncio.AbstractEventLoop, prompt_ids: list[int], view: CacheView
    ) -> Callable[[Callable[[int, int], torch.Tensor]], None] | None:
        """The prefill hook that queues the prompt's new full blocks while the reply is being generated."""
        salt, b = view.salt, self.block_tokens
        first, full = view.held_blocks, len(prompt_ids) // b
        if salt is None or self.writer is None or self.store is None or full <= first:
            return None
        hashes = self.hashes(salt, prompt_ids[:full * b])

        def on_prefill(get_kv: Callable[[int, int], torch.Tensor]) -> None:  # on the inference thread
            try:
                kv = get_kv(first * b, full * b)  # [L, 2, H, (full - first) * b, D]
            except Exception:  # an early write is an optimisation: the final write-back covers these blocks
                log.exception("could not copy the prompt's KV for an early write")
                return
            job = WriteJob(model=self.model_key, hashes=hashes[first:], kv=kv, first_block=first, block_tokens=b,
                           kv_from=first * b, tenant=view.tenant)
            loop.call_soon_threadsafe(self._submit_early, view, job, full)

        return on_prefill

    def _submit_early(self, view: CacheView, job: WriteJob, full: int) -> None:
        assert self.writer is not None
        if self.writer.submit(job):
            view.early_blocks = full

    # -- write-back --------------------------------------------------------------------------
    def session_record(
        self, tenant: str, session_id: str, messages: list[dict[str, Any]], gen: Generation,
        previous: SessionRecord | None,
    ) -> SessionRecord:
        now = time.time()
        return SessionRecord(
            tenant=tenant,
            session_id=session_id,
            model=self.model_key,
            token_ids=list(gen.seq_ids),
            messages=messages,
            version=previous.version if previous else 0,
            created_at=previous.created_at if previous else now,
            updated_at=now,
        )

    def write_back(
        self,
        tenant_salt: bytes,
        gen: Generation,
        view: CacheView,
        session: SessionRecord | None = None,
        expected_version: int | None = None,
        prompt_tokens: int = 0,
    ) -> WriteJob | None:
        """Queue the sequence's new full blocks, its tail, the reply's ids (and the session) for the
        background writer; never waits. Returns the job (await it with `settle`), None if not queued.
        `prompt_tokens`: the sequence's first `prompt_tokens` were the prompt, whose own tail (the tokens after its
        last full block) is written too, first: a next turn that re-renders the reply otherwise than its generated
        ids then still reuses the whole prompt, as a llama-server that kept the conversation does."""
        if self.writer is None or self.store is None:
            return None
        b = self.block_tokens
        hashes = self.hashes(tenant_salt, gen.seq_ids)
        full = len(hashes)
        ends = prompt_tokens // b
        if ends < full and prompt_tokens % b and gen.kv_from <= ends * b and prompt_tokens <= len(gen.seq_ids):
            parent = hashes[ends - 1] if ends else self.root(tenant_salt)
            self.writer.submit(WriteJob(model=self.model_key, hashes=[], kv=gen.kv, first_block=ends, block_tokens=b,
                                        kv_from=gen.kv_from, tenant=view.tenant,
                                        tail_key=self.store.keys.tail(self.model_key, parent),
                                        tail_tokens=list(gen.seq_ids[ends * b:prompt_tokens]), tail_from=ends * b))
        tail_tokens = gen.seq_ids[full * b:]
        parent = hashes[-1] if full else self.root(tenant_salt)
        keys = self.store.keys
        first = max(view.held_blocks, view.early_blocks)  # the prompt's blocks may be queued already
        job = WriteJob(
            model=self.model_key,
            hashes=hashes[first:],
            kv=gen.kv,
            first_block=first,
            block_tokens=b,
            kv_from=gen.kv_from,
            tenant=view.tenant,
            session=session,
            session_expected_version=expected_version,
            session_tail_from=full * b,
            tail_key=keys.tail(self.model_key, parent) if tail_tokens else None,
            tail_tokens=list(tail_tokens),
            tail_from=full * b,
            reply=self._reply_entry(tenant_salt, gen),
            written=asyncio.get_running_loop().create_future(),
        )
        return job if self.writer.submit(job) else None

    def _reply_entry(self, tenant_salt: bytes, gen: Generation) -> tuple[tuple[int, str], bytes] | None:
        """The reply's generated ids under a digest of its exact text, if they decode to exactly that text."""
        ids = gen.reply_ids
        if not ids or not gen.text or len(ids) > MAX_REPLY_TOKENS or self.engine.decode(ids) != gen.text:
            return None
        assert self.store is not None
        digest = reply_digest(self.root(tenant_salt), gen.text)
        return self.store.keys.reply_ids(self.model_key, digest), pack_ids(ids)

    async def settle(self, job: WriteJob | None, view: CacheView | None = None) -> bool:
        """Wait (at most `write_wait_s`) until `job` is in Redis, so a next turn sent the moment this reply
        ends hits on any pod; a slow or dead Redis only makes the write late, never the request fail. No
        wait at all when this request already found Redis failing (its read was a bypass)."""
        if job is None or job.written is None or (view is not None and view.status == "bypass"):
            return False
        if self.store is None or self.store.breaker_state == "open":
            return False
        try:
            ok = await asyncio.wait_for(asyncio.shield(job.written), self.settings.write_wait)
        except TimeoutError:
            self.metrics.write_waits.labels("late").inc()
            return False
        self.metrics.write_waits.labels("written" if ok else "failed").inc()
        return ok

    async def known_replies(self, tenant_salt: bytes, messages: list[dict[str, str]]) -> dict[int, list[int]]:
        """Assistant messages whose exact text some pod generated: message index -> the generated ids
        (one round trip; only ids that decode to exactly the message's text, of this tenant and model)."""
        if self.memory is not None:
            return self.memory.known_replies(tenant_salt, messages)
        wanted = [(i, m["content"]) for i, m in enumerate(messages)
                  if m.get("role") == "assistant" and m.get("content")]
        if self.store is None or not wanted or self.store.breaker_state == "open":
            return {}
        root = self.root(tenant_salt)
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
            try:
                ids = unpack_ids(value)
            except CodecError as exc:
                self._reject(Rejection("corrupt", f"reply ids: {exc}"))
                continue
            if not ids or self.engine.decode(ids) != text:  # edited, forged or another tokenizer's
                self.metrics.reply_ids.labels("mismatch").inc()
                continue
            known[index] = ids
            self.metrics.reply_ids.labels("used").inc()
        return known
