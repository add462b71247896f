"""The background write queue: encode new KV blocks and session tails, write them off the request path."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from cachestore.blockcodec import BlockCodecs
from cachestore.codec import Codec
from cachestore.errors import KvstashError
from cachestore.hashing import BlockHash
from cachestore.sessions import SessionRecord
from cachestore.store import BlockStore
from service.metrics import PodMetrics

log = logging.getLogger("kvstash.writer")


@dataclass
class WriteJob:
    """Blocks `first_block..` of `kv` under `hashes`, then optionally a session record."""

    model: str
    hashes: list[BlockHash]  # hashes of the blocks to write, in order
    kv: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim]: the whole sequence's KV
    first_block: int  # index of hashes[0] in the sequence
    block_tokens: int
    session: SessionRecord | None = None  # written after the blocks; `partial` filled in here
    session_expected_version: int | None = None
    session_tail_from: int = 0  # tokens of kv from here on form the session's partial block
    done: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)


class BackgroundWriter:
    def __init__(self, store: BlockStore, codec: Codec | BlockCodecs, metrics: PodMetrics, maxsize: int) -> None:
        self._store = store
        self._codecs = codec if isinstance(codec, BlockCodecs) else BlockCodecs.for_spec(codec)
        self._metrics = metrics
        self._queue: asyncio.Queue[WriteJob] = asyncio.Queue(maxsize=maxsize)
        self._task: asyncio.Task[None] | None = None
        self._pending = 0  # queued + the one being written: 0 means every accepted job is in Redis (or failed)
        self.written_jobs = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvstash-writer")

    def submit(self, job: WriteJob) -> bool:
        """Queue a job without waiting; a full queue drops it (counted), never blocks the request."""
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            self._metrics.writes_dropped.labels("queue_full").inc()
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
            try:
                await self._write(job)
                self.written_jobs += 1
            except Exception:  # a write failing must never stop the writer
                log.exception("background write failed")
                self._metrics.writes_dropped.labels("error").inc()
            finally:
                self._pending -= 1
                self._queue.task_done()
                self._metrics.write_queue_depth.set(self._pending)

    def _encode_blocks(self, job: WriteJob) -> list[bytes]:
        b = job.block_tokens
        frames = []
        for i in range(len(job.hashes)):
            start = (job.first_block + i) * b
            codec = self._codecs.at(job.first_block + i)
            frames.append(codec.encode(job.kv[:, :, :, start : start + b]))  # [L, 2, H, b, D]
        return frames

    async def _write(self, job: WriteJob) -> None:
        if job.hashes:
            t0 = time.perf_counter()
            frames = await asyncio.to_thread(self._encode_blocks, job)
            self._metrics.codec_seconds.labels("encode").observe(time.perf_counter() - t0)
            t0 = time.perf_counter()
            try:
                await self._store.put_blocks(job.model, job.hashes, frames)
            except KvstashError as exc:  # e.g. a block over the value limit: refuse, log, go on
                log.warning("blocks not stored: %s", exc)
                self._metrics.writes_dropped.labels("refused").inc()
            else:
                self._metrics.bytes_stored.inc(sum(len(f) for f in frames))
            self._metrics.redis_seconds.labels("put").observe(time.perf_counter() - t0)
        if job.session is not None:
            await self.write_session(job.session, job.kv, job.session_tail_from, job.session_expected_version)
        if job.done is not None:
            await job.done()

    async def write_session(
        self, record: SessionRecord, kv: torch.Tensor | None, tail_from: int, expected_version: int | None
    ) -> SessionRecord | None:
        """Encode the tail of `kv` into the record and compare-and-set it; None if the CAS lost."""
        if kv is not None and kv.shape[3] > tail_from:
            codec = self._codecs.at(0 if tail_from == 0 else 1)  # a tail from token 0 is block 0
            record.partial = await asyncio.to_thread(codec.encode, kv[:, :, :, tail_from:])
        else:
            record.partial = b""
        t0 = time.perf_counter()
        stored = await self._store.put_session(record, expected_version)
        self._metrics.redis_seconds.labels("session").observe(time.perf_counter() - t0)
        return stored
