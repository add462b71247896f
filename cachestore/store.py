"""BlockStore: blocks by chained prefix hash and session records in Redis, async, never raising on Redis trouble."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import redis.cluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cachestore import budget, landing
from cachestore.breaker import CircuitBreaker
from cachestore.errors import StoreError, ValueTooLarge
from cachestore.hashing import BlockHash
from cachestore.keys import KeySpace, check_model, check_tenant
from cachestore.landing import Scatter, Target
from cachestore.localtier import LocalTier
from cachestore.outcome import Outcome, Result
from cachestore.redisclient import make_client
from cachestore.sessions import FIELDS, PUT_SESSION, SessionRecord, from_fields, to_fields
from cachestore.settings import StoreSettings
from cachestore.signing import TRAILER_SIZE, Mac, Signer
from cachestore.stats import Counters, StoreStats, Usage

T = TypeVar("T")
F = TypeVar("F", bytes, bytes | memoryview | Scatter)
NODE_READERS = 8  # threads reading a lookup's shares from a Cluster's nodes at once (besides the lookup's own)
REDIRECTS = ("MOVED ", "ASK ")  # a Cluster node's answer for a slot it no longer serves (or is handing over)


class _Failed:
    """Marks a guarded call that did not reach Redis or failed there."""


FAILED = _Failed()
REJECTED_KEYS = 4096  # keys remembered as holding a rejected value, so that the next write replaces it


def _land(frame: bytes, target: Target) -> bytes | Target:
    """A frame from the local tier, in its lookup buffer when it fits (as if it had landed there)."""
    if len(frame) != len(target):
        return frame
    if isinstance(target, Scatter):
        target.fill(frame)
    else:
        target[:] = frame
    return target


class _Sealed(Scatter):
    """Where a signed value lands: its body in the caller's buffer (or `Scatter`) as if unsigned, its trailer in a
    buffer of its own. The current key's tag is fed each piece of the body as it lands (`mac`), while it is still in
    the cache, and so is the caller's Scatter's own `filled`, if it has one."""

    __slots__ = ("mac", "target", "trailer")

    def __init__(self, target: Target, mac: Mac) -> None:
        self.target = target
        self.trailer = memoryview(bytearray(TRAILER_SIZE))
        inner = target.pieces if isinstance(target, Scatter) else [target]
        reported = target.filled if isinstance(target, Scatter) else None
        self.mac, trailer = mac, self.trailer

        def filled(piece: memoryview) -> None:
            if piece is not trailer:
                mac(piece)
                if reported is not None:
                    reported(piece)

        super().__init__([*inner, self.trailer], filled)

    @property
    def body(self) -> list[memoryview]:
        return self.pieces[:-1]


class BlockStore:
    """The Redis side of kvstash. Reads miss and writes drop on any Redis error; nothing raises.

    Only caller mistakes raise: a frame over max_value_bytes (ValueTooLarge), a malformed
    tenant / session id / model id (keys.InvalidName), mismatched argument lengths.
    Admin calls (usage, reconcile, list_sessions, clear_namespace) raise StoreError instead.
    """

    def __init__(self, settings: StoreSettings, on_rejected: Callable[[str, str], None] | None = None) -> None:
        """`on_rejected(reason, detail)` is told of each value read back that is discarded ("mac": not signed under
        its key name by an accepted frame key), beside the `rejected_mac` counter."""
        self.settings = settings
        self.signer = Signer(settings.frame_key, settings.frame_key_previous) if settings.signed else None
        self._overhead = TRAILER_SIZE if self.signer is not None else 0  # bytes a value's signature adds
        self._on_rejected = on_rejected
        self._rejected: OrderedDict[str, None] = OrderedDict()  # keys whose value was rejected: rewritten, not NX
        self._rejected_lock = threading.Lock()
        self.keys = KeySpace(settings.namespace, settings.index_shards)
        self._client = make_client(settings)
        self._blocking: Any = None  # the reader threads' blocking client, made on first use (fetch_blocking)
        self._blocking_lock = threading.Lock()
        self._landable = False  # whether the blocking client can receive values into buffers
        self._by_node = False  # a Cluster client: values land per node, every node's share read at once
        self._node_readers: ThreadPoolExecutor | None = None
        self._chunk_readers: ThreadPoolExecutor | None = None
        self._breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_reset_s)
        self._counters = Counters()
        self._local = LocalTier(settings.local_tier_bytes) if settings.local_tier_bytes else None
        self._put_lock = asyncio.Lock()
        self._block_ttl_ms = settings.block_ttl_s * 1000
        self._index_ttl_ms = settings.index_ttl_ms
        self._session_ttl_ms = settings.session_ttl_s * 1000

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The underlying redis.asyncio client (for admin tools and tests)."""
        return self._client

    @property
    def breaker_state(self) -> str:
        return self._breaker.state

    def stats(self) -> StoreStats:
        return self._counters.snapshot(self._breaker.state, self._breaker.times_opened)

    async def _guarded(self, call: Callable[[], Awaitable[T]], timeout_s: float) -> T | _Failed:
        """Run `call` under the breaker and a timeout; any failure is counted, never raised."""
        if not self._breaker.allow():
            self._counters.add("skipped_open")
            return FAILED
        try:
            result = await asyncio.wait_for(call(), timeout_s)
        except asyncio.CancelledError:
            self._breaker.release()
            raise
        except (ValueTooLarge, StoreError):
            self._breaker.release()
            raise
        except Exception as exc:  # noqa: BLE001 - any Redis trouble is a miss or a dropped write
            return self._failure(exc)
        self._breaker.record_success()
        return result

    def _guarded_blocking(self, call: Callable[[], T]) -> T | _Failed:
        """`_guarded` for a blocking call on a reader thread (its client's socket timeout bounds it)."""
        if not self._breaker.allow():
            self._counters.add("skipped_open")
            return FAILED
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - any Redis trouble is a miss
            return self._failure(exc)
        except BaseException:
            self._breaker.release()
            raise
        self._breaker.record_success()
        return result

    def _failure(self, exc: Exception) -> _Failed:
        self._counters.add("errors")
        if isinstance(exc, TimeoutError | RedisTimeoutError):
            self._counters.add("timeouts")
        self._breaker.record_failure()
        return FAILED

    async def _admin(self, call: Callable[[], Awaitable[T]]) -> T:
        result = await self._guarded(call, self.settings.write_timeout_s)
        if isinstance(result, _Failed):
            raise StoreError(f"Redis at {self.settings.masked_url} is unavailable (breaker {self.breaker_state})")
        return result

    async def ping(self) -> bool:
        result = await self._guarded(self._client.ping, self.settings.op_timeout_s)
        return result is True

    async def close(self) -> None:
        await self._client.aclose()
        with self._blocking_lock:
            blocking, self._blocking = self._blocking, None
        if blocking is not None:
            await asyncio.to_thread(blocking.close)
        for readers in (self._chunk_readers, self._node_readers):
            if readers is not None:
                readers.shutdown(wait=False, cancel_futures=True)

    # -- blocks -----------------------------------------------------------------------------

    async def lookup(self, model: str, hashes: Sequence[BlockHash]) -> list[bytes]:
        """Frames of the longest present prefix of `hashes`, in one pipelined round trip."""
        return (await self.fetch(model, hashes)).value

    async def fetch(self, model: str, hashes: Sequence[BlockHash]) -> Result[list[bytes]]:
        """`lookup` with what happened: FOUND (some frames), ABSENT (Redis answered: none), UNAVAILABLE."""
        keyed, frames = self._begin_fetch(model, hashes)
        if len(frames) == len(keyed):
            return self._end_fetch(keyed, frames, [])
        remote = await self._guarded(lambda: self._fetch(keyed, len(frames)), self.settings.op_timeout_s)
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

        results = await self._guarded(probe, self.settings.op_timeout_s)
        if isinstance(results, _Failed):
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
        on a blocking client of the same Redis, under the same breaker and counters. Safe on any thread.

        With `into` (a writable buffer per hash), a frame of exactly its buffer's length is received straight into
        it and returned as that memoryview (`cachestore.landing`); a frame held locally is copied there; any other
        comes back as bytes."""
        keyed, found = self._begin_landing(model, hashes, into)
        if len(found) == len(keyed):
            return self._end_fetch(keyed, found, [])
        return self._end_fetch(keyed, found,
                               self._guarded_blocking(lambda: self._fetch_blocking(keyed, len(found), into)))

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
        if not self._landable or not self._breaker.allow():  # one round trip at a time (or a miss: breaker open)
            for chunk, slots in zip(chunks, into, strict=True):
                result = self.fetch_blocking(model, chunk, slots)
                yield result
                if len(result.value) < len(chunk):
                    return
            return
        if not chunks:
            self._breaker.release()
            return
        exchange: landing.Exchange | None = None
        failed: Exception | None = None
        try:
            plans = [self._plan_fetch(client, model, chunks[0], into[0])]
            exchange = landing.Exchange(client)
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
            self._breaker.release()
            raise
        finally:
            if exchange is not None:
                exchange.close()
        if failed is None:
            self._breaker.record_success()
            return
        self._failure(failed)
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

    def _blocking_client(self) -> Any:
        with self._blocking_lock:
            if self._blocking is None:
                self._blocking = make_client(self.settings, asynchronous=False)
                self._landable = landing.landable(self._blocking)
                self._by_node = isinstance(self._blocking, redis.cluster.RedisCluster)
                if self._by_node:  # the chunk threads wait on the node threads, never the other way round
                    self._node_readers = ThreadPoolExecutor(NODE_READERS, thread_name_prefix="kvstash-node")
                    self._chunk_readers = ThreadPoolExecutor(NODE_READERS, thread_name_prefix="kvstash-chunk")
            return self._blocking

    def _plan_fetch(
        self, client: Any, model: str, hashes: Sequence[BlockHash], into: Sequence[Target],
    ) -> tuple[list[tuple[int, str]], list[bytes | Target], tuple[list[tuple[Any, ...]], list[Any]] | None]:
        """A chunk's keys, its frames held locally (in their buffers), and the commands and reply buffers of the
        round trip it needs (None when it is all held locally)."""
        keyed, found = self._begin_landing(model, hashes, into)
        if len(found) == len(keyed):
            return keyed, found, None
        return keyed, found, self._landing_request(self._fetch_pipeline(client, keyed, len(found)), keyed,
                                                   len(found), into)

    def _begin_landing(
        self, model: str, hashes: Sequence[BlockHash], into: Sequence[Target] | None,
    ) -> tuple[list[tuple[int, str]], list[bytes | Target]]:
        """`_begin_fetch`, the local frames copied into their buffers when `into` gives them (as if they had landed)."""
        keyed, frames = self._begin_fetch(model, hashes)
        if into is None:
            return keyed, list(frames)
        return keyed, [_land(frame, target) for frame, target in zip(frames, into, strict=False)]

    def _fetch_pipeline(self, client: Any, keyed: list[tuple[int, str]], start: int) -> Any:
        pipe = client.pipeline(transaction=False)
        self._queue_fetch(pipe, keyed, start)
        return pipe

    def _landing_request(
        self, pipe: Any, keyed: list[tuple[int, str]], start: int, into: Sequence[Target],
    ) -> tuple[list[tuple[Any, ...]], list[Target | None]]:
        """The queued commands and a buffer per reply: none for the PEXPIREs of locally held frames (they come
        first), then the GETEXs' buffers (with room for the trailer after each, under a frame key)."""
        targets: list[Target | None] = [None] * start
        if self.signer is None:
            targets += into[start:len(keyed)]
        else:
            targets += [_Sealed(t, self.signer.running(key)) for t, (_, key) in zip(into[start:len(keyed)],
                                                                                   keyed[start:], strict=False)]
        return [a for a, _ in pipe.command_stack], targets

    def _begin_fetch(self, model: str, hashes: Sequence[BlockHash]) -> tuple[list[tuple[int, str]], list[bytes]]:
        """The keys of `hashes`, and the frames of their longest prefix the local tier holds."""
        check_model(model)
        keyed = [self.keys.block(model, h) for h in hashes]
        frames: list[bytes] = []
        if not keyed:
            return keyed, frames
        self._counters.add("lookups")
        if self._local is not None:
            for _, key in keyed:
                frame = self._local.get(key)
                if frame is None:
                    break
                frames.append(frame)
            self._counters.add("local_hits", len(frames))
        return keyed, frames

    def _end_fetch(
        self, keyed: list[tuple[int, str]], frames: list[F], remote: list[F] | _Failed,
    ) -> Result[list[F]]:
        """The local frames followed by those Redis returned (`remote`), counted."""
        if not keyed:
            return Result(Outcome.ABSENT, [])
        failed = isinstance(remote, _Failed)
        if not isinstance(remote, _Failed):
            frames.extend(self._opened(keyed[len(frames):], remote))
        self._count_lookup(len(frames), len(keyed))
        self._counters.add("blocks_read", len(frames))
        self._counters.add("bytes_read", sum(len(f) for f in frames))
        if frames:
            return Result(Outcome.FOUND, frames)
        return Result(Outcome.UNAVAILABLE if failed else Outcome.ABSENT, frames)

    async def _fetch(self, keyed: list[tuple[int, str]], start: int) -> list[bytes]:
        pipe = self._fetch_pipeline(self._client, keyed, start)
        return self._fetched(keyed, start, await pipe.execute(raise_on_error=False))

    def _fetch_blocking(
        self, keyed: list[tuple[int, str]], start: int, into: Sequence[Target] | None = None,
    ) -> list[bytes | Target]:
        client = self._blocking_client()
        if into is not None and self._by_node:
            return self._fetched(keyed, start, self._fetch_by_node(client, keyed, start, into))
        pipe = self._fetch_pipeline(client, keyed, start)
        if into is None or not self._landable:
            return self._fetched(keyed, start, pipe.execute(raise_on_error=False))
        commands, targets = self._landing_request(pipe, keyed, start, into)
        return self._fetched(keyed, start, landing.pipelined_into(client, commands, targets))

    def _fetch_by_node(
        self, client: Any, keyed: list[tuple[int, str]], start: int, into: Sequence[Target],
    ) -> list[Any]:
        """The replies `_queue_fetch` would give, from a Cluster: each node's keys (and their shards' LRU touches) in
        one round trip on a connection of that node, every node at once, each value received into its buffer. A key
        whose slot moved or is moving (MOVED, ASK), or whose node did not answer, is read again through the Cluster
        client, which follows the redirection, fails over and learns the new slot map."""
        self._counters.add("round_trips")
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, (_, key) in enumerate(keyed):
            node = client.get_node_from_key(key)
            groups.setdefault(node.name, (node, []))[1].append(i)
        shares = list(groups.values())
        assert self._node_readers is not None
        others: list[Future[tuple[list[int], list[int], list[Any] | None]]] = [
            self._node_readers.submit(self._read_node, client, node, keyed, indices, start, into)
            for node, indices in shares[1:]]
        try:
            answered = [self._read_node(client, shares[0][0], keyed, shares[0][1], start, into)]
        finally:
            answered += [f.result() for f in others]  # every node's connection is back in its pool before a retry
        replies: list[Any] = [None] * len(keyed)
        touched: list[Any] = []
        moved: list[int] = []
        for indices, shards, got in answered:
            if got is None:  # the node did not answer: the Cluster client finds out why (a failover?)
                moved += indices
                continue
            for i, reply in zip(indices, got, strict=False):
                replies[i] = reply
                if isinstance(reply, ResponseError) and str(reply).startswith(REDIRECTS):
                    moved.append(i)
            for shard, reply in zip(shards, got[len(indices):], strict=False):
                if isinstance(reply, ResponseError) and str(reply).startswith(REDIRECTS):
                    moved += [i for i in indices if keyed[i][0] == shard and i not in moved]
                else:
                    touched.append(reply)
        if moved:
            self._counters.add("redirects", len(moved))
            again = sorted(set(moved))
            # without their LRU touches: a script over a slot's keys while they migrate is refused (TRYAGAIN), and
            # redis-py retries that with pauses for a second or more; the next read touches them
            pipe = client.pipeline(transaction=False)
            for i in again:
                if i < start:
                    pipe.pexpire(keyed[i][1], self._block_ttl_ms)
                else:
                    pipe.getex(keyed[i][1], px=self._block_ttl_ms)
            self._counters.add("round_trips")
            for i, reply in zip(again, pipe.execute(raise_on_error=False), strict=False):
                replies[i] = reply
        return replies + touched

    def _read_node(
        self, client: Any, node: Any, keyed: list[tuple[int, str]], indices: list[int], start: int,
        into: Sequence[Target],
    ) -> tuple[list[int], list[int], list[Any] | None]:
        """One node's share of `_fetch_by_node`: its keys' indices, the shards whose touches follow their replies,
        and the replies (a value of its buffer's length received into it); None when the node did not answer."""
        share = [keyed[i] for i in indices]  # in order: the locally held ones (PEXPIRE) come first, as in keyed
        held = sum(1 for i in indices if i < start)
        server = client.get_redis_connection(node)
        pipe = server.pipeline(transaction=False)
        self._queue_fetch(pipe, share, held, count=False)
        commands, targets = self._landing_request(pipe, share, held, [into[i] for i in indices])
        shards = list(dict.fromkeys(shard for shard, _ in share)) if self.settings.budget_enabled else []
        try:
            return indices, shards, landing.pipelined_into(server, commands, targets)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            return indices, shards, None

    def _queue_fetch(self, pipe: Any, keyed: list[tuple[int, str]], start: int, count: bool = True) -> None:
        """One round trip: slide the TTL of what is held locally, GETEX the rest, touch their LRU index (a node's
        share of a Cluster read is not a round trip of its own: `count=False`)."""
        for _, key in keyed[:start]:
            pipe.pexpire(key, self._block_ttl_ms)  # held locally: only slide the TTL
        for _, key in keyed[start:]:
            pipe.getex(key, px=self._block_ttl_ms)
        by_shard: dict[int, list[str]] = defaultdict(list)
        for shard, key in keyed:
            by_shard[shard].append(key)
        if self.settings.budget_enabled:
            for shard, keys in by_shard.items():
                budget.touch(pipe, self.keys.shard(shard), keys, self._index_ttl_ms)
        if count:
            self._counters.add("round_trips")

    def _fetched(self, keyed: list[tuple[int, str]], start: int, results: list[Any]) -> list[Any]:
        found: list[Any] = []
        for value in results[start:len(keyed)]:
            if not isinstance(value, bytes | memoryview | Scatter) or not value:
                if isinstance(value, Exception):
                    self._counters.add("errors")
                break
            found.append(value)
        stale = [r for r in results[len(keyed):] if isinstance(r, int)]
        self._counters.add("stale_removed", sum(1 for s in stale if s > 0))
        return found

    def _opened(self, keyed: Sequence[tuple[int, str]], values: list[Any]) -> list[Any]:
        """The bodies of `values` (read under `keyed`) up to the first that is not signed under its key with an
        accepted frame key (all of them when the store has none); each is kept by the local tier."""
        found: list[Any] = []
        for (_, key), value in zip(keyed, values, strict=False):
            body = self._open_value(key, value)
            if body is None:
                break
            found.append(body)
            if self._local is not None:  # a landed frame's buffer is reused later: the local tier keeps a copy
                self._local.put(key, body if isinstance(body, bytes) else body.tobytes())
        return found

    def _open_value(self, key: str, value: Any) -> Any:
        """A value's body, as it would have been stored without a frame key (a landed one: the caller's target), or
        None (counted) when its signature does not verify."""
        if self.signer is None:
            return value
        if isinstance(value, _Sealed):
            if self.signer.check(key, value.body, value.trailer, value.mac):
                return value.target
        elif isinstance(value, bytes | memoryview):
            body = self.signer.open(key, value)
            if body is not None:
                return body
        self._reject(key, "not signed under its key by an accepted frame key")
        return None

    def _reject(self, key: str, detail: str) -> None:
        with self._rejected_lock:  # the next write of this key replaces the value (a rotated-out key's, a forger's)
            self._rejected[key] = None
            self._rejected.move_to_end(key)
            while len(self._rejected) > REJECTED_KEYS:
                self._rejected.popitem(last=False)
        self._counters.add("rejected_mac")
        if self._on_rejected is not None:
            self._on_rejected("mac", f"{key}: {detail}")

    def _seal(self, key: str, value: bytes) -> bytes:
        return value if self.signer is None else self.signer.seal(key, value)

    def _count_lookup(self, found: int, wanted: int) -> None:
        if found == 0:
            self._counters.add("misses")
        elif found < wanted:
            self._counters.add("partial_hits")
        else:
            self._counters.add("hits")

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
                by_shard: dict[int, list[str]] = defaultdict(list)
                for shard, key in keyed:
                    by_shard[shard].append(key)
                for shard, keys in by_shard.items():
                    budget.touch(pipe, self.keys.shard(shard), keys, self._index_ttl_ms)
            self._counters.add("round_trips")
            return list(await pipe.execute(raise_on_error=False))[: len(keyed)]

        values = await self._guarded(read, self.settings.op_timeout_s)
        if isinstance(values, _Failed):
            return [None] * len(keyed)
        found = [v if isinstance(v, bytes) and v else None for v in values]
        if self.signer is not None:
            opened = [self._open_value(key, v) if v is not None else None for (_, key), v in zip(keyed, found,
                                                                                              strict=True)]
            found = [bytes(v) if v is not None else None for v in opened]
        self._counters.add("bytes_read", sum(len(v) for v in found if v))
        return found

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
            written = await self._guarded(lambda: self._write(list(keyed), values, nx=False, tenant=tenant),
                                          self.settings.write_timeout_s)
        if isinstance(written, _Failed):
            self._counters.add("dropped_writes")
            return 0
        return written

    async def put_blocks(self, model: str, hashes: Sequence[BlockHash], frames: Sequence[bytes],
                         tenant: str | None = None) -> int:
        """Write blocks (present ones are left as they are); returns how many were written. `tenant`: whose they
        are (its quota applies, `usage().by_tenant` counts them); None: the namespace's, under its budget only."""
        return (await self.store_blocks(model, hashes, frames, tenant)).value

    async def store_blocks(self, model: str, hashes: Sequence[BlockHash], frames: Sequence[bytes],
                           tenant: str | None = None) -> Result[int]:
        """`put_blocks` with what happened: STORED (how many were new) or UNAVAILABLE (none written)."""
        check_model(model)
        if tenant is not None:
            check_tenant(tenant)
        if len(hashes) != len(frames):
            raise StoreError("put_blocks needs one frame per hash")
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
        async with self._put_lock:
            written = await self._guarded(lambda: self._write(keyed, frames, tenant=tenant),
                                          self.settings.write_timeout_s)
        if isinstance(written, _Failed):
            self._counters.add("dropped_writes")
            return Result(Outcome.UNAVAILABLE, 0)
        return Result(Outcome.STORED, written)

    async def _write(self, keyed: list[tuple[int, str]], frames: Sequence[bytes], nx: bool = True,
                     tenant: str | None = None) -> int:
        items = [((shard, key), self._seal(key, frame)) for (shard, key), frame in zip(keyed, frames, strict=True)]
        if self.settings.budget_enabled:
            quota = self.settings.quota_of(tenant) if tenant is not None else 0
            items = self._fit_budget(items, min(quota, self.settings.budget_bytes) or self.settings.budget_bytes)
            await self._make_room(sum(len(f) for _, f in items), tenant, quota)
        pipe = self._client.pipeline(transaction=False)
        by_shard: dict[int, list[str]] = defaultdict(list)
        replacing = False  # from a rejected value on, the chain's blocks were unreadable: all are replaced
        for (shard, key), frame in items:
            replacing = replacing or self._replaces(key)
            pipe.set(key, frame, px=self._block_ttl_ms, nx=nx and not replacing)
            by_shard[shard].append(key)
        if self.settings.budget_enabled:
            for shard, keys in by_shard.items():
                budget.account(pipe, self.keys.shard(shard), keys, self._index_ttl_ms, tenant)
        self._counters.add("round_trips")
        results = await pipe.execute(raise_on_error=False)
        written = 0
        for ((_, _), frame), ok in zip(items, results, strict=False):
            if ok is True:
                written += 1
                self._counters.add("bytes_written", len(frame))
            elif isinstance(ok, Exception):
                self._counters.add("errors")
        self._counters.add("blocks_written", written)
        return written

    def _replaces(self, key: str) -> bool:
        """Whether a block write replaces what `key` holds: its value was rejected (signed by neither key, or
        moved or altered), and so was the rest of its chain, never read after it. Otherwise a present block is left
        as it is (the same KV, content-addressed)."""
        if not self._rejected:
            return False
        with self._rejected_lock:
            return self._rejected.pop(key, 0) is None

    def _fit_budget(self, items: list[Any], limit: int) -> list[Any]:
        """The longest prefix of the batch that fits in the whole budget or quota `limit` (normally all of it)."""
        total, keep = 0, 0
        for _, frame in items:
            if total + len(frame) > limit:
                break
            total += len(frame)
            keep += 1
        return items[:keep]

    async def _make_room(self, incoming: int, tenant: str | None = None, quota: int = 0) -> None:
        """Evict LRU entries first if writing `incoming` bytes would cross a high watermark: `tenant`'s own if it
        would cross its `quota`'s (to the low watermark of its quota), then the namespace's if it would cross the
        budget's."""
        s = self.settings
        self._counters.add("round_trips")
        held, own = await budget.held(self._client, self.keys, tenant if quota else None)
        if quota and own + incoming > s.high_watermark * quota:
            target = max(0, int(s.low_watermark * quota) - incoming)
            result = await budget.evict(self._client, self.keys, own - target, tenant=tenant)
            self._count_eviction(result)
            self._counters.add("tenant_evictions", result.evicted_blocks)
            held -= result.evicted_bytes + result.stale_bytes
        if held + incoming <= s.high_watermark * s.budget_bytes:
            return
        # evict so that after this write the namespace sits at the low watermark
        target = max(0, int(s.low_watermark * s.budget_bytes) - incoming)
        self._count_eviction(await budget.evict(self._client, self.keys, held - target))

    def _count_eviction(self, result: budget.EvictionResult) -> None:
        self._counters.add("evictions", result.evicted_blocks)
        self._counters.add("evicted_bytes", result.evicted_bytes)
        self._counters.add("stale_removed", result.stale_blocks)

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

    async def reconcile(self) -> budget.EvictionResult:
        """Drop index entries of blocks Redis removed itself and recount the bytes held."""
        result = await self._admin(lambda: budget.reconcile(self._client, self.keys, self._index_ttl_ms))
        self._counters.add("stale_removed", result.stale_blocks)
        return result

    # -- sessions ---------------------------------------------------------------------------

    async def get_session(self, tenant: str, session_id: str) -> SessionRecord | None:
        return (await self.read_session(tenant, session_id)).value

    async def read_session(self, tenant: str, session_id: str) -> Result[SessionRecord | None]:
        """The record (FOUND), none (ABSENT: also a garbage record, which is dropped) or UNAVAILABLE."""
        key = self.keys.session(tenant, session_id)

        async def read() -> Any:
            pipe = self._client.pipeline(transaction=False)
            pipe.hgetall(key)
            pipe.pexpire(key, self._session_ttl_ms)
            self._counters.add("round_trips")
            return (await pipe.execute())[0]

        raw = await self._guarded(read, self.settings.op_timeout_s)
        if isinstance(raw, _Failed):
            return Result(Outcome.UNAVAILABLE, None)
        if not raw:
            return Result(Outcome.ABSENT, None)
        if self.signer is not None:
            named = {(k if isinstance(k, bytes) else str(k).encode()): v for k, v in raw.items()}
            if not self.signer.open_fields(key, named, FIELDS):
                self._reject(key, "a session record not signed under its key by an accepted frame key")
                return Result(Outcome.ABSENT, None)
        record = from_fields(raw, tenant, session_id)
        if record is None:
            self._counters.add("bad_records")
            fmt = raw.get(b"format", b"1")
            if fmt == b"1" or not fmt.isdigit():  # garbage, not a newer format: drop it so the id heals
                await self._guarded(lambda: self._client.delete(key), self.settings.op_timeout_s)
            return Result(Outcome.ABSENT, None)
        return Result(Outcome.FOUND, record)

    async def put_session(self, record: SessionRecord, expected_version: int | None) -> SessionRecord | None:
        """Compare-and-set: None = create only if absent. Returns the stored record, or None
        if the CAS lost (or Redis failed: then `dropped_writes` counts it)."""
        return (await self.write_session(record, expected_version)).value

    async def write_session(
        self, record: SessionRecord, expected_version: int | None
    ) -> Result[SessionRecord | None]:
        """`put_session` with what happened: STORED (the record as stored), CONFLICT or UNAVAILABLE."""
        key = self.keys.session(record.tenant, record.session_id)
        now = time.time()
        expected = "" if expected_version is None else str(int(expected_version))
        fields = to_fields(record, now)
        if self.signer is not None:
            fields += ["mac", self.signer.seal_fields(key, fields)]

        async def write() -> Any:
            self._counters.add("round_trips")
            return await self._client.eval(PUT_SESSION, 1, key, expected, self._session_ttl_ms, repr(now), *fields)

        result = await self._guarded(write, self.settings.op_timeout_s)
        if isinstance(result, _Failed):
            self._counters.add("dropped_writes")
            return Result(Outcome.UNAVAILABLE, None)
        version, created = int(result[0]), result[1]
        if version < 0:
            self._counters.add("cas_conflicts")
            return Result(Outcome.CONFLICT, None)
        return Result(Outcome.STORED, replace(record, version=version, created_at=float(created), updated_at=now))

    async def delete_session(self, tenant: str, session_id: str) -> bool:
        key = self.keys.session(tenant, session_id)
        result = await self._guarded(lambda: self._client.delete(key), self.settings.op_timeout_s)
        return not isinstance(result, _Failed) and int(result) > 0

    async def fork_session(self, tenant: str, src_id: str, dst_id: str) -> SessionRecord | None:
        """A new session sharing the parent's blocks; only the record is copied. None if the
        parent is missing or the new id is taken."""
        parent = await self.get_session(tenant, src_id)
        if parent is None:
            return None
        return await self.put_session(parent.forked(dst_id), expected_version=None)

    async def list_sessions(self, tenant: str | None = None, limit: int = 10_000) -> list[tuple[str, str]]:
        """(tenant, session id) pairs found by SCAN, sorted; at most `limit` of them."""
        pattern = self.keys.session_pattern(tenant)

        async def scan() -> list[tuple[str, str]]:
            found: set[tuple[str, str]] = set()
            async for raw in self._client.scan_iter(match=pattern, count=1000):
                parsed = self.keys.parse_session(raw.decode() if isinstance(raw, bytes) else str(raw))
                if parsed is not None:
                    found.add(parsed)
                if len(found) >= limit:
                    break
            return sorted(found)

        return await self._admin(scan)

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
