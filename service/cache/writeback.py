"""Write-back: what a generation computed goes to Redis, for chat, completions, sessions and the sidecar alike.

The prompt's new blocks are queued while the reply is generated (`early_writer`); once it is done, the rest of the
sequence's blocks, its tail, the reply's ids and the session record (`finish`). The writes run on the background
writer (service.cache.writer); `finish` waits for them at most `write_wait_s`, so the next turn hits on any pod, and
says what happened as an `Outcome`: STORED, CONFLICT (a session changed meanwhile) or UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cachestore.codec.arrays import Array
from cachestore.hashing import BlockHash
from cachestore.outcome import Outcome
from cachestore.sessions import SessionRecord
from cachestore.store import BlockStore
from cachestore.tails import pack_ids, reply_digest
from service.cache import boundaries
from service.cache.cacheview import CacheView, EarlyWrites
from service.cache.chain import Chain
from service.cache.writer import BackgroundWriter, WriteJob
from service.engines import Engine, Generation
from service.runtime.metrics import PodMetrics
from service.settings import PodSettings

log = logging.getLogger("kvstash.writeback")
MAX_REPLY_TOKENS = 8192  # replies longer than this are re-tokenized rather than remembered


@dataclass(frozen=True)
class SessionWrite:
    """The session record a turn's write-back stores, compare-and-set against `expected_version`.

    `strict`: the turn fails unless the record is stored (server-side sessions, where the record is the
    conversation): it is written first and its outcome awaited. Otherwise it follows the blocks, best effort.
    """

    record: SessionRecord
    expected_version: int | None
    strict: bool = False


def session_record(
    model_key: str, tenant: str, session_id: str, messages: list[dict[str, Any]], gen: Generation,
    previous: SessionRecord | None,
) -> SessionRecord:
    """The record of a session after `gen`: its whole sequence and `messages`, on top of `previous`."""
    now = time.time()
    return SessionRecord(
        tenant=tenant,
        session_id=session_id,
        model=model_key,
        token_ids=list(gen.seq_ids),
        messages=messages,
        version=previous.version if previous else 0,
        created_at=previous.created_at if previous else now,
        updated_at=now,
    )


class WriteBack:
    """Queues a pod's writes on its background writer and waits for them within the write budget."""

    def __init__(self, settings: PodSettings, engine: Engine, store: BlockStore | None,
                 writer: BackgroundWriter | None, chain: Chain, model_key: str, metrics: PodMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.store = store
        self.writer = writer
        self.chain = chain
        self.model_key = model_key
        self.block_tokens = chain.block_tokens
        self.metrics = metrics

    def record(self, tenant: str, session_id: str, messages: list[dict[str, Any]], gen: Generation,
               previous: SessionRecord | None) -> SessionRecord:
        """`session_record` of this pod's model."""
        return session_record(self.model_key, tenant, session_id, messages, gen, previous)

    async def finish(self, tenant_salt: bytes, gen: Generation, view: CacheView, session: SessionWrite | None = None,
                     prompt_tokens: int = 0) -> Outcome:
        """Write back a finished generation (`write_back`) and wait for it (`settle`). A strict session record is
        written first: CONFLICT or UNAVAILABLE then, and nothing else is written. Otherwise STORED when the writes
        are in Redis within the budget, UNAVAILABLE when they are late, dropped or failed (never the client's
        error)."""
        if session is not None and session.strict:
            if self.writer is None:
                return Outcome.UNAVAILABLE
            full = (len(gen.seq_ids) // self.block_tokens) * self.block_tokens
            written = await self.writer.write_session(session.record, gen.kv, full, session.expected_version,
                                                      gen.kv_from)
            if written.outcome is not Outcome.STORED:  # a conflict; a timeout, a paused or dead Redis
                return Outcome.CONFLICT if written.outcome is Outcome.CONFLICT else Outcome.UNAVAILABLE
            await self.settle(self.write_back(tenant_salt, gen, view, prompt_tokens=prompt_tokens), view)
            return Outcome.STORED
        record, expected = (session.record, session.expected_version) if session is not None else (None, None)
        job = self.write_back(tenant_salt, gen, view, record, expected, prompt_tokens)
        return Outcome.STORED if await self.settle(job, view) else Outcome.UNAVAILABLE

    def early_writer(
        self, loop: asyncio.AbstractEventLoop, prompt_ids: list[int], view: CacheView
    ) -> Callable[[Callable[[int, int], Array]], None] | None:
        """The prefill hook that queues the prompt's new full blocks while the reply is being generated."""
        salt, b = view.salt, self.block_tokens
        first, full = view.held_blocks, len(prompt_ids) // b
        if salt is None or self.writer is None or self.store is None or full <= first:
            return None
        hashes = self.chain.hashes(salt, prompt_ids[:full * b])

        def on_prefill(get_kv: Callable[[int, int], Array]) -> None:  # on the inference thread
            try:
                kv = get_kv(first * b, full * b)  # [L, 2, H, (full - first) * b, D]
            except Exception:  # an early write is an optimisation: the final write-back covers these blocks
                log.exception("could not copy the prompt's KV for an early write")
                return
            job = WriteJob(model=self.model_key, hashes=hashes[first:], kv=kv, first_block=first, block_tokens=b,
                           kv_from=first * b, tenant=view.tenant, prefix=hashes[:first])
            loop.call_soon_threadsafe(self._submit_early, view.early, job, full)

        return on_prefill

    def _submit_early(self, early: EarlyWrites, job: WriteJob, full: int) -> None:
        assert self.writer is not None
        if self.writer.submit(job):
            early.blocks = full

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
        hashes = self.chain.hashes(tenant_salt, gen.seq_ids)
        full = len(hashes)
        ends = prompt_tokens // b
        keys = self.store.keys
        tails = not self.engine.boundary_records  # a boundary-record model resumes at its records, never at a tail
        if (tails and ends < full and prompt_tokens % b and gen.kv_from <= ends * b
                and prompt_tokens <= len(gen.seq_ids)):
            parent = self.chain.parent(tenant_salt, hashes, ends)
            self.writer.submit(WriteJob(model=self.model_key, hashes=[], kv=gen.kv, first_block=ends, block_tokens=b,
                                        kv_from=gen.kv_from, tenant=view.tenant,
                                        tail_key=keys.tail(self.model_key, parent),
                                        tail_tokens=list(gen.seq_ids[ends * b:prompt_tokens]), tail_from=ends * b))
        tail_tokens = gen.seq_ids[full * b:]
        parent = self.chain.parent(tenant_salt, hashes, full)
        first = max(view.held_blocks, view.early.blocks)  # the prompt's blocks may be queued already
        job = WriteJob(
            model=self.model_key,
            hashes=hashes[first:],
            kv=gen.kv,
            first_block=first,
            prefix=hashes[:first],
            block_tokens=b,
            kv_from=gen.kv_from,
            tenant=view.tenant,
            session=session,
            session_expected_version=expected_version,
            session_tail_from=full * b,
            tail_key=keys.tail(self.model_key, parent) if tail_tokens and tails else None,
            tail_tokens=list(tail_tokens),
            tail_from=full * b,
            reply=self._reply_entry(tenant_salt, gen),
            records=self._record_writes(tenant_salt, gen, hashes),
            written=asyncio.get_running_loop().create_future(),
        )
        return job if self.writer.submit(job) else None

    def _record_writes(self, tenant_salt: bytes, gen: Generation, hashes: list[BlockHash]
                       ) -> list[tuple[tuple[int, str], boundaries.RecordWrite]]:
        """Where the generation's boundary records go: each under the chain hash of the full blocks before it."""
        if not self.engine.boundary_records or self.store is None:
            return []
        writes = boundaries.records_of(gen.boundaries, gen.seq_ids, gen.kv_from, self.block_tokens)
        return [(self.store.keys.boundary(self.model_key, self.chain.parent(tenant_salt, hashes, w.parent_blocks)), w)
                for w in writes]

    def _reply_entry(self, tenant_salt: bytes, gen: Generation) -> tuple[tuple[int, str], bytes] | None:
        """The reply's generated ids under a digest of its exact text, if they decode to exactly that text."""
        ids = gen.reply_ids
        if not ids or not gen.text or len(ids) > MAX_REPLY_TOKENS or self.engine.decode(ids) != gen.text:
            return None
        assert self.store is not None
        digest = reply_digest(self.chain.root(tenant_salt), gen.text)
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
