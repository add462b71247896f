"""The background write queue: encode new KV blocks and session tails, write them off the request path."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from cachestore.boundary import BoundaryRecord, pack_boundary
from cachestore.codec import Codec
from cachestore.codec.arrays import Array
from cachestore.codec.blockcodec import BlockCodecs
from cachestore.errors import KvstashError
from cachestore.hashing import BlockHash
from cachestore.outcome import Outcome, Result
from cachestore.sessions import SessionRecord
from cachestore.store import BlockStore
from cachestore.tails import pack_tail
from service.cache.boundaries import RecordWrite
from service.runtime.metrics import PodMetrics

log = logging.getLogger("kvstash.writer")


@dataclass
class WriteJob:
    """Blocks `first_block..` of `kv` under `hashes`, then the sequence's tail and the reply's ids, then
    optionally a session record. `written` resolves (True, or False if anything failed) once done."""

    model: str
    hashes: list[BlockHash]  # hashes of the blocks to write, in order
    kv: Array  # [layers, 2, kv_heads, tokens, head_dim]: the sequence's KV from token `kv_from` on
    first_block: int  # index of hashes[0] in the sequence
    block_tokens: int
    kv_from: int = 0
    prefix: list[BlockHash] = field(default_factory=list)  # the chain before first_block (its last: the parent)
    tenant: str | None = None  # whose entries these are (its quota applies); None: the namespace's
    session: SessionRecord | None = None  # written after the blocks; `partial` filled in here
    session_expected_version: int | None = None
    session_tail_from: int = 0  # the sequence's tokens from here on form the session's partial block
    tail_key: tuple[int, str] | None = None  # where the tokens after the last full block go (KeySpace.tail)
    tail_tokens: list[int] = field(default_factory=list)  # those tokens: the sequence's from tail_from on
    tail_from: int = 0
    reply: tuple[tuple[int, str], bytes] | None = None  # (KeySpace.reply_ids key, tails.pack_ids value)
    records: list[tuple[tuple[int, str], RecordWrite]] = field(default_factory=list)  # (KeySpace.boundary key, what)
    written: asyncio.Future[bool] | None = field(default=None, repr=False)

    def finish(self, ok: bool) -> None:
        if self.written is not None and not self.written.done():
            self.written.set_result(ok)


class BackgroundWriter:
    def __init__(self, store: BlockStore, codec: Codec | BlockCodecs, metrics: PodMetrics, maxsize: int) -> None:
        self._store = store
        self._codecs = codec if isinstance(codec, BlockCodecs) else BlockCodecs.for_spec(codec)
        self._metrics = metrics
        self._queue: asyncio.Queue[WriteJob] = asyncio.Queue(maxsize=maxsize)
        self._task: asyncio.Task[None] | None = None
        self._pending = 0  # queued + the one being written: 0 means every accepted job is in Redis (or failed)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvstash-writer")

    def submit(self, job: WriteJob) -> bool:
        """Queue a job without waiting; a full queue drops it (counted), never blocks the request."""
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            self._metrics.writes_dropped.labels("queue_full").inc()
            job.finish(False)
            return False
        self._pending += 1
        self._metrics.write_queue_depth.set(self._pending)
        return True

    @property
    def depth(self) -> int:
        """Jobs queued or being written (what /readyz and kvstash_write_queue_depth report)."""
        return self._pending

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every queued job is written (graceful shutdown); False on timeout."""
        try:
            await asyncio.wait_for(self._queue.join(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def stop(self, drain_timeout_s: float = 10.0) -> None:
        await self.drain(drain_timeout_s)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            job = await self._queue.get()
            ok = False
            try:
                ok = await self._write(job)
            except Exception:  # a write failing must never stop the writer
                log.exception("background write failed")
                self._metrics.writes_dropped.labels("error").inc()
            finally:
                job.finish(ok)
                self._pending -= 1
                self._queue.task_done()
                self._metrics.write_queue_depth.set(self._pending)

    def _encode_blocks(self, job: WriteJob) -> tuple[list[bytes], bytes | None]:
        """The new blocks' frames and the tail value (or None)."""
        b = job.block_tokens
        frames = []
        for i in range(len(job.hashes)):
            start = (job.first_block + i) * b - job.kv_from
            codec = self._codecs.at(job.first_block + i)
            frames.append(codec.encode(job.kv[:, :, :, start : start + b]))  # [L, 2, H, b, D]
        tail = None
        if job.tail_key is not None and job.tail_tokens:
            n = len(job.tail_tokens)
            start = job.tail_from - job.kv_from
            frame = self._codecs.partial_at(job.tail_from // b).encode(job.kv[:, :, :, start:start + n])
            tail = pack_tail(job.tail_tokens, frame)
        return frames, tail

    def _encode_records(self, job: WriteJob) -> list[bytes]:
        """The boundary records' values: each one's tokens' KV as a frame (the codec of the block they begin), then
        the engine's state."""
        values = []
        for _, rec in job.records:
            start, n = rec.parent_blocks * job.block_tokens - job.kv_from, len(rec.tokens)
            frame = self._codecs.at(rec.parent_blocks).encode(job.kv[:, :, :, start:start + n]) if n else b""
            values.append(pack_boundary(BoundaryRecord(rec.position, rec.tokens, frame, rec.state)))
        return values

    async def _write(self, job: WriteJob) -> bool:
        ok = True
        t0 = time.perf_counter()
        frames, tail = await asyncio.to_thread(self._encode_blocks, job)
        records = await asyncio.to_thread(self._encode_records, job) if job.records else []
        self._metrics.codec_seconds.labels("encode").observe(time.perf_counter() - t0)
        t0 = time.perf_counter()
        try:
            if frames:
                stored = await self._store.store_blocks(job.model, job.hashes, frames, job.tenant, job.first_block,
                                                        prefix=job.prefix)
                ok = stored.value == len(frames) and ok
                self._metrics.bytes_stored.inc(sum(len(f) for f in frames))
            entries = [(job.tail_key, tail)] if tail is not None and job.tail_key is not None else []
            entries += [job.reply] if job.reply is not None else []
            entries += [(key, value) for (key, _), value in zip(job.records, records, strict=True)]
            if entries:
                ok = await self._store.put_entries([k for k, _ in entries], [v for _, v in entries], job.tenant) \
                    == len(entries) and ok
        except KvstashError as exc:  # e.g. a block over the value limit: refuse, log, go on
            log.warning("blocks not stored: %s", exc)
            self._metrics.writes_dropped.labels("refused").inc()
            ok = False
        self._metrics.redis_seconds.labels("put").observe(time.perf_counter() - t0)
        if job.session is not None:
            recorded = await self.write_session(job.session, job.kv, job.session_tail_from,
                                                job.session_expected_version, job.kv_from)
            ok = ok and recorded.outcome is Outcome.STORED
        return ok

    async def write_session(
        self, record: SessionRecord, kv: Array | None, tail_from: int, expected_version: int | None,
        kv_from: int = 0,
    ) -> Result[SessionRecord | None]:
        """Encode the sequence's tokens from `tail_from` on (`kv` holds them from token `kv_from`) into the record
        and compare-and-set it: STORED, CONFLICT or UNAVAILABLE."""
        if kv is not None and kv_from + kv.shape[3] > tail_from:
            codec = self._codecs.partial_at(0 if tail_from == 0 else 1)  # a tail from token 0 is block 0
            record.partial = await asyncio.to_thread(codec.encode, kv[:, :, :, tail_from - kv_from:])
        else:
            record.partial = b""
        t0 = time.perf_counter()
        stored = await self._store.write_session(record, expected_version)
        self._metrics.redis_seconds.labels("session").observe(time.perf_counter() - t0)
        return stored
