"""Block reads: the longest present prefix of a chain of hashes, async on the event loop or blocking on a lookup's
reader thread (landing in the caller's buffers, chunk after chunk), and reads of tail and reply-ids entries."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from cachestore.hashing import BlockHash
from cachestore.keys import check_model
from cachestore.outcome import Outcome, Result
from cachestore.store.cluster import NodeReads
from cachestore.store.guard import FAILED, Failed
from cachestore.store.reads import Keyed
from cachestore.wire import Exchange, Target, pipelined_into

Plan = tuple[Keyed, list[bytes | Target], tuple[list[tuple[Any, ...]], list[Any]] | None]


class BlockReader(NodeReads):
    """The read side of the store."""

    async def fetch(self, model: str, hashes: Sequence[BlockHash]) -> Result[list[bytes]]:
        """Frames of the longest present prefix of `hashes`, in one pipelined round trip: FOUND (some frames),
        ABSENT (Redis answered: none), UNAVAILABLE."""
        keyed, frames = self._begin_fetch(model, hashes)
        if len(frames) == len(keyed):
            return self._end_fetch(keyed, frames, [])
        remote = await self._guard.run(lambda: self._fetch(keyed, len(frames)), self.settings.op_timeout_s)
        return self._end_fetch(keyed, frames, remote)

    def held_locally(self, model: str, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """How many leading blocks of `hashes` the local tier holds, and their bytes (nothing is counted or moved)."""
        if self._local is None:
            return 0, 0
        check_model(model)
        count = nbytes = 0
        for h in hashes:
            _, key = self.keys.block(model, h)
            frame = self._local.peek(key)
            if frame is None:
                break
            count, nbytes = count + 1, nbytes + len(frame)
        return count, nbytes

    async def count_present(self, model: str, hashes: Sequence[BlockHash]) -> Result[int]:
        """How many leading blocks of `hashes` Redis holds, without reading them (a pod that prefills them instead
        writes back only the blocks after them): one round trip of PEXPIREs, which slide their TTL as a read would,
        and their LRU touch. FOUND (some), ABSENT (none) or UNAVAILABLE."""
        check_model(model)
        keyed = [self.keys.block(model, h) for h in hashes]
        if not keyed:
            return Result(Outcome.ABSENT, 0)

        async def probe() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            self._queue_fetch(pipe, keyed, len(keyed))  # every key as if held locally: PEXPIRE, no value
            return list(await pipe.execute(raise_on_error=False))[: len(keyed)]

        results = await self._guard.run(probe, self.settings.op_timeout_s)
        if isinstance(results, Failed):
            return Result(Outcome.UNAVAILABLE, 0)
        present = 0
        for held in results:
            if held is not True and held != 1:
                break
            present += 1
        return Result(Outcome.FOUND if present else Outcome.ABSENT, present)

    def fetch_blocking(
        self, model: str, hashes: Sequence[BlockHash], into: Sequence[Target] | None = None,
    ) -> Result[list[bytes | Target]]:
        """`fetch` for a thread beside the event loop (a lookup's reader): the same commands in one round trip,
        on a blocking client of the same Redis, under the same guard and counters. Safe on any thread.

        With `into` (a writable buffer per hash), a frame of exactly its buffer's length is received straight into
        it and returned as that memoryview (`cachestore.wire`); a frame held locally is copied there; any other
        comes back as bytes."""
        keyed, found = self._begin_landing(model, hashes, into)
        if len(found) == len(keyed):
            return self._end_fetch(keyed, found, [])
        return self._end_fetch(keyed, found,
                               self._guard.run_blocking(lambda: self._fetch_blocking(keyed, len(found), into)))

    def fetch_chunks_blocking(
        self, model: str, chunks: Sequence[Sequence[BlockHash]], into: Sequence[Sequence[Target]],
    ) -> Iterator[Result[list[bytes | Target]]]:
        """`fetch_blocking` of each chunk in turn (with its buffers), as a generator: once a chunk's replies are in,
        the next chunk is requested before this one's result is yielded, so its bytes come in while the caller
        verifies this one. The next chunk is asked for only when this one was whole; a chunk that fails ends it.
        Close it (it is a generator) to stop early: a request still unanswered drops its connection."""
        client = self._blocking_client()
        if self._by_node:  # a Cluster: each chunk read from every node at once, the next requested meanwhile
            yield from self._chunks_by_node(model, chunks, into)
            return
        if not self._landable or not self._guard.allow():  # one round trip at a time (or a miss: breaker open)
            for chunk, slots in zip(chunks, into, strict=True):
                result = self.fetch_blocking(model, chunk, slots)
                yield result
                if len(result.value) < len(chunk):
                    return
            return
        if not chunks:
            self._guard.release()
            return
        exchange: Exchange | None = None
        failed: Exception | None = None
        try:
            plans = [self._plan_fetch(client, model, chunks[0], into[0])]
            exchange = Exchange(client)
            if plans[0][2] is not None:
                exchange.send(plans[0][2][0])
            for index in range(len(chunks)):
                keyed, found, request = plans[index]
                remote: list[Any] = []
                if request is not None:
                    remote = self._fetched(keyed, len(found), exchange.receive(len(request[0]), request[1]))
                if index + 1 < len(chunks) and len(found) + len(remote) == len(keyed):
                    plans.append(self._plan_fetch(client, model, chunks[index + 1], into[index + 1]))
                    try:  # a failed request fails the next chunk: this one's frames still count
                        if plans[-1][2] is not None:
                            exchange.send(plans[-1][2][0])
                    except Exception as exc:  # noqa: BLE001
                        failed = exc
                yield self._end_fetch(keyed, found, remote)
                if failed is not None or len(found) + len(remote) < len(keyed):
                    break
        except Exception as exc:  # noqa: BLE001 - any Redis trouble is a miss, as in fetch_blocking
            failed = exc
        except BaseException:  # GeneratorExit (closed early) included: not Redis's doing
            self._guard.release()
            raise
        finally:
            if exchange is not None:
                exchange.close()
        if failed is None:
            self._guard.succeeded()
            return
        self._guard.failed(failed)
        keyed, found, _ = plans[-1]  # the chunk whose request or replies failed
        yield self._end_fetch(keyed, found, FAILED)

    def _chunks_by_node(
        self, model: str, chunks: Sequence[Sequence[BlockHash]], into: Sequence[Sequence[Target]],
    ) -> Iterator[Result[list[bytes | Target]]]:
        """`fetch_chunks_blocking` on a Cluster: chunk k+1 is read (every node at once, on a chunk thread) while the
        caller verifies chunk k. A chunk in flight when the caller stops is waited for: it lands in the caller's
        buffers, which must not be handed on before it is done."""
        assert self._chunk_readers is not None
        ahead: Future[Result[list[bytes | Target]]] | None = None
        try:
            for index, (chunk, slots) in enumerate(zip(chunks, into, strict=True)):
                result = ahead.result() if ahead is not None else self.fetch_blocking(model, chunk, slots)
                ahead = None
                if len(result.value) == len(chunk) and index + 1 < len(chunks):
                    ahead = self._chunk_readers.submit(self.fetch_blocking, model, chunks[index + 1],
                                                       into[index + 1])
                yield result
                if len(result.value) < len(chunk):
                    return
        finally:
            if ahead is not None:
                ahead.result()

    def _plan_fetch(self, client: Any, model: str, hashes: Sequence[BlockHash], into: Sequence[Target]) -> Plan:
        """A chunk's keys, its frames held locally (in their buffers), and the commands and reply buffers of the
        round trip it needs (None when it is all held locally)."""
        keyed, found = self._begin_landing(model, hashes, into)
        if len(found) == len(keyed):
            return keyed, found, None
        return keyed, found, self._landing_request(self._fetch_pipeline(client, keyed, len(found)), keyed,
                                                   len(found), into)

    async def _fetch(self, keyed: Keyed, start: int) -> list[bytes]:
        pipe = self._fetch_pipeline(self._client, keyed, start)
        return self._fetched(keyed, start, await pipe.execute(raise_on_error=False))

    def _fetch_blocking(self, keyed: Keyed, start: int, into: Sequence[Target] | None = None) -> list[bytes | Target]:
        client = self._blocking_client()
        if into is not None and self._by_node:
            return self._fetched(keyed, start, self._fetch_by_node(client, keyed, start, into))
        pipe = self._fetch_pipeline(client, keyed, start)
        if into is None or not self._landable:
            return self._fetched(keyed, start, pipe.execute(raise_on_error=False))
        commands, targets = self._landing_request(pipe, keyed, start, into)
        return self._fetched(keyed, start, pipelined_into(client, commands, targets))

    async def get_entries(self, keyed: Sequence[tuple[int, str]]) -> list[bytes | None]:
        """Values of tail or reply-ids keys (KeySpace.tail / reply_ids), each found or None, in one
        round trip that also slides their TTL and LRU position; all None if Redis fails."""
        if not keyed:
            return []

        async def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for _, key in keyed:
                pipe.getex(key, px=self._block_ttl_ms)
            if self.settings.budget_enabled:
                self._touch(pipe, list(keyed))
            self._counters.add("round_trips")
            return list(await pipe.execute(raise_on_error=False))[: len(keyed)]

        values = await self._guard.run(read, self.settings.op_timeout_s)
        if isinstance(values, Failed):
            return [None] * len(keyed)
        found = [v if isinstance(v, bytes) and v else None for v in values]
        if self.signer is not None:
            opened = [self._open_value(key, v) if v is not None else None for (_, key), v in zip(keyed, found,
                                                                                              strict=True)]
            found = [bytes(v) if v is not None else None for v in opened]
        self._counters.add("bytes_read", sum(len(v) for v in found if v))
        return found
